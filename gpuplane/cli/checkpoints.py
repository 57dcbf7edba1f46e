"""`gpuplane ckpt ...`, `project ...`, `exp ...`, `metric ...` and `import-run`: the
checkpoint registry and what decides between runs (docs/checkpoints.md)."""

import argparse

from ..states import STOP_REASONS
from .common import (EXIT_ERROR, EXIT_OK, CliError, ago, command, id_type, make_client, note,
                     parents, print_json, print_next_actions, print_table)

ckpt_id_type = id_type("checkpoint", "gpuplane ckpt list")
run_id_type = id_type("run", "gpuplane run list")


def add_parser(subparsers):
    conn, js, _ = parents()

    # -- ckpt ---------------------------------------------------------------------------
    ck = command(subparsers, "ckpt", "checkpoints: list, show, evaluate, recommend, compare",
                 parents=(conn,))
    cs = ck.add_subparsers(dest="ckpt_command", metavar="CKPT_COMMAND", required=True)
    p = command(cs, "list", "list checkpoints (of a run, an experiment or a project)",
                parents=(conn, js))
    p.add_argument("--run", type=run_id_type, metavar="RUN")
    p.add_argument("--project", metavar="P")
    p.add_argument("--experiment", metavar="E")
    p.add_argument("--limit", type=int, default=1000)
    p.set_defaults(func=cmd_ckpt_list)
    p = command(cs, "show", "a checkpoint: its metrics at the nearest step, its evaluations",
                parents=(conn, js))
    p.add_argument("checkpoint_id", type=ckpt_id_type, metavar="ID")
    p.set_defaults(func=cmd_ckpt_show)
    p = command(cs, "evaluate", "queue an EVALUATE job for a checkpoint: gpuplane ckpt "
                "evaluate ID [-- CMD ARGS...] (default: the training job's --eval-command)",
                parents=(conn, js))
    p.add_argument("checkpoint_id", type=ckpt_id_type, metavar="ID")
    p.add_argument("-d", "--dir", dest="working_dir", metavar="DIR",
                   help="working dir on the agent's host (default: the training job's)")
    p.add_argument("-g", "--gpus", type=int, metavar="N", help="GPUs (default: the job's)")
    p.add_argument("--cpu-only", action="store_true", default=None)
    p.add_argument("cmd", nargs="*", metavar="CMD", help="the command, after `--`")
    p.set_defaults(func=cmd_ckpt_evaluate)
    p = command(cs, "recommend", "the checkpoint to keep, by the primary metric, with the "
                "reason, the runner-up and the margin", parents=(conn, js))
    p.add_argument("--run", type=run_id_type, metavar="RUN")
    p.add_argument("--project", metavar="P")
    p.add_argument("--experiment", metavar="E")
    p.add_argument("--sweep", type=id_type("sweep", "gpuplane sweep list"), metavar="SWEEP",
                   help="choose across all trials of this sweep")
    p.add_argument("--key", metavar="KEY", help="decide by this metric instead")
    p.set_defaults(func=cmd_ckpt_recommend)

    p = command(cs, "compare", "the checkpoints of runs ranked by the metric that decides: "
                "evaluated ones first, then by their training value", parents=(conn, js))
    p.add_argument("run_ids", type=run_id_type, nargs="+", metavar="RUN")
    p.add_argument("--key", metavar="KEY", help="rank by this metric instead")
    p.set_defaults(func=cmd_ckpt_compare)

    p = command(cs, "pin", "pin a checkpoint: retention always keeps it", parents=(conn, js))
    p.add_argument("checkpoint_id", type=ckpt_id_type, metavar="ID")
    p.add_argument("--unpin", action="store_true", help="take the pin off")
    p.set_defaults(func=cmd_ckpt_pin)
    p = command(cs, "prune", "apply checkpoint retention to a job: keep the best K by the "
                "metric that decides, the last L of each run, every evaluated or pinned one; "
                "the agent deletes the rest", parents=(conn, js))
    p.add_argument("--job", type=int, required=True, metavar="JOB")
    p.add_argument("--keep-best", type=int, metavar="K", help="default: the job's policy, else 1")
    p.add_argument("--keep-last", type=int, metavar="L", help="default: the job's policy, else 1")
    p.add_argument("--dry-run", action="store_true", help="list what would go; delete nothing")
    p.set_defaults(func=cmd_ckpt_prune)

    # -- project / exp ------------------------------------------------------------------
    for noun, help_ in (("project", "projects: list, create, rename, describe, delete"),
                        ("exp", "experiments of a project: list, create, rename, delete, "
                                "runs by best value")):
        top = command(subparsers, noun, help_, parents=(conn,))
        sub = top.add_subparsers(dest=f"{noun}_command", metavar="COMMAND", required=True)
        scope = argparse.ArgumentParser(add_help=False)
        if noun == "exp":
            scope.add_argument("--project", "-p", metavar="P", default="default",
                               help="its project (default: default)")
        p = command(sub, "list", f"list {noun}s", parents=(conn, js))
        if noun == "exp":
            p.add_argument("--project", "-p", metavar="P", help="only this project's")
        p.add_argument("--archived", action="store_true", help="include archived ones")
        p.set_defaults(func=cmd_list, noun=noun)
        p = command(sub, "create", f"create a {noun}", parents=(conn, js, scope))
        p.add_argument("name")
        p.add_argument("--description", default="")
        p.set_defaults(func=cmd_create, noun=noun)
        p = command(sub, "rename", f"rename a {noun} (its runs and jobs follow)",
                    parents=(conn, js, scope))
        p.add_argument("name")
        p.add_argument("new_name")
        p.set_defaults(func=cmd_update, noun=noun)
        if noun == "project":
            p = command(sub, "defaults", "a project's scheduling defaults: its jobs' time "
                        "limit when they give none, the most they may ask for, whether "
                        "they are preemptible (docs/scheduling.md); no option shows them",
                        parents=(conn, js))
            p.add_argument("name")
            p.add_argument("--time", type=_limit_or_none, metavar="T", default=_UNSET,
                           help="default time limit (2h, 90m, 1:30:00; none clears it)")
            p.add_argument("--max-time", type=_limit_or_none, metavar="T", default=_UNSET,
                           help="the longest limit a job may ask for (none clears it)")
            p.add_argument("--preemptible", action=argparse.BooleanOptionalAction,
                           default=None, help="its jobs are preemptible unless they say not")
            p.set_defaults(func=cmd_project_defaults, noun=noun)
        if noun == "exp":
            p = command(sub, "retention", "the checkpoint retention policy of an experiment's "
                        "jobs that have none of their own (docs/checkpoints.md)",
                        parents=(conn, js, scope))
            p.add_argument("name")
            p.add_argument("--keep-best", type=int, metavar="K")
            p.add_argument("--keep-last", type=int, metavar="L")
            p.add_argument("--off", action="store_true", help="no policy")
            p.set_defaults(func=cmd_exp_retention, noun=noun)
        p = command(sub, "describe", f"set a {noun}'s description", parents=(conn, js, scope))
        p.add_argument("name")
        p.add_argument("description")
        p.set_defaults(func=cmd_update, noun=noun, new_name=None)
        p = command(sub, "delete", f"delete a {noun}; one that holds runs is refused unless "
                    "--archive (which hides it and keeps the runs)", parents=(conn, js, scope))
        p.add_argument("name")
        p.add_argument("--archive", action="store_true")
        p.set_defaults(func=cmd_delete, noun=noun)
        if noun == "exp":
            p = command(sub, "runs", "the experiment's runs, best primary value first",
                        parents=(conn, js, scope))
            p.add_argument("name")
            p.add_argument("--key", metavar="KEY", help="rank by this metric instead")
            p.add_argument("--sort", metavar="PARAM",
                           help="order by this parameter (a column) instead of the metric")
            p.set_defaults(func=cmd_exp_runs)

    # -- metric -------------------------------------------------------------------------
    m = command(subparsers, "metric", "metric definitions: direction and the primary metric",
                parents=(conn,))
    ms = m.add_subparsers(dest="metric_command", metavar="METRIC_COMMAND", required=True)
    mscope = argparse.ArgumentParser(add_help=False)
    mscope.add_argument("--project", metavar="P", help="for this project (default: global)")
    mscope.add_argument("--experiment", metavar="E", help="for this experiment of --project")
    p = command(ms, "set", "define a metric: gpuplane metric set eval/acc --direction max "
                "--primary [--project P [--experiment E]]", parents=(conn, js, mscope))
    p.add_argument("key")
    p.add_argument("--direction", choices=("min", "max"))
    p.add_argument("--primary", action="store_true", default=None,
                   help="the metric that decides (one per scope)")
    p.add_argument("--not-primary", dest="primary", action="store_false")
    p.add_argument("--description")
    p.set_defaults(func=cmd_metric_set)
    p = command(ms, "list", "definitions that apply to a scope (all when none is given)",
                parents=(conn, js, mscope))
    p.set_defaults(func=cmd_metric_list)
    p = command(ms, "unset", "remove a definition", parents=(conn, js, mscope))
    p.add_argument("key")
    p.set_defaults(func=cmd_metric_unset)

    # -- import-run ---------------------------------------------------------------------
    p = command(subparsers, "import-run", "turn the training logs (TensorBoard event files, "
                "trainer_state.json, Keras / Lightning CSV logs, YOLO results.csv) and "
                "checkpoints under PATH into an imported run (again: adds nothing)",
                parents=(conn, js))
    p.add_argument("dir", metavar="PATH", help="a directory, or one log file")
    p.add_argument("--project", required=True, metavar="P")
    p.add_argument("--experiment", default="", metavar="E")
    p.add_argument("--name", metavar="NAME", help="run name (default: DIR's name)")
    p.set_defaults(func=cmd_import_run)


