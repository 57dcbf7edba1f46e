"""The `gpuplane` command (also installed as `gpuctl`).

Top-level imports are the standard library only: argparse-manpage imports this module
to build the man page in an environment that may not have the project's dependencies.
Everything else is imported by the command that needs it.

Exit codes (docs/cli.md):
  0  success; with --follow / logs -f / up --exit-when-done: the job SUCCEEDED
  1  the server refused the request (its message says why) or another error
  2  usage: bad arguments
  3  the followed job ended CANCELLED
  4  cannot reach the server
  5  the followed job ended FAILED
  130 interrupted (Ctrl-C)
"""

import argparse
import datetime
import importlib
import json
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import time

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_CANCELLED = 3
EXIT_UNREACHABLE = 4
EXIT_FAILED = 5
EXIT_INTERRUPTED = 130

JOB_STATES = ["QUEUED", "DISPATCHED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"]
FINAL_STATES = {"SUCCEEDED", "FAILED", "CANCELLED"}
TOKEN_SCOPES = ["read", "write", "admin", "agent"]

EXIT_CODES_EPILOG = """\
exit codes:
  0   success (a followed job SUCCEEDED)
  1   the server refused the request, or another error (message on stderr)
  2   bad arguments
  3   a followed job ended CANCELLED
  4   cannot reach the server
  5   a followed job ended FAILED
  130 interrupted"""


class CliError(Exception):
    """A problem on this side, reported as one `error:` line with this exit code."""

    def __init__(self, message, code=EXIT_ERROR):
        super().__init__(message)
        self.code = code


# -- parser -----------------------------------------------------------------------------


def _env_pair(text):
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value}")
    return value


