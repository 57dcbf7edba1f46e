"""Report metrics, checkpoints and events of a training run to GPUPlane.

    from gpuctl import run
    run.init(project="mnist", config={"lr": 1e-3})   # optional inside a platform job
    run.log({"train/loss": loss}, step=step)
    run.log_checkpoint("checkpoints/epoch_3.pt", step=step, epoch=3)
    run.finish()

Nothing here ever raises into the training process. ``log`` only puts points on an
in-memory queue; one daemon thread (``gpuctl-sdk-sender``) writes them to the local spool
and posts them to the server. See docs/sdk.md.
"""

import atexit
import collections
import itertools
import json
import os
import threading
import time

from . import sender as _sender
from . import spool as _spool

QUEUE_MAX = 10_000
FLUSH_AT_EXIT_S = 2.0

_time = time.time
_time_ns = time.time_ns
_BATCH_MAX = _sender.BATCH_MAX


class _Run:
    """Everything about the current run. ``log`` touches only the deque, the step counter
    and ``latest``; the rest belongs to init/finish and the sender thread."""

    def __init__(self):
        self.state = "new"  # new | running | finished | disabled (a forked child)
        self.mode = None  # attached | registered | local
        self.run_id = None
        self.server = None
        self.token = None
        self.info = {}
        # (seq, key, step, value, ts); deque.append is atomic and drops the oldest when full
        self.points = collections.deque(maxlen=QUEUE_MAX)
        # (seq, kind, payload): checkpoints, events, finish, flush markers. The seq puts them
        # in order with the points around them.
        self.control = collections.deque(maxlen=QUEUE_MAX)
        self.seq = itertools.count()
        self.last_step = -1
        self.latest = {}  # of points the sender has taken; summary adds the queued ones
        self.errors = 0
        self.dropped = 0
        self.sent = 0
        self.refused = 0  # points the server refused (each with its reason in refusals)
        self.refusals = {}
        self.idle = False
        self.wake = threading.Event()
        self.sender = None
        self.spool = None


_run = _Run()
_init_lock = threading.RLock()


def _error():
    _run.errors += 1