def _value(v):
    return f"{v:.6g}" if isinstance(v, float) else v


def _column_format(values):
    """One precision for a column of values (0.4182 beside 0.520878 reads as a
    difference): the fewest decimals, up to 6 significant digits, that tell them apart."""
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    if not finite:
        return _value
    import math
    top = max(abs(v) for v in finite) or 1.0
    lead = int(math.floor(math.log10(top)))
    decimals = most = max(0, 5 - lead)              # 6 significant digits of the largest
    for d in range(max(0, 3 - lead), most + 1):     # from 4 of them, until all differ
        if len({round(v, d) for v in finite}) == len(set(finite)):
            decimals = d
            break
    return lambda v: f"{v:.{decimals}f}" if isinstance(v, float) else v


# -- ckpt ------------------------------------------------------------------------------------

def cmd_ckpt_list(args):
    out = make_client(args).list_checkpoints(run=args.run, project=args.project,
                                        experiment=args.experiment, limit=args.limit)
    if args.json:
        print_json(out)
        return EXIT_OK
    print_table([(c["id"], c["run_id"], c["step"], c["epoch"], c["format"], c["size_bytes"],
                  c["path"]) for c in out["checkpoints"]],
                ("ID", "RUN", "STEP", "EPOCH", "FORMAT", "BYTES", "PATH"))
    return EXIT_OK