def id_type(noun, listing):
    """An argparse type for positive ids, whose error says where to find them."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{noun} ids are numbers, got {text!r}; list them with `{listing}`") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{noun} ids start at 1, got {value}")
        return value
    return parse


_job_id = id_type("job", "gpuplane job list")


def _port(text):
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {value}")
    return value


def _global_options(parser, suppress, home_only=False):
    # The same flags on every subcommand, so `gpuplane job list --server X` works too;
    # SUPPRESS there keeps a subcommand from resetting what was given before it.
    default = argparse.SUPPRESS if suppress else None
    g = parser.add_argument_group("connection")
    if home_only:
        g.add_argument("--home", metavar="DIR", default=default,
                       help="GPUPlane home (default: $GPUCTL_HOME, else ~/.gpuctl)")
        return
    g.add_argument("--server", metavar="URL", default=default,
                   help="server URL (default: $GPUCTL_SERVER, else the server in the "
                        "local home's server.toml, else http://127.0.0.1:8600)")
    g.add_argument("--token", metavar="TOKEN", default=default,
                   help="API token (default: $GPUCTL_TOKEN, else the local server's admin "
                        "token when talking to that server)")
    g.add_argument("--home", metavar="DIR", default=default,
                   help="GPUPlane home (default: $GPUCTL_HOME, else ~/.gpuctl)")


def common_parents():
    """Parents for a subcommand parser: the connection flags and --json.
    For modules that add commands (`gpuplane/cli_runs.py`)."""
    conn = argparse.ArgumentParser(add_help=False)
    _global_options(conn, suppress=True)
    js = argparse.ArgumentParser(add_help=False)
    js.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return conn, js


def _home_parent():
    home = argparse.ArgumentParser(add_help=False)
    _global_options(home, suppress=True, home_only=True)
    return home


def get_parser():
    parser = argparse.ArgumentParser(
        prog="gpuplane",
        description="GPUPlane: a job queue, live logs and metrics for your own GPU "
                    "machines. Also installed as `gpuctl`.",
        epilog=EXIT_CODES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _global_options(parser, suppress=False)
    conn, js = common_parents()
    home = _home_parent()
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(subparsers, name, help, parents=(conn,), **kw):
        return subparsers.add_parser(name, help=help, description=help,
                                     parents=list(parents), **kw)

    # server, agent, up
    p = command(sub, "server", "run the GPUPlane server in the foreground",
                parents=(home,))
    p.add_argument("--host", help="address to listen on (default: server.toml, else 127.0.0.1)")
    p.add_argument("--port", type=_port, help="port (default: server.toml, else 8600)")
    p.add_argument("--threads", type=_positive_int,
                   help="worker threads; each log follower, dashboard stream and agent "
                        "holds one (default: server.toml, else 64)")
    p.set_defaults(func=cmd_server)

    # No options of its own (prefix "+"), so every "--flag" after `agent` reaches the agent.
    p = sub.add_parser("agent", add_help=False, prefix_chars="+",
                       help="run the agent (same as gpuplane-agent ARGS)",
                       description="Run the agent on this host: the same as "
                                   "`gpuplane-agent ARGS` or `python agent.py ARGS`.")
    p.add_argument("agent_args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="arguments for the agent, e.g. --server URL --token T "
                        "(see `gpuplane agent --help`)")
    p.set_defaults(func=cmd_agent)

    p = command(sub, "up", "start a server and a local agent together on this machine",
                parents=(home,))
    p.add_argument("--host", default="127.0.0.1",
                   help="address the server listens on (default 127.0.0.1)")
    p.add_argument("--port", type=_port,
                   help="server port (default: server.toml, else 8600)")
    p.add_argument("--threads", type=_positive_int, help="server worker threads")
    p.add_argument("--fake-gpus", type=_positive_int, metavar="N",
                   help="pretend this host has N GPUs (for machines without NVIDIA GPUs)")
    p.add_argument("--name", help="node name of the local agent (default: the hostname)")
    p.add_argument("--example", action="store_true",
                   help="submit the CPU example job from examples/cpu and follow its logs")
    p.add_argument("--exit-when-done", action="store_true",
                   help="with --example: stop everything when the job ends and exit "
                        "with its outcome")
    p.set_defaults(func=cmd_up)

    # job ...
    job = command(sub, "job", "submit, list, inspect, cancel and retry jobs")
    jsub = job.add_subparsers(dest="job_command", metavar="JOB_COMMAND", required=True)

    p = command(jsub, "submit", "submit a job: gpuplane job submit [options] -- CMD ARGS...",
                parents=(conn, js), epilog="example:\n  gpuplane job submit -n mnist -g 1 "
                "-d \"$PWD/examples/mnist\" --watch checkpoints -- python train.py --epochs 3",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--name",
                   help="job name (default: the script's name, e.g. train for train.py)")
    p.add_argument("-g", "--gpus", type=_positive_int, metavar="N",
                   help="GPUs wanted, all on one node (default 1; 0 means --cpu-only)")
    p.add_argument("-d", "--dir", dest="working_dir", metavar="DIR",
                   help="working directory on the agent's host, sent as given "
                        "(default: the current directory)")
    p.add_argument("--cpu-only", action="store_true", help="run without a GPU")
    p.add_argument("--priority", type=int, metavar="P", help="higher runs first (default 0)")
    p.add_argument("--max-attempts", type=_positive_int, metavar="K",
                   help="attempts when a node is lost (default: the server's)")
    p.add_argument("--env", type=_env_pair, action="append", default=[], metavar="K=V",
                   help="environment variable for the job (repeatable)")
    p.add_argument("--project", metavar="P", help="project of the job's runs")
    p.add_argument("--experiment", metavar="E", help="experiment of the job's runs")
    p.add_argument("--tb-dir", metavar="D", help="TensorBoard log directory to tail")
    p.add_argument("--watch", metavar="D", help="checkpoint directory to watch")
    p.add_argument("--follow", "-f", action="store_true",
                   help="stream the logs until the job ends; exit with its outcome")
    p.add_argument("cmd", nargs="+", metavar="CMD",
                   help="the command, after `--`; one quoted string runs through /bin/sh -c")
    p.set_defaults(func=cmd_job_submit)

    p = command(jsub, "list", "list jobs, newest first", parents=(conn, js))
    p.add_argument("--state", type=str.upper, choices=JOB_STATES, help="only jobs in this state")
    p.add_argument("--limit", type=_positive_int, default=50,
                   help="at most this many (default 50)")
    p.set_defaults(func=cmd_job_list)

    p = command(jsub, "show", "show a job with its attempts", parents=(conn, js))
    p.add_argument("job_id", type=_job_id, metavar="ID")
    p.set_defaults(func=cmd_job_show)

    p = command(jsub, "cancel", "cancel a job (SIGTERM to its process group, SIGKILL after 5 s)",
                parents=(conn, js))
    p.add_argument("job_id", type=_job_id, metavar="ID")
    p.set_defaults(func=cmd_job_cancel)

    p = command(jsub, "retry", "put a FAILED or CANCELLED job back in the queue",
                parents=(conn, js))
    p.add_argument("job_id", type=_job_id, metavar="ID")
    p.set_defaults(func=cmd_job_retry)

    # logs, status, whoami
    p = command(sub, "logs", "print a job's logs (the server keeps the last 2000 lines)",
                parents=(conn, js))
    p.add_argument("-f", "--follow", action="store_true",
                   help="keep streaming until the job ends; exit with its outcome")
    p.add_argument("--tail", type=_positive_int, metavar="N", help="only the last N lines")
    p.add_argument("job_id", type=_job_id, metavar="ID")
    p.set_defaults(func=cmd_logs)

    p = command(sub, "status", "nodes, GPU slots and what runs on them, the queue",
                parents=(conn, js))
    p.set_defaults(func=cmd_status)

    p = command(sub, "whoami", "the token in use: name and scope", parents=(conn, js))
    p.set_defaults(func=cmd_whoami)

    # token ...
    tok = command(sub, "token", "manage API tokens (admin)")
    tsub = tok.add_subparsers(dest="token_command", metavar="TOKEN_COMMAND", required=True)
    p = command(tsub, "create", "create a token; its secret is printed once", parents=(conn, js))
    p.add_argument("--name", required=True, help="what the token is for, e.g. laptop")
    p.add_argument("--scope", required=True, choices=TOKEN_SCOPES,
                   help="read: look only; write: submit/cancel; admin: everything; "
                        "agent: connect an agent")
    p.set_defaults(func=cmd_token_create)
    p = command(tsub, "list", "list tokens (never their secrets)", parents=(conn, js))
    p.set_defaults(func=cmd_token_list)
    p = command(tsub, "revoke", "revoke a token", parents=(conn, js))
    p.add_argument("token_id", type=_positive_int, metavar="ID")
    p.set_defaults(func=cmd_token_revoke)
    p = command(tsub, "show-admin", "print the admin token from the local server.toml",
                parents=(home,))
    p.set_defaults(func=cmd_token_show_admin)

    # Commands that live in their own modules add themselves here.
    try:
        cli_runs = importlib.import_module("gpuplane.cli_runs")
    except ModuleNotFoundError as e:
        if e.name not in ("gpuplane", "gpuplane.cli_runs"):
            raise
    else:
        cli_runs.add_parsers(sub)

    return parser


# -- output helpers --------------------------------------------------------------------


def print_json(data):
    print(json.dumps(data, indent=2, sort_keys=True))


def print_table(rows, headers):
    """Aligned plain-text columns; None shows as '-'."""
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, v in enumerate(row):
            widths[i] = max(widths[i], len(v))
    for row in [list(headers)] + cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


def ago(ms, now=None):
    """'just now', '42s ago', '5m ago', '3h ago', '2d ago', then a date."""
    if not ms:
        return None
    now = time.time() if now is None else now
    s = now - ms / 1000
    if s < 0:
        s = 0
    if s < 5:
        return "just now"
    if s < 60:
        return f"{int(s)}s ago"
    if s < 3600:
        return f"{int(s // 60)}m ago"
    if s < 86400:
        return f"{int(s // 3600)}h ago"
    if s < 7 * 86400:
        return f"{int(s // 86400)}d ago"
    return datetime.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M")


def duration(start_ms, end_ms=None, now=None):
    """'45s', '3m 12s', '1h 02m', '2d 03h' between two times (end: now)."""
    if not start_ms:
        return None
    end = end_ms / 1000 if end_ms else (time.time() if now is None else now)
    s = max(0, int(end - start_ms / 1000))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def clock(ms):
    if not ms:
        return None
    return datetime.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M:%S")


def _command_text(command):
    if isinstance(command, list):
        return shlex.join(command)
    return command or ""


def _wants(job):
    if job.get("cpu_only") or not job.get("gpus"):
        return "cpu"
    n = job["gpus"]
    return f"{n} GPU" + ("s" if n != 1 else "")


def _gpu_list(indices):
    return ",".join(str(i) for i in indices) if indices else None


def _note(text):
    print(text, file=sys.stderr, flush=True)


# -- client ------------------------------------------------------------------------------


def make_client(args):
    from gpuplane.client import Client
    return Client(getattr(args, "server", None), getattr(args, "token", None),
                  getattr(args, "home", None))


def _outcome_code(state):
    return {"SUCCEEDED": EXIT_OK, "FAILED": EXIT_FAILED,
            "CANCELLED": EXIT_CANCELLED}.get(state, EXIT_ERROR)


def _describe_end(job):
    text = f"job {job['id']} {job['state']}"
    details = []
    if job.get("failure_kind"):
        details.append(job["failure_kind"])
    if job.get("exit_code") is not None:
        details.append(f"exit code {job['exit_code']}")
    if job.get("started_at") and job.get("ended_at"):
        details.append(f"ran {duration(job['started_at'], job['ended_at'])}")
    return text + (f" ({', '.join(details)})" if details else "")


def follow_job(client, job_id, tail=None, out=None):
    """Print the job's log lines until it ends; return its final job object."""
    out = out or sys.stdout
    attempt = None
    try:
        for line in client.stream_logs(job_id, tail=tail):
            if attempt is not None and line.get("attempt") != attempt:
                out.write(f"--- attempt {line.get('attempt')} ---\n")
            attempt = line.get("attempt")
            out.write(line.get("text", "") + "\n")
            out.flush()
    except KeyboardInterrupt:
        _note(f"\nstopped following; job {job_id} keeps running "
              f"(stop it with `gpuplane job cancel {job_id}`)")
        raise
    return client.get_job(job_id)


