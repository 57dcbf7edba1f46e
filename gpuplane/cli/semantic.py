"""`gpuplane diagnose RUN` and `gpuplane explain JOB`: the semantic layer's verdicts.

Both print the verdict, the evidence and the next actions, as `gpuplane` commands (the
answer's MCP tool calls, mapped by gpuplane/next_actions.py)."""

from .common import (EXIT_OK, command, id_type, job_id_type, make_client, parents,
                     print_json, print_next_actions)

run_id_type = id_type("run", "gpuplane run list")


def add_parser(subparsers):
    conn, js, _ = parents()
    p = command(subparsers, "diagnose", "judge a run: healthy, diverging, not learning, "
                "unstable, overfitting, plateaued, stalled, failed, too early to tell or no data",
                parents=(conn, js))
    p.add_argument("run_id", type=run_id_type, metavar="RUN")
    p.add_argument("--key", metavar="KEY", help="the metric to judge (default: the primary)")
    p.set_defaults(func=cmd_diagnose)

    p = command(subparsers, "explain", "why a job failed: the kind, the log lines that "
                "show it, what to try", parents=(conn, js))
    p.add_argument("job_id", type=job_id_type, metavar="JOB")
    p.set_defaults(func=cmd_explain)


def cmd_diagnose(args):
    d = make_client(args).get_run_diagnosis(args.run_id, key=args.key)
    if args.json:
        print_json(d)
        return EXIT_OK
    print(f"run {d['run_id']}: ", end="")
    print_verdict(d)
    print_next_actions(d["next_actions"])
    return EXIT_OK


def print_verdict(d):
    """diagnose_run's answer as `gpuplane diagnose` and `run show` print it (the dashboard
    shows the same fields beside the curves)."""
    print(f"{d['verdict'].upper()} — {d['summary']}")
    if d.get("advice"):
        print(f"  advice: {d['advice']}")
    c = d.get("confidence") or {}
    if c.get("level"):
        print(f"  confidence: {c['level']}" + (f" — {c['why']}" if c.get("why") else ""))
    for e in d.get("evidence") or []:
        print(f"  - {e}")


def cmd_explain(args):
    e = make_client(args).get_job_explanation(args.job_id)
    if args.json:
        print_json(e)
        return EXIT_OK
    print(f"{e['kind']}: {e['summary']}")
    if e["lines"]:
        print("log:")
        for ln in e["lines"]:
            print(f"  {ln['line_no']:>6}  {ln['text']}")
    for s in e["suggestions"]:
        print(f"  try: {s}")
    print_next_actions(e["next_actions"])
    return EXIT_OK