def cmd_ckpt_show(args):
    c = make_client(args).get_checkpoint(args.checkpoint_id)
    if args.json:
        print_json(c)
        return EXIT_OK
    print(f"checkpoint {c['id']}  run {c['run_id']}  step {c['step']} ({c['step_source']})"
          f"  {c['format'] or ''}  {c['path']}")
    if c["metrics"]:
        print("metrics at the nearest step:")
        print_table([(k, v["step"], _value(v["value"])) for k, v in c["metrics"].items()],
                    ("  KEY", "STEP", "VALUE"))
    for e in c["evaluations"]:
        res = ", ".join(f"{k}={_value(v['value'])}" for k, v in e["results"].items())
        print(f"evaluation {e['id']}: {e['state']} (job {e['job_id']})"
              + (f": {res}" if res else "")
              + (f" — {e['message']}" if e["state"] == "FAILED" and e["message"] else ""))
    return EXIT_OK


def cmd_ckpt_evaluate(args):
    cmd = args.cmd or None
    if cmd and len(cmd) == 1 and any(ch.isspace() for ch in cmd[0]):
        cmd = cmd[0]
    e = make_client(args).create_evaluation(args.checkpoint_id, command=cmd,
                                             working_dir=args.working_dir, gpus=args.gpus,
                                             cpu_only=args.cpu_only)
    if args.json:
        print_json(e)
    else:
        print(e["id"])
        note(f"evaluation {e['id']} of checkpoint {e['checkpoint_id']} queued as job "
             f"{e['job_id']}; follow it with `gpuplane logs -f {e['job_id']}`")
    return EXIT_OK