# -- commands -----------------------------------------------------------------------------


def cmd_server(args):
    from gpuplane import config, server
    server.serve(config.home_dir(args.home), host=args.host, port=args.port,
                 threads=args.threads)
    return EXIT_OK


def _import_agent():
    try:
        import agent
        return agent
    except ModuleNotFoundError as e:
        if e.name != "agent":
            raise
    path = _repo_root() / "agent.py"
    if not path.exists():
        raise CliError("the agent is not installed: no `agent` module and no "
                       f"{path}; install the gpuplane package or run `python agent.py`")
    sys.path.insert(0, str(path.parent))
    import agent
    return agent


def cmd_agent(args):
    agent = _import_agent()
    rest = list(args.agent_args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    for flag in ("server", "token", "home"):
        value = getattr(args, flag, None)
        if value and f"--{flag}" not in rest:
            rest = [f"--{flag}", value] + rest
    code = agent.main(rest)
    return code or EXIT_OK


def _job_body(args):
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
    }
    working_dir = args.working_dir if args.working_dir is not None else os.getcwd()
    return command, working_dir, fields


def _default_name(cmd):
    try:
        words = shlex.split(cmd[0]) if len(cmd) == 1 else cmd
    except ValueError:
        words = cmd[0].split()
    for word in words:
        if word.endswith(".py"):
            return pathlib.Path(word).stem
    return pathlib.Path(words[0]).name if words else None


