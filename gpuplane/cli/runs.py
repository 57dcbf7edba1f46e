"""`gpuplane run list` and `gpuplane run show ID`: runs and their metrics at a glance.

`run show` prints per metric the latest and best value, the trend and a small sparkline of
the whole run (a max_points=20 series, the mean of each bucket).
"""
import json
import math

from .common import (EXIT_OK, EXIT_USAGE, CliError, ago, clock, duration, id_type, job_id_type, make_client, note,
                     parents, positive_int, print_json, print_table)

SPARKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 20


run_id_type = id_type("run", "gpuplane run list")


def run_ref(text):
    """A run id, or job:ID (the latest run of that job)."""
    if text.lower().startswith("job:"):
        return ("job", job_id_type(text[4:]))
    return ("run", run_id_type(text))


def _resolve_run(client, args):
    if (args.run_id is None) == (args.for_job is None):
        raise CliError("give a run id, or --job ID for a job's run (e.g. `gpuplane run show "
                       "--job 2`)", EXIT_USAGE)
    kind, number = args.run_id if args.run_id is not None else ("job", args.for_job)
    if kind == "run":
        return client.get_run(number)
    runs = client.list_runs(job_id=number, limit=1)
    if not runs:
        job = client.get_job(number)
        raise CliError(f"job {number} has no run yet (it is {job['state']}; a run starts "
                       f"with each attempt); `gpuplane job show {number}` says more")
    return client.get_run(runs[0]["id"])


def add_parser(subparsers):
    conn, js, _ = parents()
    run = subparsers.add_parser("run", help="list runs and show their metrics",
                                description="list runs and show their metrics")
    sub = run.add_subparsers(dest="run_command", metavar="SUBCOMMAND", required=True)

    p = sub.add_parser("list", help="list runs, newest first", description="list runs, "
                       "newest first", parents=[conn, js])
    p.add_argument("--project", metavar="P", help="only runs of this project")
    p.add_argument("--experiment", metavar="E", help="only runs of this experiment")
    p.add_argument("--job", type=job_id_type, metavar="ID", help="only the runs of this job")
    p.add_argument("--limit", type=positive_int, default=50,
                   help="at most this many (default 50)")
    p.set_defaults(func=cmd_run_list)

    p = sub.add_parser("show", help="show a run: per metric latest, best, trend, sparkline",
                       description="show a run: per metric latest, best, trend and a "
                       "sparkline of the whole run. Run ids are not job ids: for a job's "
                       "run give --job ID (or job:ID), which shows its latest attempt's run.",
                       parents=[conn, js])
    p.add_argument("run_id", type=run_ref, metavar="ID", nargs="?",
                   help="a run id, or job:ID for a job's latest run")
    p.add_argument("--job", type=job_id_type, metavar="ID", dest="for_job",
                   help="the run of this job's latest attempt")
    p.add_argument("--all", action="store_true", dest="all_keys",
                   help="also the TensorBoard copies (tb/KEY) of curves the SDK logs as KEY")
    p.set_defaults(func=cmd_run_show)

    p = sub.add_parser("compare", help="runs side by side: per metric best and final, the "
                       "winner, whether it wins by more than the noise, the settings that "
                       "differ", description="runs side by side (compare_runs over MCP)",
                       parents=[conn, js])
    p.add_argument("run_ids", type=run_id_type, nargs="+", metavar="RUN")
    p.add_argument("--key", metavar="KEY", help="the metric that decides (default: the "
                   "primary)")
    p.add_argument("--metric", action="append", dest="keys", metavar="KEY",
                   help="show only this metric (repeat for more)")
    p.set_defaults(func=cmd_run_compare)


def cmd_run_compare(args):
    from .common import print_next_actions
    if len(args.run_ids) < 2:
        raise CliError("compare at least two runs: gpuplane run compare RUN RUN ...",
                       EXIT_USAGE)
    c = make_client(args).compare_runs(args.run_ids, keys=args.keys, key=args.key)
    if args.json:
        print_json(c)
        return EXIT_OK
    print(c["summary"])
    for m in c["metrics"]:
        if not m["runs"]:
            continue
        print(f"\n{m['key']}" + (f" ({'lower' if m['direction'] == 'min' else 'higher'} "
                                  "is better)" if m["direction"] else " (goal unknown)"))
        print_table([[r["run_id"], _value_at(r["best"], r["best_step"]),
                      _value_at(r["final"], r["final_step"]), r["points"],
                      "winner" if r["run_id"] == m["winner"] else None]
                     for r in m["runs"]], ["  RUN", "BEST", "FINAL", "POINTS", ""])
    for key, values in (c.get("config_diff") or {}).items():
        print(f"\n{key}: " + ", ".join(f"run {r} {v}" for r, v in values.items()))
    print_next_actions(c.get("next_actions") or [])
    return EXIT_OK


def _value_at(value, step):
    if value is None:
        return None
    return f"{fmt(value)} @{step}" if step is not None else fmt(value)