def cmd_ckpt_recommend(args):
    if not (args.run or args.project or args.experiment or args.sweep):
        raise CliError("say where to choose from: --experiment E [--project P], --project P, "
                       "--run RUN or --sweep SWEEP", code=2)
    r = make_client(args).recommend_checkpoint(run=args.run, project=args.project,
                                               experiment=args.experiment, key=args.key,
                                               sweep=args.sweep)
    if args.json:
        print_json(r)
        return EXIT_OK if r["checkpoint"] else EXIT_ERROR
    c = r["checkpoint"]
    if c is None:
        print(r["reason"])
        print_next_actions(r.get("next_actions") or [])
        return EXIT_ERROR
    print(f"checkpoint {c['checkpoint_id']}  run {c['run_id']}  step {c['step']}  "
          f"{r['key']} = {_value(c['value'])} ({c['source']})  {c['path']}")
    print(r["reason"])
    print_next_actions(r.get("next_actions") or [])
    return EXIT_OK


def cmd_ckpt_compare(args):
    r = make_client(args).compare_checkpoints(args.run_ids, key=args.key)
    if args.json:
        print_json(r)
        return EXIT_OK
    print(f"ranked by {r['key']}" + (f" ({'lower' if r['direction'] == 'min' else 'higher'} "
                                     "is better)" if r.get("direction") else ""))
    print_table([[c["rank"], c["checkpoint_id"], c["run_id"], c["step"], _value(c["value"]),
                  c["source"], c["path"]] for c in r["ranked"]],
                ["RANK", "CKPT", "RUN", "STEP", r["key"], "FROM", "PATH"])
    if r["unranked"]:
        print(f"not ranked (no {r['key']} near their step): "
              + ", ".join(str(c["checkpoint_id"]) for c in r["unranked"]))
    print_next_actions(r.get("next_actions") or [])
    return EXIT_OK


def cmd_ckpt_pin(args):
    c = make_client(args).pin_checkpoint(args.checkpoint_id, pinned=not args.unpin)
    if args.json:
        print_json(c)
    else:
        print(f"checkpoint {c['id']} {'pinned' if c['pinned'] else 'unpinned'}: {c['path']}")
    return EXIT_OK


def cmd_ckpt_prune(args):
    r = make_client(args).prune_job_checkpoints(args.job, keep_best=args.keep_best,
                                                keep_last=args.keep_last,
                                                dry_run=args.dry_run)
    if args.json:
        print_json(r)
        return EXIT_OK
    p = r["policy"]
    print(f"job {r['job_id']}: keep best {p['keep_best']} by {r['metric']['key']}, last "
          f"{p['keep_last']} of each run, every evaluated or pinned one")
    print_table([(c["checkpoint_id"], c["step"], c["reason"], c["path"]) for c in r["keep"]],
                ("KEEP", "STEP", "WHY", "PATH"))
    verb = "would delete" if r["dry_run"] else "deleting"
    print(f"{verb} {len(r['delete'])} checkpoints ({r['bytes']} bytes)")
    if r["delete"]:
        print_table([(c["checkpoint_id"], c["step"], c["node"], c["path"]) for c in r["delete"]],
                    ("DELETE", "STEP", "NODE", "PATH"))
    for node, ok in r["sent"].items():
        if not ok:
            print(f"node {node} is not connected: its files stay until the next prune")
    return EXIT_OK