def cmd_job_submit(args):
    client = make_client(args)
    command, working_dir, fields = _job_body(args)
    job = client.submit_job(command, working_dir, **fields)
    if args.json and not args.follow:
        print_json(job)
    else:
        print(job["id"], flush=True)
    if job.get("pending_reason"):
        _note(f"job {job['id']} is waiting: {job['pending_reason']}")
    if not args.follow:
        return EXIT_OK
    _note(f"following job {job['id']} (Ctrl-C stops following; the job keeps running)")
    final = follow_job(client, job["id"])
    if args.json:
        print_json(final)
    _note(_describe_end(final))
    return _outcome_code(final["state"])


def cmd_job_list(args):
    jobs = make_client(args).list_jobs(state=args.state, limit=args.limit)
    if args.json:
        print_json(jobs)
        return EXIT_OK
    if not jobs:
        _note("no jobs" + (f" in state {args.state}" if args.state else "")
              + "; submit one with `gpuplane job submit -- CMD`")
        return EXIT_OK
    rows = []
    for j in jobs:
        where = j.get("node")
        if where and j.get("gpu_indices"):
            where += f":{_gpu_list(j['gpu_indices'])}"
        took = duration(j.get("started_at"), j.get("ended_at"))
        rows.append([j["id"], j.get("name"), j["state"], _wants(j), where,
                     f"{j.get('attempt') or 0}/{j.get('max_attempts')}",
                     ago(j.get("created_at")), took])
    print_table(rows, ["ID", "NAME", "STATE", "WANTS", "NODE:GPUS", "ATTEMPT",
                       "SUBMITTED", "RAN"])
    return EXIT_OK


