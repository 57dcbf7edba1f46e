"""What every command module of the CLI shares: exit codes, argument types, the
connection flags, output helpers, the client, and following a job's logs.

Top-level imports are the standard library only (see gpuplane/cli/__init__.py), and
gpuplane/states.py, which is constants.
"""

import argparse
import datetime
import json
import re
import shlex
import sys
import threading
import time

from .. import states

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_CANCELLED = 3
EXIT_UNREACHABLE = 4
EXIT_FAILED = 5
EXIT_EVENT = 6              # `job wait --until-event`: a critical event came first
EXIT_TIMEOUT = 124          # as timeout(1): `job wait --timeout` passed first
EXIT_INTERRUPTED = 130

JOB_STATES = list(states.JOB_STATES)
FINAL_STATES = set(states.JOB_FINAL)
TOKEN_SCOPES = ["read", "write", "admin", "agent"]


class CliError(Exception):
    """A problem on this side, reported as one `error:` line with this exit code."""

    def __init__(self, message, code=EXIT_ERROR):
        super().__init__(message)
        self.code = code


# -- argument types ------------------------------------------------------------------------


def env_pair(text):
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def positive_int(text):
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


job_id_type = id_type("job", "gpuplane job list")


def port_type(text):
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {value}")
    return value


# -- the flags every command takes ---------------------------------------------------------


def add_global_options(parser, suppress, home_only=False):
    # The same flags on every subcommand, so `gpuplane job list --server X` works too;
    # SUPPRESS there keeps a subcommand from resetting what was given before it.
    default = argparse.SUPPRESS if suppress else None
    g = parser.add_argument_group("connection")
    if home_only:
        g.add_argument("--home", metavar="DIR", default=default,
                       help="GPUPlane home (default: $GPUCTL_HOME, else ~/.gpuctl)")
        return
    g.add_argument("--server", metavar="URL", default=default,
                   help="server URL or HOST:PORT (default: $GPUCTL_SERVER, else the server "
                        "in the local home's server.toml, else http://127.0.0.1:8600)")
    g.add_argument("--token", metavar="TOKEN", default=default,
                   help="API token; prefer $GPUCTL_TOKEN, since a command line is visible "
                        "to every user in `ps` (default: $GPUCTL_TOKEN, else the local "
                        "server's admin token when talking to that server)")
    g.add_argument("--home", metavar="DIR", default=default,
                   help="GPUPlane home (default: $GPUCTL_HOME, else ~/.gpuctl)")


def parents():
    """(conn, js, home): parent parsers for a subcommand: the connection flags, --json,
    and --home alone (for commands that work on the local home, not over REST)."""
    conn = argparse.ArgumentParser(add_help=False)
    add_global_options(conn, suppress=True)
    js = argparse.ArgumentParser(add_help=False)
    js.add_argument("--json", action="store_true", help="print JSON instead of a table")
    home = argparse.ArgumentParser(add_help=False)
    add_global_options(home, suppress=True, home_only=True)
    return conn, js, home


def command(subparsers, name, help, parents=(), **kw):
    """Add a subcommand whose description is its help line."""
    return subparsers.add_parser(name, help=help, description=help,
                                 parents=list(parents), **kw)


# -- output ----------------------------------------------------------------------------------


def note(text):
    """A message for the human: on stderr, so stdout stays what a script reads."""
    print(text, file=sys.stderr, flush=True)


def print_json(data):
    print(json.dumps(data, indent=2, sort_keys=True))


def print_next_actions(actions):
    """The answer's next actions as `gpuplane` commands, one a line with why (the MCP
    tool calls of the answer, in the CLI's words: gpuplane/next_actions.py maps them)."""
    from gpuplane.next_actions import cli_command
    if actions:
        print("next:")
    for a in actions:
        line = cli_command(a)
        if line is None:     # no command does it: the tool call itself
            line = f"{a['tool']}(" + ", ".join(f"{k}={v!r}" for k, v in
                                              a["arguments"].items()) + ")"
        print(f"  {line}  # {a['why']}")


def print_table(rows, headers):
    """Aligned plain-text columns; None shows as '-'."""
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, v in enumerate(row):
            widths[i] = max(widths[i], len(v))
    for row in [list(headers)] + cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