# -- project / exp -----------------------------------------------------------------------------

def cmd_list(args):
    client = make_client(args)
    if args.noun == "project":
        rows = client.list_projects(archived=args.archived)["projects"]
        if args.json:
            print_json(rows)
            return EXIT_OK
        print_table([(p["name"], p["experiments"], p["runs"], "yes" if p["archived"] else "",
                      ago(p["created_at"]), p["description"]) for p in rows],
                    ("PROJECT", "EXPERIMENTS", "RUNS", "ARCHIVED", "CREATED", "DESCRIPTION"))
        return EXIT_OK
    rows = client.list_experiments(project=args.project, archived=args.archived)["experiments"]
    if args.json:
        print_json(rows)
        return EXIT_OK
    print_table([(e["project"], e["name"], e["runs"], "yes" if e["archived"] else "",
                  ago(e["created_at"]), e["description"]) for e in rows],
                ("PROJECT", "EXPERIMENT", "RUNS", "ARCHIVED", "CREATED", "DESCRIPTION"))
    return EXIT_OK


def _done(args, obj, text):
    if args.json:
        print_json(obj)
    else:
        print(text)
    return EXIT_OK


def cmd_create(args):
    client = make_client(args)
    if args.noun == "project":
        obj = client.create_project(args.name, args.description)
    else:
        obj = client.create_experiment(args.project, args.name, args.description)
    return _done(args, obj, f"created {args.noun} {args.name}")


def cmd_update(args):
    fields = {}
    if args.new_name is not None:
        fields["name"] = args.new_name
    if getattr(args, "description", None) is not None:
        fields["description"] = args.description
    client = make_client(args)
    if args.noun == "project":
        obj = client.update_project(args.name, fields)
    else:
        obj = client.update_experiment(args.project, args.name, fields)
    return _done(args, obj, f"{args.noun} {obj['name']}")


_UNSET = object()


def _limit_or_none(text):
    if text.strip().lower() == "none":
        return None
    from .jobs import time_limit_arg
    return time_limit_arg(text)


def cmd_project_defaults(args):
    from gpuplane import timelimit
    fields = {k: v for k, v in (("time_limit", args.time), ("max_time_limit", args.max_time))
              if v is not _UNSET}
    if args.preemptible is not None:
        fields["preemptible"] = args.preemptible
    client = make_client(args)
    obj = (client.update_project(args.name, fields) if fields else
           client.get_project(args.name))
    said = ", ".join(x for x in (
        f"time limit {timelimit.describe(obj['time_limit_s'])}" if obj.get("time_limit_s")
        else "no default time limit",
        f"at most {timelimit.describe(obj['max_time_limit_s'])}"
        if obj.get("max_time_limit_s") else "no maximum",
        "preemptible" if obj.get("preemptible") else "not preemptible") if x)
    return _done(args, obj, f"project {obj['name']}: {said}")


def cmd_exp_retention(args):
    policy = False if args.off else {k: v for k, v in (("keep_best", args.keep_best),
                                                      ("keep_last", args.keep_last))
                                    if v is not None}
    obj = make_client(args).update_experiment(args.project, args.name, {"retention": policy})
    r = obj.get("retention")
    return _done(args, obj, f"experiment {obj['name']}: " + (
        f"keep the best {r['keep_best']} and the last {r['keep_last']} of each run" if r
        else "no retention policy"))


def cmd_delete(args):
    client = make_client(args)
    if args.noun == "project":
        obj = client.delete_project(args.name, archive=args.archive)
    else:
        obj = client.delete_experiment(args.project, args.name, archive=args.archive)
    return _done(args, obj, f"{'deleted' if obj.get('deleted') else 'archived'} {args.noun} "
                            f"{args.name}")