def cmd_job_show(args):
    job = make_client(args).get_job(args.job_id)
    if args.json:
        print_json(job)
        return EXIT_OK
    print(f"job {job['id']}  {job.get('name') or ''}  {job['state']}"
          + ("  (cancel requested)" if job.get("cancel_requested")
             and job["state"] not in FINAL_STATES else ""))
    fields = [
        ("kind", job.get("kind")),
        ("command", _command_text(job.get("command"))),
        ("working dir", job.get("working_dir")),
        ("wants", _wants(job)),
        ("priority", job.get("priority")),
        ("attempt", f"{job.get('attempt') or 0} of {job.get('max_attempts')}"),
        ("project", " / ".join(x for x in (job.get("project"), job.get("experiment")) if x)
         or None),
        ("env", " ".join(f"{k}={v}" for k, v in (job.get("env") or {}).items()) or None),
        ("tensorboard", job.get("tb_dir")),
        ("watch", job.get("watch_dir")),
        ("node", job.get("node")),
        ("GPUs", _gpu_list(job.get("gpu_indices"))),
        ("run", job.get("run_id")),
        ("submitted", _when(job.get("created_at"))),
        ("started", _when(job.get("started_at"))),
        ("ended", _when(job.get("ended_at"))),
        ("ran", duration(job.get("started_at"), job.get("ended_at"))),
        ("exit code", job.get("exit_code")),
        ("failure", job.get("failure_kind")),
        ("waiting", job.get("pending_reason")),
    ]
    width = max(len(k) for k, _ in fields)
    for key, value in fields:
        if value is not None and value != "":
            print(f"  {key.ljust(width)}  {value}")
    attempts = job.get("attempts") or []
    if attempts:
        print()
        print_table([[a.get("attempt"), a.get("run_id"), a.get("state"), a.get("node"),
                      _gpu_list(a.get("gpu_indices")), a.get("exit_code"),
                      a.get("failure_kind"), clock(a.get("started_at")),
                      duration(a.get("started_at"), a.get("ended_at"))]
                     for a in attempts],
                    ["ATTEMPT", "RUN", "STATE", "NODE", "GPUS", "EXIT", "FAILURE",
                     "STARTED", "RAN"])
    return EXIT_OK


def _when(ms):
    return f"{clock(ms)} ({ago(ms)})" if ms else None


def cmd_job_cancel(args):
    job = make_client(args).cancel_job(args.job_id)
    if args.json:
        print_json(job)
    elif job["state"] == "CANCELLED":
        print(f"job {job['id']} CANCELLED")
    else:
        print(f"job {job['id']} is {job['state']}; cancel requested "
              "(SIGTERM now, SIGKILL after 5 s)")
    return EXIT_OK


def cmd_job_retry(args):
    job = make_client(args).retry_job(args.job_id)
    if args.json:
        print_json(job)
    else:
        print(f"job {job['id']} {job['state']} again (attempt {job.get('attempt')} "
              f"of {job.get('max_attempts')})")
    return EXIT_OK


def cmd_logs(args):
    client = make_client(args)
    if args.follow:
        if args.json:
            for line in client.stream_logs(args.job_id, tail=args.tail):
                print(json.dumps(line), flush=True)
            final = client.get_job(args.job_id)
        else:
            final = follow_job(client, args.job_id, tail=args.tail)
        _note(_describe_end(final))
        return _outcome_code(final["state"])
    answer = client.logs(args.job_id, tail=args.tail)
    if args.json:
        print_json(answer)
        return EXIT_OK
    attempt = None
    for line in answer.get("lines", []):
        if attempt is not None and line.get("attempt") != attempt:
            print(f"--- attempt {line.get('attempt')} ---")
        attempt = line.get("attempt")
        print(line.get("text", ""))
    if not answer.get("lines"):
        _note(f"no log lines yet (job is {answer.get('job_state')})")
    return EXIT_OK