def plural(n, noun):
    """'1 GPU', '2 GPUs', '0 GPUs'."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


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
    """'0.4s', '45s', '3m 12s', '1h 02m', '2d 03h' between two times (end: now): tenths
    under ten seconds, so a short job does not read "ran 0s"."""
    if not start_ms:
        return None
    end = end_ms / 1000 if end_ms else (time.time() if now is None else now)
    exact = max(0.0, end - start_ms / 1000)
    if exact < 10:
        return f"{exact:.1f}s"
    s = int(exact)
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


def command_text(command):
    if isinstance(command, list):
        return shlex.join(command)
    return command or ""


def wants(job):
    if job.get("cpu_only") or not job.get("gpus"):
        return "cpu"
    return plural(job["gpus"], "GPU")


def gpu_list(indices):
    return ",".join(str(i) for i in indices) if indices else None


# CSI sequences (colours, cursor moves, screen clears), OSC sequences (window titles,
# hyperlinks, clipboard writes), other ESC pairs, then any C0/C1 control left but tab.
_CSI = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]")
_SGR = re.compile(r"(?:\x1b\[|\x9b)[0-9;:]*m")
_OSC = re.compile(r"(?:\x1b\]|\x9d).*?(?:\x07|\x1b\\|\x9c|$)", re.S)
_ESC = re.compile(r"\x1b[@-Z\\-_]|\x1b[ -/]+[0-~]|\x1b")
_CTRL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\x80-\x9f]")


def clean_line(text, colour=False):
    """A job's output line made safe for a terminal: control characters and escape
    sequences removed; with colour, SGR (colour) sequences are kept."""
    if "\x1b" not in text and not _CTRL.search(text):
        return text
    kept = []
    if colour:
        def keep(m):
            kept.append(m.group(0))
            return f"\x00{len(kept) - 1}\x00"
        text = _SGR.sub(keep, text)
    text = _OSC.sub("", text)
    text = _CSI.sub("", text)
    text = _ESC.sub("", text)
    if colour:
        parts = text.split("\x00")
        # Odd parts are placeholders; anything else loses its control characters.
        return "".join(kept[int(p)] if i % 2 and p.isdigit() else _CTRL.sub("", p)
                       for i, p in enumerate(parts))
    return _CTRL.sub("", text)


# -- the client and jobs ---------------------------------------------------------------------


def make_client(args):
    from gpuplane.client import Client
    return Client(getattr(args, "server", None), getattr(args, "token", None),
                  getattr(args, "home", None))


def outcome_code(state):
    return {"SUCCEEDED": EXIT_OK, "FAILED": EXIT_FAILED,
            "CANCELLED": EXIT_CANCELLED}.get(state, EXIT_ERROR)


failure_reason = states.why_not_succeeded


def describe_end(job):
    stop = states.stop_label(job.get("stop_reason")) if job["state"] == "CANCELLED" else None
    text = f"job {job['id']} {stop or job['state']}"
    details = []
    if job.get("failure_kind") and not stop:
        details.append(job["failure_kind"])
    if job.get("exit_code") is not None:
        details.append(f"exit code {job['exit_code']}")
    if job.get("started_at") and job.get("ended_at"):
        details.append(f"ran {duration(job['started_at'], job['ended_at'])}")
    text += f" ({', '.join(details)})" if details else ""
    reason = failure_reason(job)
    if reason:
        text += f": {reason}"
    return text


class WaitNarrator:
    """While a followed job has not started, say on stderr why it waits, again whenever
    that changes, and once when it starts: a follower is never left silent."""

    def __init__(self, client, job_id, interval=1.0):
        self.client = client
        self.job_id = job_id
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuplane-wait-narrator",
                                        daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(2)

    def _run(self):
        from gpuplane.client import ApiError, Client, ServerUnreachable
        # Its own client: a requests.Session is not shared between threads.
        c = Client(self.client.server, self.client.token)
        try:
            while not self._stop.is_set():
                try:
                    job = c.get_job(self.job_id)
                except (ApiError, ServerUnreachable):
                    job = None
                if job is not None:
                    self._say(job)
                    if job["state"] not in ("QUEUED", "DISPATCHED"):
                        return
                self._stop.wait(self.interval)
        finally:
            c.close()

    said = None
    _lock = threading.Lock()

    def _say(self, job):
        with self._lock:
            text = self.describe(job, self.said)
            if text and text != self.said and not self.said_started():
                note(text)
                self.said = text

    def said_started(self):
        return bool(self.said) and " started on " in self.said

    def started(self):
        """The job's first log line is about to be shown: if a wait was explained, say
        that it started first, so the lines never come before that sentence."""
        self._stop.set()
        self._thread.join(2)
        if self.said and not self.said_started():
            from gpuplane.client import ApiError, ServerUnreachable
            try:
                self._say(self.client.get_job(self.job_id))
            except (ApiError, ServerUnreachable):
                pass

    def finish(self, job):
        """The follow ended: if a wait was explained, close it with the start."""
        self._stop.set()
        self._thread.join(2)
        if job is not None and self.said:
            self._say(job)

    def describe(self, job, said):
        jid = job["id"]
        if job["state"] == "QUEUED":
            return f"job {jid} is queued: {job.get('pending_reason') or 'waiting for a slot'}"
        if job["state"] == "DISPATCHED":
            return f"job {jid} dispatched to {job.get('node')}; waiting for it to start"
        if said is None:
            return None     # it was never waiting: nothing to explain
        # RUNNING, or already ended between two looks: it started, unless it ended
        # without (its command could not be started: the end says why).
        gpus = gpu_list(job.get("gpu_indices"))
        if not job.get("node") or (job["state"] != "RUNNING" and not job.get("started_at")):
            return None
        return f"job {jid} started on {job.get('node')}" + (f" (GPUs {gpus})" if gpus else "")


def follow_job(client, job_id, tail=None, out=None, colour=False):
    """Print the job's log lines until it ends; return its final job object. Until the
    job starts, why it waits is said on stderr."""
    out = out or sys.stdout
    with WaitNarrator(client, job_id) as narrator:
        final = _follow(client, job_id, tail, out, colour, narrator.started)
        narrator.finish(final)
    return final


def _say_reconnecting(reason, seconds):
    note(f"lost the log stream ({reason}); reconnecting for up to {seconds:.0f} s, "
         "resuming where it stopped")


def _follow(client, job_id, tail, out, colour, before_first=None):
    attempt = None
    try:
        for line in client.stream_job_logs(job_id, tail=tail, on_reconnect=_say_reconnecting):
            if before_first:
                out.flush()
                before_first()
                before_first = None
            if attempt is not None and line.get("attempt") != attempt:
                out.write(f"--- attempt {line.get('attempt')} ---\n")
            attempt = line.get("attempt")
            out.write(clean_line(line.get("text", ""), colour) + "\n")
            out.flush()
    except KeyboardInterrupt:
        note(f"\nstopped following; job {job_id} keeps running "
             f"(stop it with `gpuplane job cancel {job_id}`)")
        raise
    return client.get_job(job_id)
