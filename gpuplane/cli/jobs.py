"""`gpuplane job submit|list|show|wait|cancel|retry|hold|release|edit` and `gpuplane logs`."""

import argparse
import json
import os
import pathlib
import shlex

from .. import states
from .common import (EXIT_EVENT, EXIT_OK, EXIT_TIMEOUT, CliError, FINAL_STATES, JOB_STATES, ago,
                     clean_line, clock, command, command_text, describe_end, duration,
                     env_pair, failure_reason, follow_job, gpu_list, job_id_type, make_client, note,
                     outcome_code, parents, positive_int, print_json, print_table, wants)

SUBMIT_EPILOG = """\
examples:
  gpuplane job submit -n cpu-demo -g 0 -d "$PWD/examples/cpu" -- python train.py --epochs 3
  gpuplane job submit -g 1 --tb-dir runs --watch checkpoints -- python train.py
  gpuplane job submit --cpu-only -- 'for i in 1 2 3; do echo $i; done'

Everything after `--` is the command; without `--` its own options (--epochs) would be
read as options of `job submit`."""


WAIT_EPILOG = """\
exit codes:
  0   every job SUCCEEDED (with --any: the first to end did)
  5   one of them FAILED (with --any: the first to end did)
  3   one was CANCELLED and none failed (with --any: the first to end was)
  6   --until-event: a critical event (LOSS_NAN, LOSS_DIVERGED, OOM, STALLED, ...) was
      filed on one of them first; it is printed, and the jobs go on
  124 --timeout passed first
  1   an unknown job id, or another error; 4 the server cannot be reached"""