def cmd_status(args):
    status = make_client(args).status()
    if args.json:
        print_json(status)
        return EXIT_OK
    running = {j["id"]: j for j in status.get("running", [])}

    def job_label(job_id):
        j = running.get(job_id)
        return f"job {job_id} {j.get('name') or ''}".rstrip() if j else f"job {job_id}"

    nodes = status.get("nodes", [])
    if not nodes:
        print("no nodes yet; start an agent on a GPU host with a token from "
              "`gpuplane token create --name HOST --scope agent` (docs/deploy.md)")
    for node in nodes:
        flags = [node.get("state", "?")]
        if node.get("fake"):
            flags.append("fake GPUs")
        seen = ago(node.get("last_seen"))
        if seen and node.get("state") != "connected":
            flags.append(f"last seen {seen}")
        host = node.get("hostname")
        title = node["name"] + (f" ({host})" if host and host != node["name"] else "")
        print(f"{title}  {', '.join(flags)}")
        rows = []
        for g in node.get("gpus", []):
            mem = None
            if g.get("mem_used_mb") is not None and g.get("memory_total_mb"):
                mem = f"{g['mem_used_mb']}/{g['memory_total_mb']} MiB"
            elif g.get("memory_total_mb"):
                mem = f"{g['memory_total_mb']} MiB"
            util = f"{g['util']:.0f}%" if g.get("util") is not None else None
            job = job_label(g["job_id"]) if g.get("job_id") else "free"
            rows.append([f"  GPU {g.get('index')}", g.get("name"), util, mem, job])
        if rows:
            print_table(rows, ["  SLOT", "GPU", "UTIL", "MEMORY", "JOB"])
        cpu_jobs = node.get("cpu_jobs") or []
        slots = node.get("cpu_slots")
        if slots is not None or cpu_jobs:
            used = ", ".join(job_label(j) for j in cpu_jobs) or "free"
            print(f"  CPU slots {len(cpu_jobs)}/{slots}: {used}")
    queue = status.get("queue", [])
    print()
    if not queue:
        print("queue: empty")
        return EXIT_OK
    print(f"queue: {len(queue)} job{'s' if len(queue) != 1 else ''}, in the order they "
          "will be considered")
    print_table([[i, j["id"], j.get("name"), j.get("priority"), _wants(j),
                  duration(j.get("created_at")), j.get("pending_reason") or "waiting for a slot"]
                 for i, j in enumerate(queue, 1)],
                ["#", "ID", "NAME", "PRIO", "WANTS", "WAITING", "REASON"])
    return EXIT_OK


def cmd_whoami(args):
    client = make_client(args)
    me = client.whoami()
    if args.json:
        print_json(me)
        return EXIT_OK
    access = "can write" if me.get("can_write") else "read only"
    extra = f", run {me['run_id']}" if me.get("run_id") else ""
    print(f"{me.get('name')} (scope {me.get('scope')}, {access}{extra}) at {client.server}")
    return EXIT_OK


def cmd_token_create(args):
    tok = make_client(args).create_token(args.name, args.scope)
    if args.json:
        print_json(tok)
        return EXIT_OK
    print(tok["token"])
    _note(f"token {tok['id']} {tok['name']!r} scope {tok['scope']}: the secret above is "
          "shown only this once")
    return EXIT_OK


def cmd_token_list(args):
    tokens = make_client(args).tokens()
    if args.json:
        print_json(tokens)
        return EXIT_OK
    print_table([[t["id"], t.get("name"), t.get("scope"), ago(t.get("created_at")),
                  "revoked" if t.get("revoked") else "active"] for t in tokens],
                ["ID", "NAME", "SCOPE", "CREATED", "STATE"])
    return EXIT_OK


def cmd_token_revoke(args):
    answer = make_client(args).revoke_token(args.token_id)
    if args.json:
        print_json(answer)
    else:
        print(f"token {answer.get('id', args.token_id)} revoked")
    return EXIT_OK


