"""`gpuplane sweep ...`: create a sweep from a TOML file and/or options, list, show,
cancel, retry-failed (docs/sweeps.md)."""

import os

from .. import states
from .jobs import add_time_options, time_fields
from .common import (EXIT_OK, CliError, ago, command, env_pair, id_type, make_client, parents,
                     print_json, print_table)

sweep_id_type = id_type("sweep", "gpuplane sweep list")
RANDOM = ("uniform", "log_uniform", "int_uniform", "choice")


def add_parser(subparsers):
    conn, js, _ = parents()
    top = command(subparsers, "sweep", "sweeps: trials of a command template over parameters",
                  parents=(conn,))
    sub = top.add_subparsers(dest="sweep_command", metavar="SWEEP_COMMAND", required=True)

    p = command(sub, "create", "create a sweep from FILE.toml and/or options (options win "
                "over the file)", parents=(conn, js))
    p.add_argument("file", nargs="?", metavar="FILE.toml")
    p.add_argument("--name")
    p.add_argument("--command", dest="template", metavar="TEMPLATE",
                   help="the command with {param} placeholders, e.g. "
                        "'python train.py --lr {lr}'")
    p.add_argument("-d", "--dir", dest="working_dir", metavar="DIR",
                   help="working dir on the agent's host (default: the file's dir, else the "
                        "current dir)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=SPEC",
                   help="a parameter: bs=16,32,64 (a grid), lr=log_uniform:1e-4:1e-1, "
                        "wd=uniform:0:0.1, n=int_uniform:1:8, opt=choice:sgd,adam")
    p.add_argument("--trials", type=int, metavar="N", help="how many trials (random draws)")
    p.add_argument("--seed", type=int)
    p.add_argument("--sampler", choices=("tpe", "cmaes", "qmc", "random", "grid"),
                   help="ask Optuna's sampler for each trial's parameters as it launches "
                        "(needs pip install 'gpuplane[optuna]' on the server)")
    p.add_argument("--parallel", type=int, metavar="N", help="trials at once (default 1)")
    p.add_argument("-g", "--gpus", type=int, metavar="N", help="GPUs per trial (default 1)")
    p.add_argument("--cpu-only", action="store_true", default=None)
    p.add_argument("--priority", type=int)
    p.add_argument("--max-attempts", type=int, metavar="N")
    p.add_argument("--metric", help="the metric that decides (default: the experiment's "
                                    "primary metric)")
    p.add_argument("--direction", choices=("min", "max"))
    p.add_argument("--project", "-p")
    p.add_argument("--experiment", "-e")
    p.add_argument("--env", type=env_pair, action="append", default=[], metavar="K=V")
    p.add_argument("--watch", dest="watch_dir", metavar="DIR",
                   help="checkpoint directory to watch (relative to the working dir)")
    p.add_argument("--tb-dir", dest="tb_dir", metavar="DIR",
                   help="each trial's TensorBoard dir, e.g. tb/{trial} (relative to the "
                        "working dir)")
    p.add_argument("--eval-command", dest="eval_command", metavar="CMD",
                   help="how to evaluate one trial's checkpoint (run through /bin/sh -c by "
                        "`gpuplane ckpt evaluate ID`, with $GPUCTL_CHECKPOINT_PATH set)")
    p.add_argument("--keep-best", type=int, metavar="K",
                   help="checkpoint retention per trial: the best K by the metric")
    p.add_argument("--keep-last", type=int, metavar="L",
                   help="... and the last L of each run")
    p.add_argument("--early-stop", choices=("median", "asha", "optuna-median", "hyperband",
                                            "none"),
                   help="early stopping rule (optuna-median and hyperband need --sampler)")
    p.add_argument("--warmup-steps", type=int, help="median: steps before it judges")
    p.add_argument("--min-trials", type=int, help="median: other trials needed at a step")
    p.add_argument("--min-steps", type=int, help="asha: the first rung's step")
    p.add_argument("--eta", type=int, help="asha: keep the top 1/eta at each rung")
    add_time_options(p, trials=True)
    p.add_argument("cmd", nargs="*", metavar="CMD",
                   help="the template as an argv, after `--` (instead of --command)")
    p.set_defaults(func=cmd_create)

    p = command(sub, "list", "list sweeps, newest first", parents=(conn, js))
    p.add_argument("--state", help="RUNNING, STOPPED, DONE or CANCELLED")
    p.set_defaults(func=cmd_list)

    p = command(sub, "show", "a sweep: its trials with parameters, state and the decisive "
                "value, the best so far, stopped and why", parents=(conn, js))
    p.add_argument("sweep_id", type=sweep_id_type, metavar="ID")
    p.set_defaults(func=cmd_show)

    p = command(sub, "cancel", "launch no more trials and cancel the active ones",
                parents=(conn, js))
    p.add_argument("sweep_id", type=sweep_id_type, metavar="ID")
    p.set_defaults(func=cmd_cancel)

    p = command(sub, "retry-failed", "run the sweep's failed or lost trials again with their "
                "parameters", parents=(conn, js))
    p.add_argument("sweep_id", type=sweep_id_type, metavar="ID")
    p.set_defaults(func=cmd_retry)


