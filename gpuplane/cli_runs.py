"""`gpuplane run list` and `gpuplane run show ID`: runs and their metrics at a glance.

Added to the CLI by gpuplane/cli.py (`add_parsers`); talks to the server over REST only.
`run show` prints per metric the latest and best value, the trend and a small sparkline of
the whole run (a max_points=20 series, the mean of each bucket).
"""
import math

from . import cli

SPARKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 20


_run_id = cli.id_type("run", "gpuplane run list")


def add_parsers(subparsers):
    conn, js = cli.common_parents()
    run = subparsers.add_parser("run", help="list runs and show their metrics",
                                description="list runs and show their metrics")
    sub = run.add_subparsers(dest="run_command", metavar="SUBCOMMAND", required=True)

    p = sub.add_parser("list", help="list runs, newest first", description="list runs, "
                       "newest first", parents=[conn, js])
    p.add_argument("--project", metavar="P", help="only runs of this project")
    p.add_argument("--experiment", metavar="E", help="only runs of this experiment")
    p.add_argument("--job", type=cli._job_id, metavar="ID", help="only the runs of this job")
    p.add_argument("--limit", type=cli._positive_int, default=50,
                   help="at most this many (default 50)")
    p.set_defaults(func=cmd_run_list)

    p = sub.add_parser("show", help="show a run: per metric latest, best, trend, sparkline",
                       description="show a run: per metric latest, best, trend and a "
                       "sparkline of the whole run", parents=[conn, js])
    p.add_argument("run_id", type=_run_id, metavar="ID")
    p.set_defaults(func=cmd_run_show)


def cmd_run_list(args):
    runs = cli.make_client(args).list_runs(project=args.project, experiment=args.experiment,
                                           job_id=args.job, limit=args.limit)
    if args.json:
        cli.print_json(runs)
        return cli.EXIT_OK
    if not runs:
        cli._note("no runs" + _filters(args) + "; a job's attempt or the SDK "
                  "(`gpuctl.init()`) makes one")
        return cli.EXIT_OK
    rows = []
    for r in runs:
        job = f"{r['job_id']}/{r.get('attempt') or 1}" if r.get("job_id") else None
        rows.append([r["id"], r.get("name") or None, r.get("project"),
                     r.get("experiment") or None, r.get("state"), r.get("source"), job,
                     cli.ago(r.get("created_at")),
                     cli.duration(r.get("started_at"), r.get("ended_at"))])
    cli.print_table(rows, ["ID", "NAME", "PROJECT", "EXPERIMENT", "STATE", "SOURCE",
                           "JOB/ATTEMPT", "CREATED", "RAN"])
    return cli.EXIT_OK


def _filters(args):
    parts = [f"{name} {value}" for name, value in (("in project", args.project),
             ("in experiment", args.experiment), ("of job", args.job)) if value]
    return (" " + " ".join(parts)) if parts else ""


def cmd_run_show(args):
    client = cli.make_client(args)
    run = client.get_run(args.run_id)
    keys = client.get(f"runs/{args.run_id}/metrics")["keys"]
    for k in keys:
        series = client.get(f"runs/{args.run_id}/metrics/{k['key']}", max_points=SPARK_WIDTH)
        k["sparkline"] = sparkline(series["points"])
    if args.json:
        cli.print_json({"run": run, "metrics": keys})
        return cli.EXIT_OK
    title = f"run {run['id']}" + (f" {run['name']}" if run.get("name") else "")
    where = "/".join(x for x in (run.get("project"), run.get("experiment")) if x)
    print(f"{title}  {run.get('state')}  {where}".rstrip())
    facts = [("source", run.get("source")),
             ("job", f"{run['job_id']} attempt {run.get('attempt')}" if run.get("job_id")
              else None),
             ("node", run.get("node")), ("created", cli.clock(run.get("created_at"))),
             ("ran", cli.duration(run.get("started_at"), run.get("ended_at"))),
             ("exit", run.get("exit_code")), ("failure", run.get("failure_kind"))]
    print("  " + "   ".join(f"{k}: {v}" for k, v in facts if v is not None))
    if not keys:
        print("no metrics yet")
        return cli.EXIT_OK
    print()
    rows = []
    for k in keys:
        latest, best = k.get("latest"), k.get("best")
        rows.append([k["key"], _at(latest), _at(best), k["direction"], k["trend"],
                     k["count"], k["sparkline"]])
    cli.print_table(rows, ["METRIC", "LATEST", "BEST", "GOAL", "TREND", "POINTS",
                           "WHOLE RUN"])
    return cli.EXIT_OK


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