def cmd_token_show_admin(args):
    from gpuplane.client import local_server
    _, token, path = local_server(getattr(args, "home", None))
    if not path.exists():
        raise CliError(f"{path} does not exist; start the server once (`gpuplane server` "
                       "or `gpuplane up`) to create it with an admin token, or pass --home")
    if not token:
        raise CliError(f"{path} has no admin_token; start the server once to write one")
    print(token)
    return EXIT_OK


# -- up ----------------------------------------------------------------------------------


def _repo_root():
    # The package is installed editable or run from a checkout: the repository (with
    # agent.py and examples/) is the parent of the package directory.
    return pathlib.Path(__file__).resolve().parent.parent


class _Child:
    def __init__(self, name, argv, log_path, env):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "ab")
        # Own session: Ctrl-C reaches only `up`, which then stops agent then server in order.
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)

    def alive(self):
        return self.proc.poll() is None

    def stop(self, timeout=20):
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _note(f"{self.name} did not stop within {timeout}s; killing it")
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self._log.close()

    def tail(self, n=15):
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return ""
        return "\n".join("    " + line for line in lines)


def _wait_for(what, check, children, deadline_s):
    deadline = time.monotonic() + deadline_s
    while True:
        for child in children:
            if not child.alive():
                raise CliError(f"the {child.name} exited (code {child.proc.returncode}) "
                               f"while waiting for {what}; its log ({child.log_path}) "
                               f"ends with:\n{child.tail()}")
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise CliError(f"gave up waiting for {what} after {deadline_s}s; see "
                           + ", ".join(str(c.log_path) for c in children))
        time.sleep(0.2)


def _sigterm_to_interrupt(signum, frame):
    # Let SIGTERM take the same clean-stop path as Ctrl-C.
    raise KeyboardInterrupt