def cmd_run_list(args):
    runs = make_client(args).list_runs(project=args.project, experiment=args.experiment,
                                           job_id=args.job, limit=args.limit)
    if args.json:
        print_json(runs)
        return EXIT_OK
    if not runs:
        note("no runs" + _filters(args) + "; a job's attempt or the SDK "
                  "(`gpuctl.init()`) makes one")
        return EXIT_OK
    rows = []
    for r in runs:
        job = f"{r['job_id']}/{r.get('attempt') or 1}" if r.get("job_id") else None
        # an evaluation's run says which checkpoint it scored, so it is not read as a training
        kind = (f"eval of ckpt {r.get('parent_checkpoint_id')}" if r.get("kind") == "EVALUATE"
                else "train")
        rows.append([r["id"], r.get("name") or None, r.get("project"),
                     r.get("experiment") or None, kind, r.get("state"), r.get("source"), job,
                     ago(r.get("created_at")),
                     duration(r.get("started_at"), r.get("ended_at"))])
    print_table(rows, ["ID", "NAME", "PROJECT", "EXPERIMENT", "KIND", "STATE", "SOURCE",
                       "JOB/ATTEMPT", "CREATED", "RAN"])
    return EXIT_OK


def _filters(args):
    parts = [f"{name} {value}" for name, value in (("in project", args.project),
             ("in experiment", args.experiment), ("of job", args.job)) if value]
    return (" " + " ".join(parts)) if parts else ""


def cmd_run_show(args):
    client = make_client(args)
    run = _resolve_run(client, args)
    keys = client.list_run_metrics(run["id"])
    hidden = [] if args.all_keys else [k for k in keys if k.get("duplicate_of")]
    keys = [k for k in keys if k not in hidden]
    for k in keys:
        series = client.get_run_metric(run["id"], k["key"], max_points=SPARK_WIDTH)
        k["sparkline"] = sparkline(series["points"])
    # the verdict in diagnose_run's own words (the semantic layer's; the dashboard shows
    # the same answer beside the run's curves)
    diagnosis = client.get_run_diagnosis(run["id"])
    if args.json:
        print_json({"run": run, "metrics": keys, "diagnosis": diagnosis})
        return EXIT_OK
    title = f"run {run['id']}" + (f" {run['name']}" if run.get("name") else "")
    where = "/".join(x for x in (run.get("project"), run.get("experiment")) if x)
    print(f"{title}  {run.get('state')}  {where}".rstrip())
    facts = [("source", run.get("source")),
             ("job", f"{run['job_id']} attempt {run.get('attempt')}" if run.get("job_id")
              else None),
             ("node", run.get("node")), ("created", clock(run.get("created_at"))),
             ("ran", duration(run.get("started_at"), run.get("ended_at"))),
             ("exit", run.get("exit_code")), ("failure", run.get("failure_kind"))]
    print("  " + "   ".join(f"{k}: {v}" for k, v in facts if v is not None))
    if run.get("kind") == "EVALUATE":
        print(f"  evaluation of checkpoint {run.get('parent_checkpoint_id')}")
    for label, values in (("params", run.get("params")), ("bookkeeping", run.get("bookkeeping"))):
        if values:
            text = " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
                            for k, v in values.items())
            print(f"  {label}: {text if len(text) <= 300 else text[:297] + '...'}")
    if not keys:
        print("no metrics yet")
    else:
        print()
        rows = []
        for k in keys:
            latest, best = k.get("latest"), k.get("best")
            rows.append([k["key"], _at(latest), _at(best), goal(k), k["trend"],
                         k["count"], k["sparkline"]])
        print_table(rows, ["METRIC", "LATEST", "BEST", "GOAL", "TREND", "POINTS",
                           "WHOLE RUN"])
    if hidden:
        note("shown once: " + ", ".join(f"{k['key']} (the same curve as {k['duplicate_of']}, "
                                        "read from TensorBoard files)" for k in hidden)
             + " left out; the SDK's values are kept. --all shows both")
    if any(k.get("counter") and not k.get("direction") for k in keys):
        note("GOAL and TREND are left out for counters and schedules (epoch, step, lr, ...): "
             "they move because training moves, not because it goes well")
    unknown = [k["key"] for k in keys if goal(k) == "unknown"]
    if unknown:
        note(f"goal unknown for {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}:"
             " the name says neither lower nor higher is better, so it is not judged; "
             f"say which: gpuplane metric set {unknown[0]} --direction min|max")
    from .semantic import print_verdict
    print("\nverdict: ", end="")
    print_verdict(diagnosis)
    from .events import print_recent
    print_recent(client, run=run["id"])
    return EXIT_OK


def goal(k):
    """The GOAL column: the server's direction (gpuplane/vocab.py decides it); a counter or
    a system metric has none to show, another key without one is "unknown"."""
    if k.get("direction"):
        return k["direction"]
    if k.get("counter") or k.get("role") == "system":
        return None
    return "unknown"


def _at(point):
    if not point:
        return None
    return f"{fmt(point['value'])} @{point['step']}"


def fmt(v):
    if isinstance(v, str):
        return v
    if v == 0 or 1e-3 <= abs(v) < 1e5:
        return f"{v:.4g}"
    return f"{v:.3e}"


def sparkline(points):
    """Unicode blocks, one per bucket: its mean (its min when the mean is not a number).
    A bucket with no finite value is a blank."""
    values = []
    for p in points:
        v = p[3] if _finite(p[3]) else p[1]
        values.append(v if _finite(v) else None)
    finite = [v for v in values if v is not None]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    span = hi - lo
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        elif span == 0:
            out.append(SPARKS[len(SPARKS) // 2])
        else:
            out.append(SPARKS[min(len(SPARKS) - 1, int((v - lo) / span * len(SPARKS)))])
    return "".join(out)


def _finite(v):
    return isinstance(v, (int, float)) and math.isfinite(v)
