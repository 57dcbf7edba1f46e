"""`gpuplane events [-f]` and `gpuplane event-hook -- CMD` (docs/events.md)."""

import argparse
import hashlib
import json
import os
import signal
import subprocess
import time

from .common import (EXIT_OK, EXIT_USAGE, CliError, clock, command, make_client, note,
                     parents, positive_int, print_table)

SEVERITIES = ("info", "warning", "critical")


def _filters(p):
    p.add_argument("--severity", choices=SEVERITIES, help="only events at least this severe")
    p.add_argument("--type", action="append", metavar="TYPE", dest="types",
                   help="only events of this type (again for more: --type OOM --type LOSS_NAN)")
    p.add_argument("--run", type=positive_int, metavar="ID", help="only this run's events")
    p.add_argument("--job", type=positive_int, metavar="ID", help="only this job's events")


def add_parser(subparsers):
    conn, js, _ = parents()
    p = command(subparsers, "events", "events: NaN losses, OOMs, spikes, stalls, job "
                "lifecycle, SDK events; -f to follow", parents=(conn, js))
    _filters(p)
    p.add_argument("--since", metavar="WHEN", help="only events since: an age (30m, 2h, 1d), "
                   "an ISO time or milliseconds since the epoch")
    p.add_argument("--limit", type=positive_int, default=50,
                   help="how many of the latest to show first (default 50)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    p.set_defaults(func=cmd_events)

    p = command(subparsers, "event-hook", "run a command once per matching event, in order, "
                "with the event in GPUCTL_EVENT_* variables and as JSON on stdin",
                parents=(conn,))
    _filters(p)
    p.add_argument("--cursor", metavar="FILE", help="where the last handled event id is kept "
                   "(default: one file per filter and command under HOME/event-hook/)")
    p.add_argument("--from-start", action="store_true", help="without a cursor file, start "
                   "with the oldest stored event (default: only events from now on)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="kill a command still running after this many seconds (default 60)")
    p.add_argument("--once", action="store_true",
                   help="handle the events waiting now, then exit")
    p.add_argument("--poll", type=float, default=1.0, metavar="S", help=argparse.SUPPRESS)
    p.add_argument("hook", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="the command to run, after --")
    p.set_defaults(func=cmd_event_hook)


def _query(args):
    return {"severity": args.severity, "type": ",".join(args.types) if args.types else None,
            "run": args.run, "job": args.job}


def line(ev):
    where = " ".join(f"{k} {ev[k]}" for k in ("run_id", "job_id") if ev.get(k)).replace(
        "_id", "") or (f"node {ev['node']}" if ev.get("node") else "")
    count = f" (x{ev['count']})" if (ev.get("count") or 1) > 1 else ""
    step = f" step {ev['step']}" if ev.get("step") is not None else ""
    return [str(ev["id"]), clock(ev["ts"]), ev["severity"], ev["type"] + count,
            (where + step).strip(), ev.get("message") or ""]


HEADERS = ["ID", "TIME", "SEVERITY", "TYPE", "WHERE", "MESSAGE"]


def print_recent(client, limit=10, **which):
    """The latest events of a run or job, under `run show` and `job show`."""
    from gpuplane.client import ApiError
    try:
        data = client.list_events(limit=limit, **which)
    except ApiError:         # an older server without /events: nothing to add
        return
    rows = data["events"]
    if not rows:
        return
    (noun, value), = which.items()
    print(f"\nevents (the latest {len(rows)}; all: gpuplane events --{noun} {value}):")
    print_table([line(ev)[1:] for ev in rows], HEADERS[1:])


def cmd_events(args):
    from gpuplane.client import ServerUnreachable
    client = make_client(args)
    q = _query(args)
    data = client.list_events(limit=args.limit, since=args.since, **q)
    rows = data["events"]
    if args.json and not args.follow:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    if args.json:
        for ev in rows:
            print(json.dumps(ev), flush=True)
    elif rows or not args.follow:
        print_table([line(ev) for ev in rows], HEADERS) if rows else note("no events")
    if not args.follow:
        return EXIT_OK
    last = data["last_id"]
    down = False
    while True:
        try:
            rows = client.list_events(after=last, limit=500, **q)["events"]
        except ServerUnreachable as e:
            if not down:
                note(f"{e}; retrying every 2 s")
            down = True
            time.sleep(2)
            continue
        if down:
            note("server back")
            down = False
        for ev in rows:
            print(json.dumps(ev) if args.json else "  ".join(line(ev)), flush=True)
            last = ev["id"]
        if not rows:
            time.sleep(1.0)


# -- event-hook -----------------------------------------------------------------------------


def cursor_path(args, hook):
    if args.cursor:
        return os.path.abspath(args.cursor)
    from gpuplane.config import home_dir
    key = json.dumps([_query(args), hook, getattr(args, "server", None)], sort_keys=True)
    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    return str(home_dir(getattr(args, "home", None)) / "event-hook" / f"{name}.cursor")


def read_cursor(path):
    try:
        with open(path) as f:
            return int(json.load(f)["last_id"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        raise CliError(f"{path} is not an event-hook cursor; remove it to start from now")


def write_cursor(path, last_id):
    from gpuplane.config import atomic_write
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write(path, json.dumps({"last_id": last_id}) + "\n", mode=0o600)


def hook_env(ev):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_EVENT_")}
    for name, key in (("ID", "id"), ("TYPE", "type"), ("SEVERITY", "severity"),
                      ("MESSAGE", "message"), ("RUN_ID", "run_id"), ("JOB_ID", "job_id"),
                      ("NODE", "node"), ("STEP", "step"), ("TS", "ts"), ("COUNT", "count")):
        v = ev.get(key)
        env[f"GPUCTL_EVENT_{name}"] = "" if v is None else _env_text(str(v))
    return env


def _env_text(v):
    """A value an environment variable can hold: the server refuses NUL bytes and lone
    surrogates where events enter, but one stored before that (or sent by another server)
    must not stop the hook for good, so they become U+FFFD here."""
    if "\0" in v:
        v = v.replace("\0", "\ufffd")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        v = v.encode("utf-8", "replace").decode("utf-8")
    return v


def record_failure(path, ev, why):
    """One JSON line per event the hook could not handle, beside its cursor
    (CURSOR.failed), so a skipped event is on record, not only on stderr."""
    try:
        fd = os.open(path + ".failed", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(json.dumps({"id": ev.get("id"), "type": ev.get("type"), "why": why,
                                "at": int(time.time() * 1000)}) + "\n")
    except OSError as e:
        note(f"event-hook: cannot record the failure in {path}.failed ({e})")


def run_hook(hook, ev, timeout, cursor=None):
    """Run the command for one event. Returns True when it exited 0; says why not (and,
    with a cursor path, records it in CURSOR.failed)."""
    why = _run_hook(hook, ev, timeout)
    if why is None:
        return True
    note(f"event-hook: {why}")
    if cursor is not None:
        record_failure(cursor, ev, why)
    return False


def _run_hook(hook, ev, timeout):
    what = f"event {ev.get('id')} ({_env_text(str(ev.get('type')))})"
    try:
        proc = subprocess.Popen(hook, stdin=subprocess.PIPE, env=hook_env(ev),
                                start_new_session=True)
    except FileNotFoundError:
        return f"{hook[0]} does not exist; {what} skipped (fix the path)"
    except PermissionError:
        return (f"{hook[0]} is not executable; {what} skipped "
                f"(chmod +x it, or run it through its interpreter: -- sh {hook[0]})")
    except (OSError, ValueError) as e:
        # ValueError: what no exec can take (a NUL byte); one event must not stop the hook
        return f"cannot run {hook[0]} for {what} ({e}); skipped, going on"
    try:
        proc.communicate(json.dumps(ev).encode() + b"\n", timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        return (f"{hook[0]} still ran after {timeout:g} s on {what}; killed it "
                f"(raise --timeout if it needs longer)")
    except OSError as e:
        proc.kill()
        proc.wait()
        return f"{hook[0]} failed on {what} ({e}); going on"
    if proc.returncode != 0:
        return f"{hook[0]} exited with {proc.returncode} on {what}; going on"
    return None


def _kill(proc):
    for sig, wait in ((signal.SIGTERM, 2), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue


def cmd_event_hook(args):
    from gpuplane.client import ServerUnreachable
    hook = args.hook[1:] if args.hook[:1] == ["--"] else args.hook
    if not hook:
        note("give the command to run after --, e.g. gpuplane event-hook --severity critical "
             "-- /path/to/on-event.sh")
        return EXIT_USAGE
    client = make_client(args)
    path = cursor_path(args, hook)
    q = _query(args)
    last = read_cursor(path)
    if last is None:
        last = 0 if args.from_start else client.list_events(limit=1)["last_id"]
        write_cursor(path, last)
    note(f"event-hook: running {' '.join(hook)} for each new event after id {last} "
         f"(cursor {path})")
    down = False
    while True:
        try:
            rows = client.list_events(after=last, limit=100, **q)["events"]
        except ServerUnreachable as e:
            if args.once:
                raise
            if not down:
                note(f"event-hook: {e}; retrying, nothing is missed meanwhile")
            down = True
            time.sleep(2)
            continue
        if down:
            note("event-hook: server back")
            down = False
        for ev in rows:
            run_hook(hook, ev, args.timeout, cursor=path)
            last = ev["id"]
            write_cursor(path, last)      # after the command: a crash mid-command reruns it
        if not rows:
            if args.once:
                return EXIT_OK
            time.sleep(args.poll)