def cmd_up(args):
    from gpuplane import config
    from gpuplane.client import (ApiError, Client, ServerUnreachable, _connect_url,
                                 local_server)

    if args.exit_when_done and not args.example:
        raise CliError("--exit-when-done only makes sense with --example", EXIT_USAGE)
    repo = _repo_root()
    example_dir = repo / "examples" / "cpu"
    if args.example and not (example_dir / "train.py").exists():
        raise CliError(f"--example needs {example_dir / 'train.py'}, which is missing; the "
                       "examples come with a checkout of the repository (pip-installed "
                       "copies have none); run `gpuplane up` without --example")

    home = config.home_dir(args.home)
    home.mkdir(parents=True, exist_ok=True)
    log_dir = home / "logs"
    log_dir.mkdir(exist_ok=True)
    cfg = config.load_server_config(home)
    port = args.port or cfg.get("port") or config.DEFAULT_PORT
    url = _connect_url(args.host, port)
    name = args.name or socket.gethostname()

    probe = Client(url, "-")
    try:
        probe.health()
        raise CliError(f"a server already answers at {url}; use it, stop it, or pick "
                       "another --port")
    except (ServerUnreachable, ApiError):
        pass

    env = dict(os.environ)
    env.pop("GPUCTL_SERVER", None)
    env.pop("GPUCTL_TOKEN", None)
    env["GPUCTL_HOME"] = str(home)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(repo), env.get("PYTHONPATH", "")] if p)
    env["PYTHONUNBUFFERED"] = "1"

    server_argv = [sys.executable, "-m", "gpuplane", "--home", str(home), "server",
                   "--host", args.host, "--port", str(port)]
    if args.threads:
        server_argv += ["--threads", str(args.threads)]
    agent_py = repo / "agent.py"
    agent_argv = [sys.executable, str(agent_py)] if agent_py.exists() \
        else [sys.executable, "-m", "agent"]

    children = []
    previous = signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
    try:
        server = _Child("server", server_argv, log_dir / "server.log", env)
        children.append(server)

        def healthy():
            try:
                return probe.health()
            except (ServerUnreachable, ApiError):
                return None

        _wait_for(f"the server at {url}", healthy, children, 60)
        _, admin_token, toml_path = _wait_for(
            f"the admin token in {home / 'server.toml'}",
            lambda: (lambda found: found if found[1] else None)(local_server(home)),
            children, 10)
        client = Client(url, admin_token)

        # The token goes in the environment, not argv, where `ps` would show it.
        agent_argv += ["--server", url, "--home", str(home), "--name", name]
        if args.fake_gpus is not None:
            agent_argv += ["--fake-gpus", str(args.fake_gpus)]
        agent = _Child("agent", agent_argv, log_dir / "agent.log",
                       dict(env, GPUCTL_TOKEN=admin_token))
        children.insert(0, agent)

        def node_connected():
            for node in client.nodes():
                if node.get("name") == name and node.get("state") == "connected":
                    return node
            return None

        node = _wait_for(f"node {name!r} to connect", node_connected, children, 60)
        gpus = len(node.get("gpus") or [])
        print(f"GPUPlane is up at {url}  (REST API under /api/v1/)")
        print(f"  admin token: in {toml_path}  (print it: gpuplane token show-admin)")
        print(f"  node {name}: {gpus} GPU{'s' if gpus != 1 else ''}"
              + (" (fake)" if node.get("fake") else "")
              + f", {node.get('cpu_slots')} CPU slots")
        print(f"  logs: {server.log_path}, {agent.log_path}")
        sys.stdout.flush()

        code = EXIT_OK
        if args.example:
            # The job runs on this very host, so this interpreter (which has the
            # project's dependencies) is the right `python` for it.
            job = client.submit_job([sys.executable, "train.py", "--epochs", "3"],
                                    str(example_dir), name="cpu-example", cpu_only=True,
                                    project="examples", experiment="cpu")
            print(f"submitted job {job['id']} (examples/cpu/train.py); its logs:", flush=True)
            final = follow_job(client, job["id"])
            code = _outcome_code(final["state"])
            print(_describe_end(final))
            print(f"  details: gpuplane job show {job['id']}", flush=True)
            if args.exit_when_done:
                return code
        print("Press Ctrl-C to stop the server and the agent.", flush=True)
        while True:
            for child in children:
                if not child.alive():
                    raise CliError(f"the {child.name} exited (code {child.proc.returncode});"
                                   f" its log ({child.log_path}) ends with:\n{child.tail()}")
            time.sleep(0.5)
    except KeyboardInterrupt:
        _note("stopping")
        return EXIT_INTERRUPTED if args.exit_when_done else EXIT_OK
    finally:
        for child in children:
            child.stop()
        signal.signal(signal.SIGTERM, previous)


# -- main -----------------------------------------------------------------------------------


def main(argv=None):
    parser = get_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `gpuplane logs 3 | head`: the reader left; say nothing.
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_OK
    except Exception as e:
        return _report(e, args)


def _report(exc, args):
    from gpuplane.client import ApiError, ServerUnreachable
    if isinstance(exc, CliError):
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    if isinstance(exc, ServerUnreachable):
        print(f"error: {exc}; is it running? Start one with `gpuplane server` (or "
              "`gpuplane up`), or point at another with --server URL / $GPUCTL_SERVER",
              file=sys.stderr)
        return EXIT_UNREACHABLE
    if isinstance(exc, ApiError):
        message = exc.message
        if exc.status == 401 and not _has_token(args):
            message += ("; no token was found: pass --token, set $GPUCTL_TOKEN, or run "
                        "on the server's host where the admin token is read from server.toml")
        print(f"error: {message}", file=sys.stderr)
        return EXIT_ERROR
    try:
        from gpuplane.config import ConfigError
    except ImportError:
        ConfigError = ()
    if ConfigError and isinstance(exc, ConfigError):
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    # Never a traceback, but keep enough to report a bug with.
    print(f"error: {type(exc).__name__}: {exc} (this is a bug in gpuplane; please report "
          "it with the command you ran)", file=sys.stderr)
    if os.environ.get("GPUCTL_DEBUG"):
        raise exc
    return EXIT_ERROR


def _has_token(args):
    try:
        from gpuplane.client import resolve
        return bool(resolve(getattr(args, "server", None), getattr(args, "token", None),
                            getattr(args, "home", None))[1])
    except Exception:
        return False


if __name__ == "__main__":
    sys.exit(main())