def init(project="default", experiment="", name="", config=None, server=None, token=None):
    """Start (or join) the run this process reports to, and return its id.

    The mode is chosen in this order:

    1. *attached*: ``GPUCTL_RUN_ID`` is set (the process is a GPUPlane job). The run is
       the job's; ``GPUCTL_SERVER`` and ``GPUCTL_TOKEN`` say where to send. ``config`` is
       merged into the run's config on the server (beside the job's command line), and
       ``project`` / ``experiment`` / ``name`` are set where the job left them unset;
       the job's own settings win. Returns that id.
    2. *registered*: a server and a token are given here or in ``GPUCTL_SERVER`` /
       ``GPUCTL_TOKEN``. A run with ``source=sdk`` is created with ``POST /api/v1/runs``
       and its id returned.
    3. *local*: otherwise, or when registration fails (server down, token refused).
       Everything goes to ``$GPUCTL_HOME/spool/sdk-local-<pid>-<ts>.jsonl`` and a later
       process that reaches a server replays it. Returns None. While a server and token
       are known the sender keeps retrying the registration in the background.

    Calling it again returns the current run id and changes nothing, until ``finish``;
    after ``finish`` it starts a new run. Blocks for at most one registration request
    (connect 2 s, read 5 s). Never raises.
    """
    global _run
    try:
        with _init_lock:
            if _run.state == "running":
                return None if _run.mode == "local" else _run.run_id
            if _run.state == "disabled":
                return None
            if _run.state == "finished":
                _run = _Run()
            r = _run
            r.info = {"project": project or "default", "experiment": experiment or "",
                      "name": name or "", "config": config}
            env_run = os.environ.get("GPUCTL_RUN_ID")
            given = bool(server or token or os.environ.get("GPUCTL_SERVER")
                         or os.environ.get("GPUCTL_TOKEN"))
            r.server = (server or os.environ.get("GPUCTL_SERVER") or "").rstrip("/") or None
            r.token = token or os.environ.get("GPUCTL_TOKEN") or None
            if not env_run and not given:
                # On the server's own host, with nothing given: its server, as the CLI does.
                r.server, r.token = _local_server()
            if r.server and "://" not in r.server:
                r.server = "http://" + r.server
            outcome = None
            if env_run:
                r.mode, r.run_id = "attached", env_run
            else:
                run_id = None
                if r.server and r.token:
                    run_id, outcome = _sender.register(r.server, r.token, r.info)
                if run_id is not None:
                    r.mode, r.run_id = "registered", str(run_id)
                else:
                    r.mode = "local"
                    r.run_id = "local-%d-%d" % (os.getpid(), _time_ns() // 1_000_000)
                    if given:
                        _warn_local(r, outcome)
            header = {"t": "run", "run_id": r.run_id, "mode": r.mode, "server": r.server,
                      "pid": os.getpid(), "created_at": _time_ns() // 1_000_000}
            header.update(r.info)
            r.spool = _spool.OwnSpool(_spool.spool_path(r.run_id), header)
            r.sender = _sender.Sender(r)
            r.state = "running"
            if r.mode == "attached":
                _send_init_to_job_run(project, experiment, name, config)
            r.sender.start()
            return None if r.mode == "local" else r.run_id
    except Exception:
        _error()
        return None


def _send_init_to_job_run(project, experiment, name, config):
    # Inside a job, what init was told goes to the job's run; the server keeps the job's
    # own settings where both exist (docs/sdk.md).
    body = {}
    if project and project != "default":
        body["project"] = str(project)
    if experiment:
        body["experiment"] = str(experiment)
    if name:
        body["name"] = str(name)
    if config:
        body["config"] = config
    if body:
        _enqueue_control("init", json.dumps(body, default=str))


def _local_server():
    """(url, admin token) of the server whose home is $GPUCTL_HOME (else ~/.gpuctl) on
    this host, or (None, None)."""
    try:
        import tomllib
    except ImportError:      # Python < 3.11: no TOML reader in the standard library
        return None, None
    home = os.environ.get("GPUCTL_HOME") or os.path.join(os.path.expanduser("~"), ".gpuctl")
    try:
        with open(os.path.join(home, "server.toml"), "rb") as f:
            cfg = tomllib.load(f)
    except Exception:
        return None, None
    token, port = cfg.get("admin_token"), cfg.get("port") or 8600
    host = cfg.get("host") or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = "[%s]" % host
    if not isinstance(token, str) or not token:
        return None, None
    return "http://%s:%s" % (host, port), token


_REASONS = {_sender.DENIED: "the token was refused", _sender.RETRY: "no answer",
            _sender.DROP: "the server refused the request"}


def _warn_local(r, outcome):
    """A server or token was given and does not work: say so once, count it, go on."""
    _error()
    if r.server and r.token:
        why = "%s from %s" % (_REASONS.get(outcome, "no run was created"), r.server)
    elif r.server:
        why = "a server (%s) was given but no token (set GPUCTL_TOKEN)" % r.server
    else:
        why = "a token was given but no server (set GPUCTL_SERVER)"
    try:
        import sys
        sys.stderr.write("gpuctl: logging locally for now: %s. What is logged waits in "
                         "the spool ($GPUCTL_HOME/spool/) and is sent when the server "
                         "answers (this process keeps trying; a later run replays it).\n"
                         % why)
        sys.stderr.flush()
    except Exception:
        pass


def _auto_init():
    # run.log without init: inside a platform job this attaches to the job's run
    if _run.state == "new":
        init()
    return _run.state == "running"


def log(metrics, step=None, epoch=None, ts=None):
    """Queue metric values for one step. Returns at once; never blocks on I/O.

    ``metrics`` maps names (``"train/loss"``, ``"eval/acc"``) to numbers. Values that are
    not numbers are skipped silently: strings, None, lists, bools (a flag is not a
    series). ``int``, ``float``, numpy scalars and anything else with ``__float__`` (a
    one-element tensor, a Decimal) are kept; NaN and infinity are kept. An empty dict
    does nothing.

    ``step`` defaults to the previous step of this run plus one (0 for the first call);
    a step given explicitly becomes the new previous step. The server keys points by
    (run, name, step), so logging a name again at the same step replaces its value.
    ``epoch``, when given, is also logged as the metric ``"epoch"``. ``ts`` is
    milliseconds since the epoch and defaults to now.

    Calls ``init()`` first when nothing has been initialised. After ``finish`` calls are
    ignored until ``init`` is called again.
    """
    try:
        r = _run
        if r.state != "running":
            if not _auto_init():
                return
            r = _run
        if not metrics:
            return
        if step is None:
            step = r.last_step + 1
        elif type(step) is not int:
            step = int(step)
        r.last_step = step
        # seconds as a float: the clock read is the dearest part of this call on some
        # VMs; the sender turns it into milliseconds
        if ts is None:
            ts = _time()
        else:
            ts = ts / 1000.0
        points = r.points
        for k, v in metrics.items():
            if type(v) is not float and type(v) is not int:  # bool is not int here
                v = _as_number(v)
                if v is None:
                    continue
            points.append((next(r.seq), k, step, v, ts))
        if epoch is not None:
            v = _as_number(epoch)
            if v is not None:
                points.append((next(r.seq), "epoch", step, v, ts))
        if r.idle and len(points) >= _BATCH_MAX:
            r.idle = False
            r.wake.set()
    except Exception:
        _error()


def _as_number(v):
    if isinstance(v, (bool, str, bytes)) or v is None:
        return None
    f = getattr(type(v), "__float__", None)
    if f is None:
        return None
    try:
        return float(v)
    except Exception:
        return None


def _enqueue_control(kind, payload):
    r = _run
    r.control.append((next(r.seq), kind, payload))
    r.idle = False
    r.wake.set()


def log_checkpoint(path, step=None, epoch=None):
    """Register a checkpoint file or directory. Never copies or reads it.

    Inside a job (attached) ``path`` is sent as given and the server resolves a relative
    path against the job's working dir; otherwise it is sent made absolute against this
    process's current directory. ``abs_path`` always carries the latter. Also sent:
    ``size_bytes`` (the file's size,
    or the total of the files under a directory; 0 when it does not exist), ``mtime_ns``
    (which version of the file), ``step``
    (default: the run's last step) and ``epoch``. Never raises.
    """
    try:
        if _run.state != "running" and not _auto_init():
            return
        path = os.fspath(path)
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        abs_path = os.path.abspath(path)
        # only a job's run has a working dir for the server to resolve a relative path with
        body = {"path": path if _run.mode == "attached" else abs_path, "abs_path": abs_path,
                "step": _run.last_step if step is None else int(step),
                "epoch": epoch if epoch is None else float(epoch),
                "size_bytes": _size_of(path), "mtime_ns": _mtime_ns(path),
                "ts": _time_ns() // 1_000_000}
        _enqueue_control("checkpoint", json.dumps(body))
    except Exception:
        _error()


def _mtime_ns(path):
    """Which version of the file this is: another run that registers the same path later
    with other bytes (a newer mtime) replaces this run's record (docs/checkpoints.md)."""
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _size_of(path):
    try:
        if not os.path.isdir(path):
            return os.path.getsize(path)
        total = 0
        for root, _, files in os.walk(path):
            for f in files:
                try:
                    total += os.lstat(os.path.join(root, f)).st_size
                except OSError:
                    pass
        return total
    except OSError:
        return 0


def log_event(name, data=None, step=None):
    """Record a named event (``"lr_drop"``, ``"eval_started"``) with optional JSON-able
    ``data`` at ``step`` (default: the run's last step). Never raises."""
    try:
        if _run.state != "running" and not _auto_init():
            return
        body = {"name": str(name), "data": data,
                "step": _run.last_step if step is None else int(step),
                "ts": _time_ns() // 1_000_000}
        _enqueue_control("event", json.dumps(body, default=str))
    except Exception:
        _error()


def flush(timeout_s=2.0):
    """Wait until everything logged so far is acknowledged by the server, or is safe in
    the local spool because the server cannot be reached now; at most ``timeout_s``
    seconds. Returns True when that happened in time. Never raises."""
    try:
        r = _run
        if r.state != "running" or r.sender is None or not r.sender.is_alive():
            return False
        done = threading.Event()
        _enqueue_control("flush", done)
        return done.wait(max(0.0, float(timeout_s)))
    except Exception:
        _error()
        return False


def finish(status="SUCCEEDED"):
    """End the run. For a registered run, sends the final ``status`` (``"SUCCEEDED"``,
    ``"FAILED"`` or ``"CANCELLED"``); for a job's run the agent reports the outcome, so the
    status is not sent. In every mode flushes for at most 2 s, then stops the sender;
    whatever the server has not acknowledged stays in the spool for a later process to
    replay. A second call does nothing. Never raises."""
    try:
        with _init_lock:
            r = _run
            if r.state != "running":
                return
            if r.mode in ("registered", "local"):
                # A local run's finish goes to the spool, so its replay ends the run too.
                _enqueue_control("finish", json.dumps({"status": str(status)}))
            r.state = "finishing"
        _stop(r, FLUSH_AT_EXIT_S)
    except Exception:
        _error()


def _stop(r, timeout_s):
    done = threading.Event()
    r.control.append((next(r.seq), "flush", done))
    r.wake.set()
    if not done.wait(timeout_s):
        # the sender is stuck in a request: move what is queued to the spool ourselves
        r.sender.drain()
    r.sender.stop()
    r.state = "finished"


def summary():
    """A local, read-only view of the run::

        {"run_id", "mode", "state", "latest": {name: last value}, "dropped", "errors",
         "queued", "spool", "sent", "refused", "refusals": {reason: points}}

    ``dropped`` counts points lost because the queue was full (the oldest go first),
    ``refused`` points the server refused one by one (an empty or over-long name, a
    negative step: the rest of their batch was stored), with the reasons in ``refusals``,
    ``queued`` points logged but not yet acknowledged by the server, ``sent`` points the
    server acknowledged, ``spool`` the spool file while it holds anything (always in
    local mode). Never raises.
    """
    r = _run
    out = {"run_id": r.run_id, "mode": r.mode, "state": r.state, "latest": {},
           "dropped": 0, "errors": 0, "queued": 0, "spool": None, "sent": 0,
           "refused": 0, "refusals": {}}
    try:
        latest = dict(r.latest)
        for _, k, _, v, _ in list(r.points):  # list() copies without letting appends in
            latest[k if type(k) is str else str(k)] = v
        out["latest"] = latest
        out["sent"] = r.sent
        out["refused"] = r.refused
        out["refusals"] = dict(r.refusals)
        sp = r.spool
        queued = len(r.points) + (sp.unacked_points if sp else 0)
        out["queued"] = queued
        out["dropped"] = r.dropped + (r.sender.pending_drops() if r.sender else 0)
        if sp is not None and (r.mode == "local" or sp.has_data()) and not sp.failed:
            out["spool"] = sp.path
        out["errors"] = r.errors + (sp.errors + sp.memory_drops if sp else 0)
    except Exception:
        _error()
    out["errors"] = max(out["errors"], r.errors)
    return out


def _at_exit():
    try:
        r = _run
        if r.state == "running" and r.sender is not None:
            if r.mode in ("registered", "local"):
                # Ended without finish(): FAILED, and an event saying where it stopped.
                _enqueue_control("event", json.dumps({
                    "name": "exited_without_finish", "step": max(r.last_step, 0),
                    "data": {"last_step": r.last_step}, "ts": _time_ns() // 1_000_000}))
                _enqueue_control("finish", json.dumps(
                    {"status": "FAILED", "reason": "the process ended without run.finish()"}))
            r.state = "finishing"
            _stop(r, FLUSH_AT_EXIT_S)
    except Exception:
        pass


def _after_fork_in_child():
    # a forked child (a DataLoader worker) has the parent's queue but no sender thread;
    # reporting from it would double or lose points, so the SDK is off there
    global _run, _init_lock
    _init_lock = threading.RLock()
    _run = _Run()
    _run.state = "disabled"


atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