def _value(text):
    """A parameter value from the command line: a number where it reads as one."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text, text)


def parse_param(text):
    """NAME=SPEC (see --param) -> (name, grid list or random table)."""
    name, sep, spec = text.partition("=")
    if not sep or not name or not spec:
        raise CliError(f"--param {text!r}: write NAME=SPEC, e.g. bs=16,32 or "
                       "lr=log_uniform:1e-4:1e-1", code=2)
    kind, colon, rest = spec.partition(":")
    if colon and kind in RANDOM:
        if kind == "choice":
            return name, {"type": kind, "values": [_value(v) for v in rest.split(",")]}
        parts = rest.split(":")
        if len(parts) != 2:
            raise CliError(f"--param {text!r}: a {kind} draw is {kind}:LOW:HIGH", code=2)
        low, high = (_value(v) for v in parts)
        return name, {"type": kind, "low": low, "high": high}
    return name, [_value(v) for v in spec.split(",")]


def build_spec(args):
    """The create body: the TOML file's tables, then the options over them."""
    spec, base_dir = {}, os.getcwd()
    if args.file:
        import tomllib
        try:
            with open(args.file, "rb") as f:
                spec = tomllib.load(f)
        except OSError as e:
            raise CliError(f"cannot read {args.file}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise CliError(f"{args.file} is not valid TOML: {e}") from None
        base_dir = os.path.dirname(os.path.abspath(args.file))
    for key in ("name", "trials", "seed", "sampler", "parallel", "gpus", "cpu_only", "priority",
                "max_attempts", "metric", "direction", "project", "experiment", "watch_dir",
                "tb_dir", "eval_command", "working_dir"):
        v = getattr(args, key, None)
        if v is not None:
            spec[key] = v
    for key, v in time_fields(args).items():
        if v is not None:
            if key == "time_limit_s":
                spec.pop("time_limit", None)     # --time over the file's time_limit
            spec[key] = v
    if args.template is not None and args.cmd:
        raise CliError("give the command once: --command TEMPLATE or after `--`", code=2)
    if args.template is not None:
        spec["command"] = args.template
    elif args.cmd:
        spec["command"] = list(args.cmd)
    if args.param:
        spec.setdefault("parameters", {})
        for text in args.param:
            name, p = parse_param(text)
            spec["parameters"][name] = p
    if args.env:
        spec["env"] = {**spec.get("env", {}), **dict(args.env)}
    if args.keep_best is not None or args.keep_last is not None:
        spec["retention"] = dict(spec.get("retention") or {})
        for k in ("keep_best", "keep_last"):
            if getattr(args, k) is not None:
                spec["retention"][k] = getattr(args, k)
    if args.early_stop == "none":
        spec.pop("early_stopping", None)
    elif args.early_stop or any(getattr(args, k) is not None for k in
                                ("warmup_steps", "min_trials", "min_steps", "eta")):
        es = dict(spec.get("early_stopping") or {})
        if args.early_stop:
            es = {"rule": args.early_stop} if es.get("rule") != args.early_stop else es
        for k in ("warmup_steps", "min_trials", "min_steps", "eta"):
            if getattr(args, k) is not None:
                es[k] = getattr(args, k)
        spec["early_stopping"] = es
    wd = spec.get("working_dir")
    spec["working_dir"] = os.path.normpath(os.path.join(base_dir, wd)) if wd else base_dir
    if "command" not in spec:
        raise CliError("no command: give --command TEMPLATE (or `command = ...` in the file)",
                       code=2)
    return spec


def cmd_create(args):
    spec = build_spec(args)
    sweep = make_client(args).create_sweep(spec)
    if args.json:
        print_json(sweep)
        return EXIT_OK
    print(f"sweep {sweep['id']} ({sweep['name']}): {sweep['trials']} trials, "
          f"{sweep['parallel']} at once; `gpuplane sweep show {sweep['id']}`")
    return EXIT_OK


def _counts(by_state):
    order = states.TRIAL_STATES
    words = {"EARLY_STOPPED": "early-stopped", "STOPPED_ON_EVENT": "stopped on an event"}
    return ", ".join(f"{by_state[s]} {words.get(s, s.lower())}" for s in order
                     if by_state.get(s))


def cmd_list(args):
    rows = make_client(args).list_sweeps(state=args.state)["sweeps"]
    if args.json:
        print_json(rows)
        return EXIT_OK
    print_table([(s["id"], s["name"], s["experiment"], s["state"], s["trials"],
                  _counts(s["trial_states"]), ago(s["created_at"])) for s in rows],
                ("ID", "NAME", "EXPERIMENT", "STATE", "TRIALS", "BY STATE", "CREATED"))
    return EXIT_OK


def _num(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else str(v)


def show_text(s):
    metric = s["metric"]
    lines = [f"sweep {s['id']} ({s['name']}) {s['state']}  experiment "
             f"{s['project']}/{s['experiment'] or '-'}  {s['trials']} trials, "
             f"{s['parallel']} at once"]
    if s.get("trial_states"):
        lines.append(f"trials: {_counts(s['trial_states'])}")
    if metric["key"]:
        lines.append(f"metric {metric['key']} ({metric['direction'] or 'direction unknown'}, "
                     f"from the {metric['from']})")
    else:
        lines.append("metric: none yet (give --metric, or define the experiment's primary "
                     "metric)")
    if s.get("sampler"):
        study = s.get("study") or {}
        said = ", ".join(f"{n} {k.lower()}" for k, n in sorted(study.get("trials", {}).items()))
        lines.append(f"sampler: {s['sampler']} (Optuna" + (f"; study: {said}" if said else "")
                     + ")")
    es = s.get("early_stopping")
    if es:
        lines.append("early stopping: " + ", ".join(f"{k} {v}" for k, v in es.items()))
    if s["stop_reason"]:
        lines.append(f"stopped: {s['stop_reason']}")
    b = s.get("best")
    if not b and s.get("best_missing"):
        lines.append(f"best: none ({s['best_missing']})")
    if b:
        said = " ".join(f"{k}={_num(v)}" for k, v in b["params"].items())
        best = "best" if s["state"] in ("DONE", "STOPPED", "CANCELLED") else "best so far"
        lines.append(f"{best}: trial {b['trial']} (job {b['job_id']}) "
                     f"{metric['key']} = {_num(b['value'])} at step {b['step']}  {said}")
    return "\n".join(lines)


def cmd_show(args):
    s = make_client(args).get_sweep(args.sweep_id)
    if args.json:
        print_json(s)
        return EXIT_OK
    print(show_text(s))
    names = list(s["parameters"])
    rows = []
    for t in s["trials_detail"]:
        v = t["value"] or {}
        note_ = ""
        if t["stopped"]:
            note_ = t["stopped"].get("message", "")
        elif t["failure_kind"] and t["state"] == "FAILED":
            note_ = t["failure_kind"] + (f" (exit {t['exit_code']})" if t["exit_code"] else "")
        rows.append([t["number"], t["job_id"] or "", t["state"],
                     *(_num((t["params"] or {}).get(n)) for n in names),
                     _num(v.get("value")), _num(v.get("step")), note_])
    print()
    print_table(rows, ["TRIAL", "JOB", "STATE", *(n.upper() for n in names),
                       (s["metric"]["key"] or "VALUE").upper(), "AT STEP", "NOTE"])
    return EXIT_OK


def cmd_cancel(args):
    s = make_client(args).cancel_sweep(args.sweep_id)
    if args.json:
        print_json(s)
        return EXIT_OK
    print(f"sweep {s['id']} cancelled; its active trials are being cancelled")
    return EXIT_OK


def cmd_retry(args):
    s = make_client(args).retry_failed_sweep(args.sweep_id)
    if args.json:
        print_json(s)
        return EXIT_OK
    print(f"sweep {s['id']}: trials {', '.join(map(str, s['retried']))} will run again "
          "with their parameters")
    return EXIT_OK