def cmd_exp_runs(args):
    out = make_client(args).list_experiment_runs(args.project, args.name, key=args.key)
    if args.json:
        print_json(out)
        return EXIT_OK
    m = out["metric"]
    if m.get("key"):
        note(f"ranked by {m['key']} ({m['direction']}, {m['primary_from']})")
    runs = out["runs"]
    # the parameters that differ between the runs, as columns (gpuplane/params.py)
    names = sorted({k for r in runs for k in r.get("params") or {}})
    cols = [k for k in names if len({repr((r.get("params") or {}).get(k)) for r in runs}) > 1]
    if args.sort:
        if args.sort not in names:
            raise CliError(f"no run has the parameter {args.sort!r}; they have: "
                           f"{', '.join(names) or 'none'}", code=2)
        cols = [args.sort] + [c for c in cols if c != args.sort]
        runs = sorted(runs, key=lambda r: _order((r.get("params") or {}).get(args.sort)))
    rows = []
    # a sweep's trials say which: "1 #2" (sweep 1, trial 2)
    trials = {r["id"]: s for r in runs
              if isinstance(s := (r.get("config") or {}).get("sweep"), dict)}
    values = [v for r in runs for v in ((r.get("best_evaluated") or r.get("best") or {})
                                        .get("value"),) if isinstance(v, float)]
    fmt = _column_format(values)
    for r in runs:
        ev, tr = r.get("best_evaluated"), r.get("best")
        if ev:
            best = (fmt(ev["value"]), ev["step"], f"evaluation of checkpoint "
                                                  f"{ev['checkpoint_id']}")
        else:
            best = (tr and fmt(tr["value"]), tr and tr["step"], tr and "training")
        sweep = trials.get(r["id"])
        stopped = r["state"] == "CANCELLED" and r.get("failure_kind") in STOP_REASONS
        rows.append((r["id"], r["name"], r["failure_kind"] if stopped else r["state"], *best,
                     *((r.get("params") or {}).get(c) for c in cols),
                     *([f"{sweep.get('id')} #{sweep.get('trial')}" if sweep else ""]
                       if trials else [])))
    print_table(rows, ("RUN", "NAME", "STATE", "BEST", "AT STEP", "FROM",
                       *(c.upper() for c in cols), *(["SWEEP"] if trials else [])))
    return EXIT_OK


def _order(v):
    # numbers before text before missing, each in its own order
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, v, "")
    return (1, 0, str(v)) if v is not None else (2, 0, "")


# -- metric ------------------------------------------------------------------------------------

def _scope(args):
    if args.experiment and not args.project:
        raise CliError("--experiment needs --project (experiments live in a project)", code=2)
    return args.project, args.experiment


def cmd_metric_set(args):
    project, experiment = _scope(args)
    d = make_client(args).set_metric_definition(
        args.key, project=project, experiment=experiment, direction=args.direction,
        primary=args.primary, description=args.description)
    where = (f"experiment {project}/{experiment}" if experiment else
             f"project {project}" if project else "global")
    return _done(args, d, f"{d['key']}: {d['effective_direction']}"
                          f"{', primary' if d['primary'] else ''} ({where})")


def cmd_metric_list(args):
    project, experiment = _scope(args)
    out = make_client(args).list_metric_definitions(project=project, experiment=experiment)
    if args.json:
        print_json(out)
        return EXIT_OK
    print_table([(d["key"], d["scope"], d["project"] or "-", d["experiment"] or "-",
                  d["direction"] or "(inherit)", "yes" if d["primary"] else "")
                 for d in out["definitions"]],
                ("KEY", "SCOPE", "PROJECT", "EXPERIMENT", "DIRECTION", "PRIMARY"))
    p = out["primary"]
    if project is not None:
        note(f"primary here: {p['key']} (from {p['from']})" if p["key"] else
             "no primary metric here; set one with `gpuplane metric set KEY --primary`")
    return EXIT_OK


def cmd_metric_unset(args):
    project, experiment = _scope(args)
    out = make_client(args).delete_metric_definition(args.key, project=project,
                                                     experiment=experiment)
    return _done(args, out, f"removed {args.key}")


def cmd_import_run(args):
    from . import importer
    out = importer.import_dir(make_client(args), args.dir, project=args.project,
                              experiment=args.experiment, name=args.name, progress=note)
    return _done(args, out, str(out["run_id"]))