def add_parser(subparsers):
    conn, js, _ = parents()
    job = command(subparsers, "job", "submit, list, inspect, cancel and retry jobs",
                  parents=(conn,))
    jsub = job.add_subparsers(dest="job_command", metavar="JOB_COMMAND", required=True)

    p = command(jsub, "submit", "submit a job: gpuplane job submit [options] -- CMD ARGS...",
                parents=(conn, js), epilog=SUBMIT_EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--name",
                   help="job name (default: the script's name, e.g. train for train.py)")
    p.add_argument("-g", "--gpus", type=positive_int, metavar="N",
                   help="GPUs wanted, all on one node (default 1; 0 means --cpu-only)")
    p.add_argument("-d", "--dir", dest="working_dir", metavar="DIR",
                   help="working directory on the agent's host (default: the current "
                        "directory); a relative one is resolved here when every node is "
                        "this host, else it must be absolute")
    p.add_argument("--cpu-only", action="store_true", help="run without a GPU")
    p.add_argument("--priority", type=int, metavar="P", help="higher runs first (default 0)")
    p.add_argument("--max-attempts", type=positive_int, metavar="K",
                   help="attempts when a node is lost (default: the server's)")
    p.add_argument("--env", type=env_pair, action="append", default=[], metavar="K=V",
                   help="environment variable for the job (repeatable)")
    p.add_argument("--project", metavar="P", help="project of the job's runs")
    p.add_argument("--experiment", metavar="E", help="experiment of the job's runs")
    p.add_argument("--tb-dir", metavar="D", help="TensorBoard log directory to tail")
    p.add_argument("--watch", metavar="D", help="checkpoint directory to watch")
    p.add_argument("--keep-best", type=positive_int, metavar="K",
                   help="checkpoint retention when the job ends: keep the best K by the "
                        "metric that decides (with --keep-last; docs/checkpoints.md)")
    p.add_argument("--keep-last", type=positive_int, metavar="L",
                   help="... and the last L of each run (evaluated and pinned ones always)")
    p.add_argument("--image", metavar="IMG",
                   help="run the job in a container of this image (Docker on the agent's "
                        "host; docs/docker.md)")
    p.add_argument("--cpus", type=positive_int, metavar="N",
                   help="CPUs per task, for a Slurm agent (sbatch --cpus-per-task; "
                        "docs/slurm.md); local agents ignore it")
    p.add_argument("--mem", type=memory_mb, metavar="SIZE", dest="mem_mb",
                   help="memory, for a Slurm agent (sbatch --mem): 512M, 16G")
    add_time_options(p)
    p.add_argument("--eval-command", metavar="CMD",
                   help="how to evaluate one of its checkpoints (run through /bin/sh -c by "
                        "`gpuplane ckpt evaluate ID`, with $GPUCTL_CHECKPOINT_PATH set)")
    add_dependency_options(p)
    p.add_argument("--hold", action="store_true",
                   help="queue it held: it starts only after `gpuplane job release ID`")
    p.add_argument("--follow", "-f", action="store_true",
                   help="stream the logs until the job ends; exit with its outcome")
    p.add_argument("--color", "--colour", dest="colour", action="store_true",
                   help="with --follow: keep the job's colour codes (other control "
                        "characters are always removed)")
    p.add_argument("cmd", nargs="+", metavar="CMD",
                   help="the command, after `--`; one quoted string runs through /bin/sh -c")
    p.set_defaults(func=cmd_job_submit)

    p = command(jsub, "list", "list jobs, newest first", parents=(conn, js))
    p.add_argument("--state", type=str.upper, choices=JOB_STATES, help="only jobs in this state")
    p.add_argument("--limit", type=positive_int, default=50,
                   help="at most this many (default 50)")
    p.set_defaults(func=cmd_job_list)

    p = command(jsub, "show", "show a job with its attempts", parents=(conn, js))
    p.add_argument("job_id", type=job_id_type, metavar="ID")
    p.set_defaults(func=cmd_job_show)

    p = command(jsub, "cancel", "cancel a job (SIGTERM to its process group, SIGKILL after 5 s)",
                parents=(conn, js))
    p.add_argument("job_id", type=job_id_type, metavar="ID")
    p.set_defaults(func=cmd_job_cancel)

    p = command(jsub, "wait", "wait until jobs end; the exit code says how they ended",
                parents=(conn, js), epilog=WAIT_EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job_ids", type=job_id_type, nargs="+", metavar="ID")
    p.add_argument("--any", action="store_true",
                   help="return when the first of them ends (default: when all have)")
    p.add_argument("--timeout", type=float, metavar="S",
                   help="give up after S seconds (exit 124); default: wait as long as it takes")
    p.add_argument("--until-event", action="store_true",
                   help="also return (exit 6) on the first critical event of these jobs, "
                        "e.g. LOSS_DIVERGED: look at it, or `gpuplane job cancel ID`")
    p.set_defaults(func=cmd_job_wait)

    p = command(jsub, "retry", "run a job that has ended (any outcome) again, as a new attempt",
                parents=(conn, js))
    p.add_argument("job_id", type=job_id_type, metavar="ID")
    p.add_argument("--resume", action="store_true", default=None,
                   help="hand the new attempt the last checkpoint of the earlier ones "
                        "(GPUCTL_RESUME_FROM, GPUCTL_RESUME_STEP; docs/sdk.md)")
    p.set_defaults(func=cmd_job_retry)

    for name, verb in (("hold", "keep a queued job from starting until it is released"),
                       ("release", "let a held job start")):
        p = command(jsub, name, verb, parents=(conn, js))
        p.add_argument("job_id", type=job_id_type, metavar="ID")
        p.set_defaults(func=cmd_job_hold, held=name == "hold")

    p = command(jsub, "edit", "change a queued job's priority or what it runs after",
                parents=(conn, js))
    p.add_argument("job_id", type=job_id_type, metavar="ID")
    p.add_argument("--priority", type=int, metavar="P", help="higher runs first")
    add_dependency_options(p)
    p.set_defaults(func=cmd_job_edit)

    p = command(subparsers, "logs", "print a job's logs (the server keeps the last 2000 lines)",
                parents=(conn, js))
    p.add_argument("-f", "--follow", action="store_true",
                   help="keep streaming until the job ends; exit with its outcome")
    p.add_argument("--tail", type=positive_int, metavar="N", help="only the last N lines")
    p.add_argument("--color", "--colour", dest="colour", action="store_true",
                   help="keep the job's colour codes (other control characters are always "
                        "removed, so job output cannot move the cursor or retitle the "
                        "terminal)")
    p.add_argument("job_id", type=job_id_type, metavar="ID")
    p.set_defaults(func=cmd_logs)


def job_body(args):
    cmd = args.cmd
    # One argument holding spaces is a shell line; the server runs a string through sh -c.
    command = cmd[0] if len(cmd) == 1 and any(c.isspace() for c in cmd[0]) else cmd
    cpu_only = args.cpu_only or args.gpus == 0
    fields = {
        "name": args.name or _default_name(cmd),
        "gpus": 0 if cpu_only else args.gpus,
        "cpu_only": True if cpu_only else None,
        "priority": args.priority,
        "max_attempts": args.max_attempts,
        "env": dict(args.env) or None,
        "project": args.project,
        "experiment": args.experiment,
        "tb_dir": args.tb_dir,
        "watch_dir": args.watch,
        "after": args.after,
        "after_any": args.after_any,
        "held": True if args.hold else None,
        "image": args.image,
        "eval_command": args.eval_command,
        "cpus": args.cpus or None,
        "mem_mb": args.mem_mb,
        **time_fields(args),
        "retention": {k: v for k, v in (("keep_best", args.keep_best),
                                        ("keep_last", args.keep_last)) if v is not None}
        or None,
    }
    working_dir = args.working_dir if args.working_dir is not None else os.getcwd()
    return command, working_dir, fields


def memory_mb(text):
    """`--mem 16G` -> 16384 (MiB, as sbatch counts); a bare number is MiB."""
    import re
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not m or int(m.group(1)) == 0:
        raise argparse.ArgumentTypeError(f"expected a size such as 512M or 16G, got {text!r}")
    n, unit = int(m.group(1)), m.group(2).upper()
    return max(1, {"K": n // 1024, "": n, "M": n, "G": n * 1024, "T": n * 1024 ** 2}[unit])


def time_limit_arg(text):
    """`--time 2h` (90m, 1:30:00, 2-00:00:00; a bare number is minutes) -> seconds."""
    from gpuplane import timelimit
    try:
        return timelimit.parse(text, what="--time")
    except timelimit.LimitError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def warning_signal(text):
    """`--signal USR1@60` -> the text, checked."""
    from gpuplane import timelimit
    try:
        timelimit.parse_signal(text, 0)
    except timelimit.LimitError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_time_options(p, trials=False):
    """--time, --signal, --preemptible / --no-preemptible (docs/scheduling.md)."""
    whose = "each trial's" if trials else "the job's"
    p.add_argument("--time", type=time_limit_arg, metavar="T", dest="time_limit_s",
                   help=f"{whose} time limit: 2h, 90m, 1:30:00 (a bare number is minutes); "
                        "the warning signal comes before it, then SIGTERM, SIGKILL; it ends "
                        "FAILED with kind TIMEOUT. Backfill runs limited jobs early "
                        "(default: the project's)")
    p.add_argument("--signal", type=warning_signal, metavar="SIG[@S]", dest="time_signal",
                   help="the warning S seconds before the limit or a preemption's stop "
                        "(default: the server's, USR1@60)")
    p.add_argument("--preemptible", action=argparse.BooleanOptionalAction, default=None,
                   help="a job of higher priority may stop it (warning, grace, SIGTERM) "
                        "and queue it again to resume from its last checkpoint (default: "
                        + ("on for trials)" if trials else "the project's, else off)"))
    p.add_argument("--stop-on", type=stop_on_arg, metavar="TYPES", dest="stop_on",
                   action="extend",
                   help=f"end {whose} run at once on these events, e.g. LOSS_NAN,LOSS_DIVERGED "
                        "(it ends STOPPED_ON_EVENT, not as a failure of the program); "
                        + ("default LOSS_NAN,LOSS_DIVERGED, 'none' for none" if trials
                           else "default none"))


def stop_on_arg(text):
    """`--stop-on LOSS_NAN,LOSS_DIVERGED` -> the list, checked ('none': [])."""
    from gpuplane import rules
    names = [n.strip().upper() for n in text.split(",") if n.strip()]
    if names in ([], ["NONE"]):
        return []
    unknown = [n for n in names if n not in rules.TYPES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown event type(s) {', '.join(unknown)}; one of {', '.join(rules.TYPES)}")
    return names


def time_fields(args):
    return {"time_limit_s": args.time_limit_s, "time_signal": args.time_signal,
            "preemptible": args.preemptible, "stop_on": args.stop_on}


def _default_name(cmd):
    try:
        words = shlex.split(cmd[0]) if len(cmd) == 1 else cmd
    except ValueError:
        words = cmd[0].split()
    for word in words:
        if word.endswith(".py"):
            return pathlib.Path(word).stem
    return pathlib.Path(words[0]).name if words else None


def local_working_dir(client, working_dir):
    """-d as the job will see it. When every node is this host (`gpuplane up`), a relative
    -d is resolved here and one that does not exist is warned about; else it goes as given
    (a relative one is refused by the server: it names a path on the agent's host)."""
    import socket
    from gpuplane.client import ApiError
    try:
        nodes = client.list_nodes()
    except ApiError:
        return working_dir
    here = socket.gethostname()
    if not nodes or any((n.get("hostname") or n.get("name")) != here for n in nodes):
        return working_dir
    path = os.path.abspath(os.path.expanduser(working_dir))
    if path != working_dir and not os.path.isabs(working_dir):
        note(f"-d {working_dir}: {path} (the agent runs on this host)")
    if not os.path.isdir(path):
        note(f"warning: working dir {path} does not exist on this host, where the job runs: "
             "it will fail to start; create it, or give -d a directory that exists")
    return path


def cmd_job_submit(args):
    client = make_client(args)
    command_, working_dir, fields = job_body(args)
    working_dir = local_working_dir(client, working_dir)
    job = client.submit_job(command_, working_dir, **fields)
    if args.json and not args.follow:
        print_json(job)
    else:
        print(job["id"], flush=True)
    for warning in job.get("warnings") or []:      # the server's (a shared folder)
        note(f"warning: {warning}")
    warning = _placement_warning(client, job)
    if warning:
        note(f"warning: {warning}")
    if not args.follow:
        return EXIT_OK
    note(f"following job {job['id']} (Ctrl-C stops following; the job keeps running)")
    final = follow_job(client, job["id"], colour=args.colour)
    if args.json:
        print_json(final)
    note(describe_end(final))
    return outcome_code(final["state"])


def _placement_warning(client, job):
    from gpuplane.client import ApiError, placement_warning
    try:
        return placement_warning(job, client.list_nodes())
    except ApiError:
        return None     # a token that may submit but not look: no warning, no failure


def cmd_job_list(args):
    jobs = make_client(args).list_jobs(state=args.state, limit=args.limit)
    if args.json:
        print_json(jobs)
        return EXIT_OK
    if not jobs:
        note("no jobs" + (f" in state {args.state}" if args.state else "")
             + "; submit one with `gpuplane job submit -- CMD`")
        return EXIT_OK
    rows = []
    for j in jobs:
        where = j.get("node")
        if where and j.get("gpu_indices"):
            where += f":{gpu_list(j['gpu_indices'])}"
        took = duration(j.get("started_at"), j.get("ended_at"))
        stopped = j["state"] == "CANCELLED" and j.get("failure_kind") in states.STOP_REASONS
        state = j["failure_kind"] if stopped else j["state"]    # EARLY_STOPPED, not a cancel
        rows.append([j["id"], j.get("name"), state, wants(j), where,
                     f"{j.get('attempt') or 0}/{j.get('max_attempts')}",
                     ago(j.get("created_at")), took])
    print_table(rows, ["ID", "NAME", "STATE", "WANTS", "NODE:GPUS", "ATTEMPT",
                       "SUBMITTED", "RAN"])
    return EXIT_OK


def cmd_job_show(args):
    client = make_client(args)
    job = client.get_job(args.job_id)
    if args.json:
        print_json(job)
        return EXIT_OK
    stop = states.stop_label(job.get("stop_reason")) if job["state"] == "CANCELLED" else None
    print(f"job {job['id']}  {job.get('name') or ''}  {stop or job['state']}"
          + ("  (cancel requested)" if job.get("cancel_requested")
             and job["state"] not in FINAL_STATES else ""))
    fields = [
        ("kind", job.get("kind")),
        ("command", command_text(job.get("command"))),
        ("working dir", job.get("working_dir")),
        ("wants", wants(job)),
        ("priority", job.get("priority")),
        ("attempt", f"{job.get('attempt') or 0} of {job.get('max_attempts')}"),
        ("project", " / ".join(x for x in (job.get("project"), job.get("experiment")) if x)
         or None),
        ("env", " ".join(f"{k}={v}" for k, v in (job.get("env") or {}).items()) or None),
        ("image", job.get("image")),
        ("asks Slurm", ", ".join(x for x in (
            f"{job['cpus']} CPUs" if job.get("cpus") else None,
            f"{job['mem_mb']} MiB" if job.get("mem_mb") else None) if x)
         or None),
        ("time limit", _limit_text(job)),
        ("preemptible", "yes" if job.get("preemptible") else None),
        ("preempted by", f"job {job['preempted_by']}" if job.get("preempted_by") else None),
        ("tensorboard", job.get("tb_dir")),
        ("watch", job.get("watch_dir")),
        ("node", job.get("node")),
        ("GPUs", gpu_list(job.get("gpu_indices"))),
        ("slurm job", job.get("slurm_job_id")),
        ("run", job.get("run_id")),
        ("submitted", _when(job.get("created_at"))),
        ("started", _when(job.get("started_at"))),
        ("ended", _when(job.get("ended_at"))),
        ("ran", duration(job.get("started_at"), job.get("ended_at"))),
        ("exit code", job.get("exit_code")),
        ("failure", None if stop else job.get("failure_kind")),
        ("stopped", stop and f"{stop}: {job['stop_reason'].get('message')}"),
        ("why", failure_reason(job)),
        ("after", (("any end of " if job.get("depends_any") else "")
                   + ", ".join(f"job {d}" for d in job["depends_on"]))
         if job.get("depends_on") else None),
        ("held", "yes (`gpuplane job release`)" if job.get("held") else None),
        ("waiting", job.get("pending_reason")),
        ("expected start", _expected(job)),
    ]
    width = max(len(k) for k, _ in fields)
    for key, value in fields:
        if value is not None and value != "":
            print(f"  {key.ljust(width)}  {value}")
    attempts = job.get("attempts") or []
    if attempts:
        print()
        slurm = any(a.get("slurm_job_id") for a in attempts)
        print_table([[a.get("attempt"), a.get("run_id"), a.get("state"), a.get("node"),
                      gpu_list(a.get("gpu_indices"))]
                     + ([a.get("slurm_job_id")] if slurm else [])
                     + [a.get("exit_code"),
                        # the attempt a stop ended says the stop, as the job does
                        job["failure_kind"] if stop and a.get("attempt") == job.get("attempt")
                        else a.get("failure_kind"), clock(a.get("started_at")),
                        duration(a.get("started_at"), a.get("ended_at"))]
                     for a in attempts],
                    ["ATTEMPT", "RUN", "STATE", "NODE", "GPUS"] + (["SLURM"] if slurm else [])
                    + ["EXIT", "FAILURE", "STARTED", "RAN"])
    from .events import print_recent
    print_recent(client, job=args.job_id)
    return EXIT_OK


def _limit_text(job):
    from gpuplane import timelimit
    if not job.get("time_limit_s"):
        return None
    text = timelimit.describe(job["time_limit_s"])
    sig = job.get("warning_signal")
    if sig:
        text += f" (SIG{sig[0]} {sig[1]} s before)"
    return text


def _when(ms):
    return f"{clock(ms)} ({ago(ms)})" if ms else None


def cmd_job_cancel(args):
    client = make_client(args)
    before = client.get_job(args.job_id)["state"]
    job = client.cancel_job(args.job_id)
    if args.json:
        print_json(job)
    elif before == "CANCELLED":
        print(f"job {job['id']} was already CANCELLED; nothing to do")
    elif job["state"] == "CANCELLED":
        print(f"job {job['id']} CANCELLED")
    else:
        print(f"job {job['id']} is {job['state']}; cancel requested "
              "(SIGTERM now, SIGKILL after 5 s)")
    return EXIT_OK


def cmd_job_wait(args):
    from gpuplane.client import wait_for_jobs
    client = make_client(args)

    def said(job):
        if not args.json:
            run = f", run {job['run_id']}" if job.get("run_id") else ""
            ran = duration(job.get("started_at"), job.get("ended_at"))
            print(f"job {job['id']} {job['state']}{run}"
                  + (f" after {ran}" if job.get("started_at") else ""), flush=True)
    waited = wait_for_jobs(client, args.job_ids, any_=args.any, timeout_s=args.timeout,
                           on_end=said, until_event=args.until_event)
    jobs, timed_out = waited
    if args.json:
        print_json(jobs if waited.event is None else {"jobs": jobs, "event": waited.event})
    if waited.event is not None:
        e = waited.event
        if not args.json:
            print(f"event {e['id']} {e['type']} ({e['severity']}) on job {e['job_id']}"
                  + (f" at step {e['step']}" if e.get("step") is not None else "")
                  + f": {e['message']}", flush=True)
            note(f"next: `gpuplane events --job {e['job_id']}`, `gpuplane logs "
                 f"{e['job_id']}`, or `gpuplane job cancel {e['job_id']}`")
        return EXIT_EVENT
    ended = [j for j in jobs if j["state"] in FINAL_STATES]
    if timed_out:
        note(f"{len(jobs) - len(ended)} of {len(jobs)} jobs still not ended after "
             f"{args.timeout:g} s: " + ", ".join(f"job {j['id']} {j['state']}" for j in jobs
                                                if j["state"] not in FINAL_STATES))
        return EXIT_TIMEOUT
    if args.any:
        first = min(ended, key=lambda j: (j.get("ended_at") or 0, j["id"]))
        return outcome_code(first["state"])
    ends = {j["state"] for j in jobs}
    return outcome_code("FAILED" if "FAILED" in ends else
                        "CANCELLED" if "CANCELLED" in ends else "SUCCEEDED")


def _expected(job):
    """A queued GPU job's expected start (docs/scheduling.md), said as an estimate."""
    if job.get("state") != "QUEUED" or job.get("cpu_only"):
        return None
    if job.get("expected_start"):
        import time
        wait = job["expected_start"] / 1000 - time.time()
        return (f"{clock(job['expected_start'])} ("
                + (f"in {duration(0, int(wait * 1000))}" if wait > 1 else "now") +
                "), an estimate from the time limits of the jobs before it")
    return "unknown: a job it waits for has no time limit" if job.get("pending_reason") \
        else None


def cmd_job_retry(args):
    job = make_client(args).retry_job(args.job_id, resume=args.resume)
    if args.json:
        print_json(job)
    else:
        nxt = (job.get("attempt") or 0) + 1
        print(f"job {job['id']} {job['state']} again: attempt {nxt} of "
              f"{job.get('max_attempts')} will be a new run (follow it: gpuplane logs -f "
              f"{job['id']})")
    return EXIT_OK


def _id_list(text):
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected job ids separated by commas, e.g. 12,13; got {text!r}") from None
    if not ids or min(ids) < 1:
        raise argparse.ArgumentTypeError(f"expected job ids (1 or more), got {text!r}")
    return ids


def add_dependency_options(p):
    g = p.add_mutually_exclusive_group()
    g.add_argument("--after", type=_id_list, metavar="IDS",
                   help="start only after these jobs SUCCEEDED (e.g. 12,13); if one fails "
                        "or is cancelled this job fails with DEPENDENCY_FAILED")
    g.add_argument("--after-any", type=_id_list, metavar="IDS",
                   help="start after these jobs ended, in any state")


def cmd_job_hold(args):
    client = make_client(args)
    job = (client.hold_job if args.held else client.release_job)(args.job_id)
    if args.json:
        print_json(job)
    else:
        print(f"job {job['id']} " + ("held: it stays queued until `gpuplane job release "
                                     f"{job['id']}`" if args.held else "released"))
    return EXIT_OK


def cmd_job_edit(args):
    if args.priority is None and args.after is None and args.after_any is None:
        raise CliError("nothing to change; give --priority, --after or --after-any")
    job = make_client(args).update_job(args.job_id, priority=args.priority, after=args.after,
                                       after_any=args.after_any)
    if args.json:
        print_json(job)
    else:
        deps = job.get("depends_on") or []
        print(f"job {job['id']} priority {job.get('priority')}"
              + (f", after {'any end of ' if job.get('depends_any') else ''}"
                 f"{', '.join(map(str, deps))}" if deps else ""))
    return EXIT_OK


def cmd_logs(args):
    client = make_client(args)
    if args.follow:
        if args.json:
            for line in client.stream_job_logs(args.job_id, tail=args.tail):
                print(json.dumps(line), flush=True)
            final = client.get_job(args.job_id)
        else:
            final = follow_job(client, args.job_id, tail=args.tail, colour=args.colour)
        note(describe_end(final))
        return outcome_code(final["state"])
    answer = client.get_job_logs(args.job_id, tail=args.tail)
    if args.json:
        print_json(answer)
        return EXIT_OK
    attempt = None
    for line in answer.get("lines", []):
        if attempt is not None and line.get("attempt") != attempt:
            print(f"--- attempt {line.get('attempt')} ---")
        attempt = line.get("attempt")
        print(clean_line(line.get("text", ""), args.colour))
    if not answer.get("lines"):
        state = answer.get("job_state")
        if state in FINAL_STATES:
            note(f"no log lines: {describe_end(client.get_job(args.job_id))}")
        else:
            note(f"no log lines yet (job is {state}; `gpuplane logs -f {args.job_id}` "
                 "waits for them)")
    return EXIT_OK
