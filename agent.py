"""GPUPlane agent: runs jobs on one GPU host and reports everything to the server.

One file on purpose: copy it to a GPU box and run `python agent.py --server URL --token T`.
It speaks only the wire protocol in docs/protocol.md and imports nothing of the server.

Sections: config, small helpers, outbox, runner + shim, tailing hooks (TensorBoard,
checkpoints), node stats, connection, agent + main.
"""
import argparse
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import psutil

VERSION = "0.1.0"
log = logging.getLogger("gpuplane.agent")


LINE_MAX = 16 * 1024              # longer log lines are cut here
OOM_TAIL_BYTES = 64 * 1024
BATCH_MAX_RECORDS = 500
BATCH_MAX_BYTES = 1024 * 1024
ACK_TIMEOUT_S = 15.0
KILL_GRACE_S = 5.0
LAUNCH_GRACE_S = 10.0             # a half-made attempt dir younger than this may still launch
SDK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sdk")

OOM_PATTERNS = re.compile(
    r"CUDA out of memory|CUDA error: out of memory|OutOfMemoryError"
    r"|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|CUDNN_STATUS_NOT_ENOUGH_WORKSPACE"
    r"|RESOURCE_EXHAUSTED[^\n]*[Oo]ut of memory")


# ---------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------

class ConfigError(Exception):
    pass


class Config:
    def __init__(self, server, token, name, home, fake_gpus=0, cpu_slots=4,
                 heartbeat_s=5.0, stats_interval_s=10.0):
        self.server = server
        self.token = token
        self.name = name
        self.home = home
        self.fake_gpus = int(fake_gpus)
        self.cpu_slots = int(cpu_slots)
        self.heartbeat_s = float(heartbeat_s)
        self.stats_interval_s = float(stats_interval_s)

    @property
    def agent_dir(self):
        return os.path.join(self.home, "agent")


def default_home():
    return os.environ.get("GPUCTL_HOME") or os.path.join(os.path.expanduser("~"), ".gpuctl")


def build_parser():
    p = argparse.ArgumentParser(
        prog="gpuplane-agent",
        description="Run GPUPlane jobs on this host and report them to the server. "
                    "Missing options are read from $GPUCTL_HOME/agent.toml.")
    p.add_argument("--server", help="server URL, e.g. http://host:8600")
    p.add_argument("--token", help="agent or admin token")
    p.add_argument("--name", help="node name (default: hostname)")
    p.add_argument("--home", help="state directory (default: $GPUCTL_HOME or ~/.gpuctl)")
    p.add_argument("--fake-gpus", type=int, metavar="N",
                   help="pretend to have N GPUs (for hosts without NVIDIA hardware)")
    p.add_argument("--cpu-slots", type=int, metavar="N", help="concurrent cpu_only jobs")
    p.add_argument("--heartbeat", type=float, metavar="S", help="heartbeat interval")
    p.add_argument("--stats-interval", type=float, metavar="S", help="node stats interval")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def load_config(args):
    import tomllib
    home = os.path.abspath(os.path.expanduser(args.home or default_home()))
    toml = {}
    path = os.path.join(home, "agent.toml")
    if os.path.exists(path):
        try:
            with open(path, "rb") as f:
                toml = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read {path}: {e}")

    def pick(flag, key, default=None):
        return flag if flag is not None else toml.get(key, default)

    # flags, then the environment (keeps the token out of `ps`), then agent.toml
    server = pick(args.server or os.environ.get("GPUCTL_SERVER"), "server")
    token = pick(args.token or os.environ.get("GPUCTL_TOKEN"), "token")
    if not server or not token:
        missing = " and ".join(n for n, v in (("--server", server), ("--token", token)) if not v)
        raise ConfigError(f"{missing} missing: pass it on the command line, in "
                          f"GPUCTL_SERVER/GPUCTL_TOKEN, or set server/token in {path}")
    return Config(server=server, token=token,
                  name=pick(args.name, "name") or socket.gethostname(), home=home,
                  fake_gpus=pick(args.fake_gpus, "fake_gpus", 0),
                  cpu_slots=pick(args.cpu_slots, "cpu_slots", 4),
                  heartbeat_s=pick(args.heartbeat, "heartbeat_s", 5.0),
                  stats_interval_s=pick(args.stats_interval, "stats_interval_s", 10.0))


# ---------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------

def now_ms():
    return int(time.time() * 1000)


def write_json_atomic(path, obj, private=False):
    """tmp file, fsync, rename; the one copy lives in SHIM_SOURCE (the shim needs it too)."""
    _shim_write(path, obj, 0o600 if private else 0o644)


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as e:
        log.warning("unreadable %s: %s", path, e)
        return None


def fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def proc_alive(pid, create_time):
    """True when `pid` is still the process that started at `create_time` (guards pid reuse)."""
    if not pid:
        return False
    try:
        p = psutil.Process(pid)
        if create_time is not None and abs(p.create_time() - create_time) > 0.05:
            return False
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


class Worker:
    """A background thread: the subclass's tick() every `interval` seconds until stop()."""
    interval = 1.0
    name = "worker"

    def __init__(self):
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        self._thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self._thread.start()

    def run(self):
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception:
                log.exception("%s: tick failed", self.name)

    def stop(self, timeout=10.0):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("thread %s did not exit within %.0f s", self._thread.name, timeout)


# ---------------------------------------------------------------------------------------
# outbox: one ordered, spooled, per-node sequence of records
# ---------------------------------------------------------------------------------------
#
# Records are appended (flushed, fsynced) to agent/spool/outbox.jsonl before they can be
# sent. A record may carry a private `_att` field, {"key": "<job>/<attempt>", ...}, with the
# attempt's tail state after that record (log offset, line_no, TB offsets, reported flags);
# it is stripped from the wire. Because it is written in the same line as the data, the
# tail position and the data it produced can never disagree after a crash.
# agent/state.json holds epoch, next_seq, acked and a snapshot of all attempt states as of
# `snapshot_seq`; on start the spool records above snapshot_seq are folded on top of it.

class Outbox:
    def __init__(self, agent_dir, compact_min=1000):
        self.dir = agent_dir
        self.spool_dir = os.path.join(agent_dir, "spool")
        self.spool_path = os.path.join(self.spool_dir, "outbox.jsonl")
        self.state_path = os.path.join(agent_dir, "state.json")
        os.makedirs(self.spool_dir, exist_ok=True)
        self.lock = threading.RLock()
        self.compact_min = compact_min
        self.epoch = None
        self.next_seq = 1
        self.acked = 0
        self.attempts = {}        # key -> tail/report state (see above)
        self._pending = []        # [seq, full record dict, wire json] with seq > acked
        self._spool = None
        self._dropped_lines = 0   # acked lines still in the spool file
        self.last_job_seq = 0     # seq of the newest `job` record
        self._load()

    # -- start-up ------------------------------------------------------------------------

    def _load(self):
        state = read_json(self.state_path)
        spool_exists = os.path.exists(self.spool_path)
        records = self._read_spool()
        if state is None:
            self.epoch = None
            self._pending = [[r["seq"], r, None] for r in records]
            for r in records:
                if "_att" in r:
                    self._fold(r["_att"])
            self._new_epoch("no state.json" if records else None)
        else:
            self.epoch = state["epoch"]
            self.acked = int(state.get("acked", 0))
            self.next_seq = max(int(state.get("next_seq", 1)),
                                max((r["seq"] for r in records), default=0) + 1)
            self.attempts = state.get("attempts", {})
            snapshot = int(state.get("snapshot_seq", 0))
            for r in records:
                if r["seq"] > snapshot and "_att" in r:
                    self._fold(r["_att"])
            self._pending = [[r["seq"], r, _wire(r)] for r in records if r["seq"] > self.acked]
            lost = not spool_exists and self.next_seq - 1 > self.acked
            if lost or not self._contiguous():
                # The server would wait forever for the missing seqs: start over.
                self._new_epoch("spool lost" if lost else "gap in spool")
        self.last_job_seq = max((p[0] for p in self._pending if p[1]["kind"] == "job"),
                                default=0)
        self._rewrite()         # always: drops acked and torn lines, writes renumbered seqs
        log.info("outbox: epoch %s, next seq %d, acked %d, %d pending",
                 self.epoch, self.next_seq, self.acked, len(self._pending))

    def _read_spool(self):
        records = []
        try:
            with open(self.spool_path, "rb") as f:
                lines = f.read().split(b"\n")
        except FileNotFoundError:
            return records
        if lines and lines[-1] == b"":
            lines.pop()
        for i, line in enumerate(lines):
            try:
                rec = json.loads(line)
                rec["seq"] = int(rec["seq"])
                rec["kind"]
            except (ValueError, KeyError, TypeError):
                if i == len(lines) - 1:
                    log.warning("outbox: skipping a torn last line in %s (crash mid-write?)",
                                self.spool_path)
                else:
                    log.warning("outbox: skipping unparseable line %d in %s", i + 1,
                                self.spool_path)
                continue
            records.append(rec)
        records.sort(key=lambda r: r["seq"])
        return records

    def _contiguous(self):
        seqs = [p[0] for p in self._pending]
        expected = list(range(self.acked + 1, self.acked + 1 + len(seqs)))
        return seqs == expected and (not seqs or seqs[-1] == self.next_seq - 1)

    def _new_epoch(self, reason):
        """Start a fresh epoch; pending records are renumbered from 1 (the server resets
        its cursor to 0 for a new epoch; natural keys keep replays from doubling)."""
        old = self.epoch
        self.epoch = os.urandom(8).hex()
        self.acked = 0
        for i, p in enumerate(self._pending, start=1):
            p[0] = i
            p[1]["seq"] = i
            p[2] = _wire(p[1])
        self.next_seq = len(self._pending) + 1
        self.last_job_seq = max((p[0] for p in self._pending if p[1]["kind"] == "job"),
                                default=0)
        if reason:
            log.warning("outbox: new epoch %s (was %s): %s; %d records renumbered",
                        self.epoch, old, reason, len(self._pending))

    def _fold(self, att):
        key = att.get("key")
        if key:
            st = self.attempts.setdefault(key, {})
            st.update({k: v for k, v in att.items() if k != "key"})

    # -- writing -------------------------------------------------------------------------

    def append(self, kind, fields, att=None):
        """Spool one record (fsynced) and return its seq."""
        with self.lock:
            rec = {"seq": self.next_seq, "kind": kind, "ts": fields.pop("ts", now_ms())}
            rec.update(fields)
            if att:
                rec["_att"] = att
            line = json.dumps(rec, separators=(",", ":")) + "\n"
            where = self._spool.tell()
            try:
                self._spool.write(line.encode())
                self._spool.flush()
                os.fsync(self._spool.fileno())
            except OSError:
                # e.g. disk full: never leave half a line for the next record to glue onto
                self._spool.truncate(where)
                raise
            self.next_seq += 1
            self._pending.append([rec["seq"], rec, _wire(rec)])
            if kind == "job":
                self.last_job_seq = rec["seq"]
            if att:
                self._fold(att)
            return rec["seq"]

    def attempt_state(self, key):
        with self.lock:
            return dict(self.attempts.get(key, {}))

    def forget(self, key):
        with self.lock:
            self.attempts.pop(key, None)

    # -- sending -------------------------------------------------------------------------

    @property
    def last_seq(self):
        return self.next_seq - 1

    def pending_after(self, seq, max_records=BATCH_MAX_RECORDS, max_bytes=BATCH_MAX_BYTES):
        """Up to one batch of (seq, wire json) with seq > `seq`, in order."""
        with self.lock:
            out, size = [], 0
            start = max(0, seq - self.acked)      # pending is contiguous from acked + 1
            for s, _rec, wire in self._pending[start:]:
                if s <= seq:
                    continue
                if out and (len(out) >= max_records or size + len(wire) > max_bytes):
                    break
                out.append((s, wire))
                size += len(wire) + 1
            return out

    def batch_message(self, items):
        return ('{"type":"batch","epoch":%s,"records":[%s]}'
                % (json.dumps(self.epoch), ",".join(w for _s, w in items)))

    def ack(self, seq):
        with self.lock:
            seq = min(int(seq), self.last_seq)
            if seq <= self.acked:
                return
            n = seq - self.acked
            del self._pending[:n]
            self._dropped_lines += n
            self.acked = seq
            # rewriting costs the pending records, so do it when that is cheap or amortised
            if not self._pending or self._dropped_lines >= max(self.compact_min,
                                                               len(self._pending)):
                self._rewrite()

    def restart_epoch(self, reason):
        """The server's cursor does not fit our history (e.g. its database was restored)."""
        with self.lock:
            self._new_epoch(reason)
            self._dropped_lines = 1
            self._rewrite()

    # -- files ---------------------------------------------------------------------------

    def save_state(self):
        with self.lock:
            write_json_atomic(self.state_path, {
                "epoch": self.epoch, "next_seq": self.next_seq, "acked": self.acked,
                "snapshot_seq": self.last_seq, "attempts": self.attempts})

    def _rewrite(self):
        """Compact: state.json first (so its snapshot covers what the spool drops), then
        the spool with only unacked records, both atomically."""
        self.save_state()
        if self._dropped_lines or self._spool is None:
            tmp = self.spool_path + ".tmp"
            with open(tmp, "wb") as f:
                for _s, rec, _w in self._pending:
                    f.write(json.dumps(rec, separators=(",", ":")).encode() + b"\n")
                f.flush()
                os.fsync(f.fileno())
            if self._spool is not None:
                self._spool.close()
            os.replace(tmp, self.spool_path)
            fsync_dir(self.spool_dir)
            self._dropped_lines = 0
        if self._spool is None or self._spool.closed:
            self._spool = open(self.spool_path, "ab")

    def close(self):
        with self.lock:
            if self._spool is not None and not self._spool.closed:
                self.save_state()
                self._spool.close()


def _wire(rec):
    return json.dumps({k: v for k, v in rec.items() if not k.startswith("_")},
                      separators=(",", ":"))


# ---------------------------------------------------------------------------------------
# runner: start, watch, cancel and re-adopt job attempts
# ---------------------------------------------------------------------------------------
#
# agent/jobs/<job>/<attempt>/ holds spec.json (the start command and the resolved exec),
# launch.json (the shim's pid), pid (the command's pid + start time, written by the shim),
# log, exit (written by the shim), cancel (the time a cancel was asked for) and reported
# (the final record, once it is in the outbox).

def job_environment(msg, base_env=None, sdk_dir=SDK_DIR):
    env = {k: v for k, v in (base_env if base_env is not None else os.environ).items()
           if not k.startswith("GPUCTL_")}
    job_env = {str(k): str(v) for k, v in (msg.get("env") or {}).items()}
    env.update(job_env)
    env.update({
        "GPUCTL_RUN_ID": str(msg.get("run_id") or ""),
        "GPUCTL_JOB_ID": str(msg["job_id"]),
        "GPUCTL_SERVER": msg.get("server_url") or "",
        "GPUCTL_TOKEN": msg.get("ingest_token") or "",
        "CUDA_VISIBLE_DEVICES": "" if msg.get("cpu_only") else
        ",".join(str(g) for g in msg.get("gpus") or []),
    })
    env.setdefault("PYTHONUNBUFFERED", "1")
    if "PYTHONPATH" not in job_env and os.path.isdir(sdk_dir):
        # the job's own PYTHONPATH wins; an inherited one keeps precedence over the SDK
        inherited = env.get("PYTHONPATH")
        env["PYTHONPATH"] = f"{inherited}{os.pathsep}{sdk_dir}" if inherited else sdk_dir
    return env


def resolve_command(command, working_dir, env):
    """-> (argv, executable) or raise ValueError naming what is wrong."""
    if not working_dir or not os.path.isabs(working_dir):
        raise ValueError(f"working dir must be an absolute path, got {working_dir!r}")
    if not os.path.isdir(working_dir):
        raise ValueError(f"working dir does not exist on this host: {working_dir}")
    if isinstance(command, str):
        return ["/bin/sh", "-c", command], "/bin/sh"
    if not command or not all(isinstance(a, str) for a in command):
        raise ValueError(f"command must be a non-empty list of strings, got {command!r}")
    exe = command[0]
    if "/" in exe:
        path = os.path.join(working_dir, exe)
        if not os.path.isfile(path):
            raise ValueError(f"command not found: {exe}")
        if not os.access(path, os.X_OK):
            raise ValueError(f"command not executable: {exe}")
        return list(command), os.path.abspath(path)
    path = shutil.which(exe, path=env.get("PATH", os.defpath))
    if path is None:
        raise ValueError(f"command not found: {exe}")
    if not os.path.isabs(path):     # a relative entry in PATH
        path = os.path.join(working_dir, path)
    return list(command), path


def classify_exit(exit_info, log_path, cancel_info):
    """-> (failure_kind, message) for an exit file."""
    if exit_info.get("failure_kind"):
        return exit_info["failure_kind"], exit_info.get("message")
    ended = exit_info.get("ended_at") or now_ms()
    if cancel_info is not None and cancel_info.get("requested_at", 0) <= ended:
        return "CANCELLED", "cancelled"
    code, sig = exit_info.get("exit_code"), exit_info.get("signal")
    if code == 0 and not sig:
        return None, None
    tail = b""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - OOM_TAIL_BYTES))
            tail = f.read()
    except OSError:
        pass
    text = tail.decode("utf-8", "replace")
    m = OOM_PATTERNS.search(text)
    if m:
        line_start = text.rfind("\n", 0, m.start()) + 1
        line_end = text.find("\n", m.end())
        return "OOM", text[line_start:line_end if line_end >= 0 else None].strip()[:500]
    how = f"exited with code {code}" if sig is None else \
        f"killed by signal {sig} ({_signame(sig)})"
    last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")
    return "EXIT_CODE", (f"{how}: {last}" if last else how)[:500]


def _signame(sig):
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def split_log(data, skip, at_eof):
    """Cut `data` (bytes read from a log at some offset) into lines.

    -> (items, consumed, skip): items are (line bytes, end offset in data, skip after it).
    `skip` means we are inside an over-long line whose first LINE_MAX bytes were already
    emitted. A trailing partial line stays unconsumed unless `at_eof` or it is too long.
    """
    items, pos = [], 0
    while True:
        nl = data.find(b"\n", pos)
        if nl == -1:
            break
        raw, pos = data[pos:nl], nl + 1
        if skip:
            skip = False
            continue
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        items.append((raw[:LINE_MAX], pos, False))
    rest = data[pos:]
    if rest:
        if skip:
            pos = len(data)
        elif len(rest) >= LINE_MAX:
            pos, skip = len(data), True
            items.append((rest[:LINE_MAX], pos, True))
        elif at_eof:
            pos = len(data)
            items.append((rest, pos, False))
    return items, pos, skip


class Attempt:
    def __init__(self, job_id, attempt, path):
        self.job_id, self.attempt, self.dir = int(job_id), int(attempt), path
        self.key = f"{self.job_id}/{self.attempt}"
        spec = read_json(self.file("spec.json")) or {}
        start = spec.get("start", {})
        self.received_at = spec.get("received_at") or now_ms()
        self.run_id = start.get("run_id")
        self.gpus = list(start.get("gpus") or [])
        self.working_dir = start.get("working_dir")
        self.tb_dir = start.get("tb_dir")
        self.watch_dir = start.get("watch_dir")
        self.popen = None                 # the shim, when this agent process launched it
        self.pid_info = None
        self.offset, self.line_no, self.skip = 0, 0, False
        self.running_reported = False
        self.final = False
        self.term_sent = False
        self.killed = False
        self.tree = {}                    # pid -> create_time of every descendant seen
        self.tb = None
        self.tb_offsets = {}
        self.ckpt_done = {}               # path -> fingerprint already reported
        self.ckpt_seen = {}               # path -> fingerprint seen at the last scan
        self.next_hook = 0.0

    def file(self, name):
        return os.path.join(self.dir, name)

    def load_state(self, st):
        self.offset = int(st.get("offset", 0))
        self.line_no = int(st.get("line_no", 0))
        self.skip = bool(st.get("skip", False))
        self.running_reported = bool(st.get("running", False))
        self.tb_offsets = dict(st.get("tb", {}))
        self.ckpt_done = dict(st.get("ckpt", {}))

    def pid(self):
        if self.pid_info is None:
            self.pid_info = read_json(self.file("pid"))
        return self.pid_info

    def command_alive(self):
        info = self.pid()
        return bool(info) and proc_alive(info.get("pid"), info.get("create_time"))


class Runner(Worker):
    name = "gpuplane-agent-runner"
    # How soon an exit or new log lines are noticed: a few stats per running attempt.
    interval = 0.1

    def __init__(self, agent_dir, outbox, kill_grace_s=KILL_GRACE_S, server_url=None,
                 hook_interval_s=2.0, shim_argv=None):
        super().__init__()
        self.jobs_dir = os.path.join(agent_dir, "jobs")
        os.makedirs(self.jobs_dir, exist_ok=True)
        self.outbox = outbox
        self.kill_grace_s = kill_grace_s
        self.server_url = server_url
        self.hook_interval_s = hook_interval_s
        self.shim_argv = shim_argv or shim_command()
        self.lock = threading.RLock()
        self.active = {}                  # key -> Attempt not yet finally reported
        self.adopt()

    # -- start-up ------------------------------------------------------------------------

    def known(self):
        out = []
        for job in os.listdir(self.jobs_dir):
            jdir = os.path.join(self.jobs_dir, job)
            if not job.isdigit() or not os.path.isdir(jdir):
                continue
            for att in os.listdir(jdir):
                if att.isdigit() and os.path.isdir(os.path.join(jdir, att)):
                    out.append((int(job), int(att)))
        return sorted(out)

    def adopt(self):
        """Re-adopt every attempt whose final state was never put in the outbox."""
        with self.lock:
            for job_id, attempt in self.known():
                key = f"{job_id}/{attempt}"
                path = os.path.join(self.jobs_dir, str(job_id), str(attempt))
                st = self.outbox.attempt_state(key)
                if os.path.exists(os.path.join(path, "reported")):
                    self.outbox.forget(key)
                    continue
                if st.get("final"):
                    # the final record made it into the outbox; only the marker is missing
                    write_json_atomic(os.path.join(path, "reported"), st.get("record", {}))
                    continue
                att = Attempt(job_id, attempt, path)
                att.load_state(st)
                self.active[key] = att
                log.info("re-adopting job %s attempt %s (log offset %d, line %d)",
                         job_id, attempt, att.offset, att.line_no)

    # -- commands ------------------------------------------------------------------------

    def handle_start(self, msg):
        job_id, attempt = int(msg["job_id"]), int(msg["attempt"])
        key = f"{job_id}/{attempt}"
        jdir = os.path.join(self.jobs_dir, str(job_id))
        path = os.path.join(jdir, str(attempt))
        with self.lock:
            os.makedirs(jdir, exist_ok=True)
            try:
                os.mkdir(path)       # the once-ever guard for (job_id, attempt)
            except FileExistsError:
                self._rereport(key, path)
                return
            msg = dict(msg)
            if not msg.get("server_url"):
                msg["server_url"] = self.server_url
            env = job_environment(msg)
            spec = {"start": msg, "received_at": now_ms()}
            try:
                argv, exe = resolve_command(msg.get("command"), msg.get("working_dir"), env)
                spec["exec"] = {"argv": argv, "executable": exe,
                                "cwd": msg["working_dir"], "env": env}
            except ValueError as e:
                spec["exec"] = None
                write_json_atomic(os.path.join(path, "spec.json"), spec, private=True)
                open(os.path.join(path, "log"), "ab").close()
                write_json_atomic(os.path.join(path, "exit"), {
                    "exit_code": None, "signal": None, "ended_at": now_ms(),
                    "failure_kind": "DISPATCH_FAILED", "message": str(e)})
                log.warning("job %s attempt %s not started: %s", job_id, attempt, e)
            else:
                write_json_atomic(os.path.join(path, "spec.json"), spec, private=True)
            att = Attempt(job_id, attempt, path)
            self.active[key] = att
            if spec["exec"] is not None:
                self._launch(att)
            self._tick_attempt(att)
            if att.final:
                del self.active[key]

    def _launch(self, att):
        with open(os.devnull, "rb") as devnull, open(att.file("shim.err"), "ab") as err:
            att.popen = subprocess.Popen(self.shim_argv + [att.dir], stdin=devnull,
                                         stdout=err, stderr=err, start_new_session=True,
                                         close_fds=True)
        try:
            ct = psutil.Process(att.popen.pid).create_time()
        except psutil.NoSuchProcess:
            ct = None
        write_json_atomic(att.file("launch.json"), {"shim_pid": att.popen.pid,
                                                    "shim_create_time": ct})
        log.info("job %s attempt %s: launched shim pid %d", att.job_id, att.attempt,
                 att.popen.pid)

    def _rereport(self, key, path):
        att = self.active.get(key)
        if att is not None:
            if att.running_reported and att.pid():
                self._report_running(att)
            return
        rec = read_json(os.path.join(path, "reported"))
        if rec:
            fields = {k: rec[k] for k in ("job_id", "attempt", "state", "pid", "exit_code",
                                          "signal", "failure_kind", "message") if k in rec}
            self.outbox.append("job", fields)
        log.info("start for known attempt %s: re-reported its state", key)

    def handle_cancel(self, msg):
        key = f"{int(msg['job_id'])}/{int(msg['attempt'])}"
        with self.lock:
            att = self.active.get(key)
            if att is None:
                path = os.path.join(self.jobs_dir, str(int(msg["job_id"])),
                                    str(int(msg["attempt"])))
                if os.path.isdir(path):
                    self._rereport(key, path)
                return
            if not os.path.exists(att.file("cancel")):
                write_json_atomic(att.file("cancel"), {"requested_at": now_ms()})
                log.info("cancelling job %s attempt %s", att.job_id, att.attempt)
            self._tick_attempt(att)
            if att.final:
                del self.active[key]

    # -- the loop ------------------------------------------------------------------------

    def tick(self):
        with self.lock:
            for key, att in list(self.active.items()):
                try:
                    self._tick_attempt(att)
                except Exception:
                    log.exception("job %s attempt %s: watch failed", att.job_id, att.attempt)
                if att.final:
                    self.active.pop(key, None)

    def _tick_attempt(self, att):
        if att.pid() and not att.running_reported:
            self._report_running(att)
        if att.pid():        # until then lines wait, so RUNNING comes before the first one
            self._tail(att, at_eof=False)
        if time.monotonic() >= att.next_hook:
            att.next_hook = time.monotonic() + self.hook_interval_s
            self._hooks(att)
        cancel = read_json(att.file("cancel"))
        exit_info = read_json(att.file("exit"))
        if cancel is not None:
            if not self._enforce_cancel(att, cancel):
                return              # still inside the grace period with survivors
        if exit_info is None:
            if self._shim_alive(att) or att.command_alive():
                return
            exit_info = read_json(att.file("exit"))   # the shim may have just finished
            if exit_info is None:
                exit_info = {"exit_code": None, "signal": None, "ended_at": now_ms(),
                             "failure_kind": "LOST",
                             "message": "the job's shim vanished without an exit status "
                                        "(host reboot or killed)"}
        self._finish(att, exit_info, cancel)

    def _shim_alive(self, att):
        if att.popen is not None:
            return att.popen.poll() is None
        info = att.pid() or read_json(att.file("launch.json"))
        if info and info.get("shim_pid"):
            return proc_alive(info["shim_pid"], info.get("shim_create_time"))
        # no launch record: a crash between mkdir and launch, or a launch right now
        try:
            age = time.time() - os.stat(att.dir).st_mtime
        except OSError:
            return False
        return age < LAUNCH_GRACE_S

    def _report_running(self, att):
        info = att.pid()
        self.outbox.append("job", {
            "job_id": att.job_id, "attempt": att.attempt, "state": "RUNNING",
            "pid": info.get("pid"), "exit_code": None, "signal": None,
            "failure_kind": None, "message": None},
            att={"key": att.key, "running": True})
        att.running_reported = True

    def _finish(self, att, exit_info, cancel):
        if att.pid() and not att.running_reported:
            self._report_running(att)     # a fast job: say it ran before it ended
        self._tail(att, at_eof=True)
        self._hooks(att, final=True)
        if exit_info.get("failure_kind") == "LOST":
            kind, message = "LOST", exit_info["message"]
        else:
            kind, message = classify_exit(exit_info, att.file("log"), cancel)
        rec = {"job_id": att.job_id, "attempt": att.attempt, "state": "EXITED",
               "pid": (att.pid() or {}).get("pid"), "exit_code": exit_info.get("exit_code"),
               "signal": exit_info.get("signal"), "failure_kind": kind, "message": message}
        self.outbox.append("job", dict(rec), att={"key": att.key, "final": True,
                                                  "record": rec})
        write_json_atomic(att.file("reported"), rec)
        att.final = True
        if att.popen is not None:
            att.popen.poll()
        log.info("job %s attempt %s exited: code %s signal %s failure %s", att.job_id,
                 att.attempt, rec["exit_code"], rec["signal"], kind)

    # -- cancel --------------------------------------------------------------------------

    def _enforce_cancel(self, att, cancel):
        """SIGTERM the group, SIGKILL it and every descendant seen after the grace period.
        -> True once nothing of the job is left (or it never started)."""
        info = att.pid()
        if not info:
            return not self._shim_alive(att) or read_json(att.file("exit")) is not None
        pgid = info["pid"]
        self._remember_tree(att, info)
        if not att.term_sent:
            att.term_sent = True
            _killpg(pgid, signal.SIGTERM)
        survivors = self._survivors(att, pgid)
        if not survivors:
            return True
        if now_ms() - cancel.get("requested_at", 0) >= self.kill_grace_s * 1000:
            if not att.killed:
                log.info("job %s attempt %s: %d processes survived SIGTERM; SIGKILL",
                         att.job_id, att.attempt, len(survivors))
                att.killed = True
            _killpg(pgid, signal.SIGKILL)
            for p in survivors:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            return not self._survivors(att, pgid)
        return False

    def _remember_tree(self, att, info):
        if proc_alive(info["pid"], info.get("create_time")):
            try:
                for c in psutil.Process(info["pid"]).children(recursive=True):
                    att.tree[c.pid] = c.create_time()
            except psutil.NoSuchProcess:
                pass
        # children of processes we saw, which may have left the group (setsid)
        for pid, ct in list(att.tree.items()):
            if proc_alive(pid, ct):
                try:
                    for c in psutil.Process(pid).children(recursive=True):
                        att.tree[c.pid] = c.create_time()
                except psutil.NoSuchProcess:
                    pass

    def _survivors(self, att, pgid):
        out = []
        info = att.pid()
        candidates = dict(att.tree)
        candidates[info["pid"]] = info.get("create_time")
        for pid, ct in candidates.items():
            if proc_alive(pid, ct):
                try:
                    out.append(psutil.Process(pid))
                except psutil.NoSuchProcess:
                    pass
        if not out:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return out
            # a group member we never saw (forked since the last look)
            for p in psutil.process_iter():
                try:
                    if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                        out.append(p)
                except (ProcessLookupError, psutil.NoSuchProcess):
                    pass
        return out

    # -- tailing ---------------------------------------------------------------------------

    def _tail(self, att, at_eof):
        path = att.file("log")
        try:
            size = os.path.getsize(path)
        except OSError:
            return
        while att.offset < size:
            with open(path, "rb") as f:
                f.seek(att.offset)
                data = f.read(min(size - att.offset, 4 * 1024 * 1024))
            if not data:
                break
            reached_end = att.offset + len(data) >= size
            items, consumed, skip = split_log(data, att.skip, at_eof and reached_end)
            self._emit_lines(att, items)
            att.offset += consumed
            att.skip = skip
            if not reached_end and consumed == 0:
                break
            if reached_end:
                break

    def _emit_lines(self, att, items):
        base, ts = att.offset, now_ms()
        chunk, size = [], 0
        for i, (raw, end, skip_after) in enumerate(items):
            att.line_no += 1
            text = raw.decode("utf-8", "replace")
            chunk.append([att.line_no, ts, text])
            size += len(text) + 32
            if len(chunk) >= 1000 or size >= 256 * 1024 or i == len(items) - 1:
                self.outbox.append("log", {"job_id": att.job_id, "attempt": att.attempt,
                                           "lines": chunk},
                                   att={"key": att.key, "offset": base + end,
                                        "line_no": att.line_no, "skip": skip_after})
                chunk, size = [], 0

    # -- hooks: TensorBoard and checkpoints ------------------------------------------------

    def _hooks(self, att, final=False):
        if att.run_id is None:
            return
        try:
            self._tb_hook(att, final)
        except Exception:
            log.exception("job %s attempt %s: TensorBoard tailing failed", att.job_id,
                          att.attempt)
        try:
            self._checkpoint_hook(att)
        except Exception:
            log.exception("job %s attempt %s: checkpoint scan failed", att.job_id,
                          att.attempt)

    def _tb_hook(self, att, final=False):
        root = att.tb_dir or att.working_dir
        if root and not os.path.isabs(root):
            root = os.path.join(att.working_dir or "/", root)    # --tb-dir runs
        if not root or not os.path.isdir(root):
            return
        if att.tb is None:
            att.tb = TBTailer(root, att.received_at / 1000.0, dict(att.tb_offsets))
        while True:
            # After the exit: look for files written since the last walk, and read
            # everything, even a backlog longer than one poll hands out.
            points = att.tb.poll(rescan=final)
            self._emit_tb(att, points)
            if not final or len(points) < att.tb.max_points:
                break

    def _emit_tb(self, att, points):
        for i in range(0, len(points), 5000):
            chunk = [[k, int(s), float(v), int(ts)] for k, s, v, ts in points[i:i + 5000]]
            last = i + 5000 >= len(points)
            # offsets ride on the last chunk only: a crash in between re-reads the poll,
            # and the server's (run, key, step) upsert absorbs the repeat
            self.outbox.append("metrics", {"run_id": att.run_id, "source": "tb",
                                           "points": chunk},
                               att={"key": att.key, "tb": dict(att.tb.offsets)} if last else None)
        att.tb_offsets = dict(att.tb.offsets)

    def _checkpoint_hook(self, att):
        if not att.watch_dir:
            return
        root = att.watch_dir
        if not os.path.isabs(root):
            root = os.path.join(att.working_dir or "/", root)
        if not os.path.isdir(root):
            return
        now = {}
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if name.startswith(".") or name.endswith((".tmp", ".partial", ".lock")):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                now[path] = (f"{st.st_size}-{st.st_mtime_ns}", st.st_size)
        # debounce: a file counts once it looked the same on two scans in a row
        for path, (fp, size) in sorted(now.items()):
            if att.ckpt_seen.get(path) == fp and att.ckpt_done.get(path) != fp:
                att.ckpt_done[path] = fp
                step, epoch = checkpoint_step(os.path.basename(path))
                self.outbox.append("checkpoint", {
                    "run_id": att.run_id, "path": path, "step": step, "epoch": epoch,
                    "size_bytes": size, "fingerprint": fp},
                    att={"key": att.key, "ckpt": dict(att.ckpt_done)})
        att.ckpt_seen = {p: fp for p, (fp, _s) in now.items()}

    # -- views for the other threads -------------------------------------------------------

    def running(self):
        """[(Attempt, pid)] of attempts whose command is alive now."""
        with self.lock:
            out = []
            for att in self.active.values():
                info = att.pid()
                if info and not att.final and att.command_alive():
                    out.append((att, info["pid"]))
            return out

    def sync_message(self):
        with self.lock:
            running = []
            for att in self.active.values():
                if att.final:
                    continue
                info = att.pid()
                if (info and att.command_alive()) or (not info and self._shim_alive(att)):
                    running.append({"job_id": att.job_id, "attempt": att.attempt,
                                    "pid": info.get("pid") if info else None})
            return {"type": "sync", "running": running,
                    "known": [[j, a] for j, a in self.known()]}

    def busy_gpus(self):
        with self.lock:
            return {g for att in self.active.values() if not att.final for g in att.gpus}


def _killpg(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def checkpoint_step(name):
    m = re.search(r"(?:global_step|step|iter|it)[=_-]?(\d+)", name, re.I)
    e = re.search(r"epoch[=_-]?(\d+)", name, re.I)
    step = int(m.group(1)) if m else None
    epoch = float(e.group(1)) if e else None
    if step is None and epoch is None:
        nums = re.findall(r"\d+", name)
        step = int(nums[-1]) if nums else None
    return step, epoch


# ---------------------------------------------------------------------------------------
# the shim: `python agent.py _shim DIR`, its own session, outlives the agent
# ---------------------------------------------------------------------------------------

# The shim runs as `python -c SHIM_SOURCE DIR`: a few stdlib imports instead of compiling
# this whole file (and importing psutil), so a job starts ~100 ms sooner. The same text
# defines shim_main in this module, so there is one copy of it.
SHIM_SOURCE = r"""
import json, os, signal, subprocess, sys, time


def _shim_write(path, obj, mode=0o644):
    tmp = f"{path}.tmp{os.getpid()}"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _shim_ctime(pid):
    # psutil's create_time on Linux (boot time + start ticks), without importing psutil
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        try:
            import psutil
            return psutil.Process(pid).create_time()
        except Exception:
            return None


def shim_main(path):
    # the agent may restart or its terminal may close; the job must not notice
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(os.path.join(path, "spec.json")) as f:
        ex = json.load(f)["exec"]
    logf = open(os.path.join(path, "log"), "ab", buffering=0)
    now_ms = lambda: int(time.time() * 1000)
    if os.path.exists(os.path.join(path, "cancel")):
        _shim_write(os.path.join(path, "exit"), {
            "exit_code": None, "signal": None, "ended_at": now_ms(),
            "message": "cancelled before start"})
        return 0
    try:
        proc = subprocess.Popen(ex["argv"], executable=ex["executable"], cwd=ex["cwd"],
                                env=ex["env"], stdin=subprocess.DEVNULL, stdout=logf,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                close_fds=True)
    except OSError as e:
        msg = f"cannot execute {ex['argv'][0]}: {e.strerror or e}"
        logf.write(f"gpuplane: {msg}\n".encode())
        _shim_write(os.path.join(path, "exit"), {
            "exit_code": None, "signal": None, "ended_at": now_ms(),
            "failure_kind": "DISPATCH_FAILED", "message": msg})
        return 1
    _shim_write(os.path.join(path, "pid"), {
        "pid": proc.pid, "create_time": _shim_ctime(proc.pid), "shim_pid": os.getpid(),
        "shim_create_time": _shim_ctime(os.getpid())})
    rc = proc.wait()
    logf.close()
    _shim_write(os.path.join(path, "exit"), {
        "exit_code": rc if rc >= 0 else None, "signal": -rc if rc < 0 else None,
        "ended_at": now_ms()})
    return 0
"""
_shim_ns = {}
exec(SHIM_SOURCE, _shim_ns)
shim_main = _shim_ns["shim_main"]
_shim_write = _shim_ns["_shim_write"]


def shim_command():
    """argv that runs the shim; the attempt dir is appended."""
    return [sys.executable, "-c", SHIM_SOURCE + "\nsys.exit(shim_main(sys.argv[1]))"]


# ---------------------------------------------------------------------------------------
# TensorBoard tailing: TBTailer (see docs/tensorboard.md)
# ---------------------------------------------------------------------------------------
# Reads the TFRecord framing itself so CRCs are checked in C (google-crc32c) instead of
# tensorboard's pure-Python loop; decodes with tensorboard's own protos.

# tensorboard's protos and a C CRC32C are imported on first use, so the shim (which
# imports this file) and hosts without TensorBoard jobs stay light.
event_pb2 = None
_crc32c = None
TB_CRC32C = None


def _tb_load():
    global event_pb2, _crc32c, TB_CRC32C
    if event_pb2 is None:
        from tensorboard.compat.proto import event_pb2 as pb
        event_pb2 = pb
    if _crc32c is None:
        try:
            # The C extension directly: the package's own pure-Python fallback is no
            # faster than tensorboard's and warns on import.
            from google_crc32c.cext import value as crc
            TB_CRC32C = "google-crc32c"
        except ImportError:
            from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c as crc
            TB_CRC32C = "python"
        _crc32c = crc


tb_log = logging.getLogger("gpuplane.agent.tb")

_TB_CHUNK = 4 << 20          # bytes read per system call
_TB_HUGE_RECORD = 16 << 20   # larger records (graphs, big images) are skipped unread: never scalars
_TB_HEADER = struct.Struct("<QI")
_TB_U32 = struct.Struct("<I")
_TB_F32 = struct.Struct("<f")
_TB_F64 = struct.Struct("<d")
_TB_SKIP_DIRS = {"__pycache__", "node_modules", "site-packages"}
# Directories that exist once per launch of the training script: torch's, tensorboardX's
# and HF Trainer's default `runs/Nov29_08-46-00_host`, Lightning's `version_3`. Keeping them
# in the metric key would give every launch new keys and break comparing runs.
_TB_LAUNCH_DIR = re.compile(r"^(?:[A-Z][a-z]{2}\d{2}_\d{2}-\d{2}-\d{2}_.+|version_\d+)$")
_DT_FLOAT, _DT_DOUBLE, _DT_INT32, _DT_INT64 = 1, 2, 3, 9


def tb_run_prefix(rel_dir):
    """Key prefix for event files in `rel_dir` (posix, relative to the watched root)."""
    parts = [p for p in rel_dir.split("/") if p not in ("", ".") and not _TB_LAUNCH_DIR.match(p)]
    return "/".join(parts) + "/" if parts else ""


def _tb_scalar(t):
    """The value of a numeric rank-0 (or one-element) TensorProto, else None."""
    for d in t.tensor_shape.dim:
        if d.size != 1:
            return None
    dtype = t.dtype
    if dtype == _DT_FLOAT:
        if t.float_val:
            return t.float_val[0]
        if len(t.tensor_content) == 4:
            return _TB_F32.unpack(t.tensor_content)[0]
    elif dtype == _DT_DOUBLE:
        if t.double_val:
            return t.double_val[0]
        if len(t.tensor_content) == 8:
            return _TB_F64.unpack(t.tensor_content)[0]
    elif dtype == _DT_INT32 and t.int_val:
        return float(t.int_val[0])
    elif dtype == _DT_INT64 and t.int64_val:
        return float(t.int64_val[0])
    # Everything else (half, bfloat16, unsigned, other encodings): let tensorboard decode it.
    from tensorboard.util import tensor_util
    try:
        arr = tensor_util.make_ndarray(t)
    except Exception:
        return None
    if arr.size != 1 or arr.dtype.kind not in "fiu":
        return None
    return float(arr.item())


class _TBFile:
    __slots__ = ("path", "rel", "prefix", "offset", "bad_header")

    def __init__(self, path, rel, offset):
        self.path = path
        self.rel = rel
        self.prefix = tb_run_prefix(rel.rpartition("/")[0])
        self.offset = offset
        self.bad_header = False   # stopped at a record whose length CRC failed


class TBTailer:
    """Follows every `*tfevents*` file under root_dir and returns new scalar points.

    poll() -> [(key, step, value, wall_time_ms)], each point once, in file order; about
    max_points at most (the rest comes with the next polls).
    offsets: {path relative to root_dir: end of the last record consumed}; pass it back
    after a restart to carry on exactly where the last poll stopped.
    """

    def __init__(self, root_dir, started_after_ts=None, offsets=None, *, rescan_s=3.0,
                 max_points=200_000):
        _tb_load()
        self.root = os.path.abspath(root_dir)
        self.started_after_ts = started_after_ts
        self.rescan_s = rescan_s
        # A long backlog (restart, or a big file from an earlier attempt of the same run) is
        # handed out over several polls rather than all in memory at once.
        self.max_points = max_points
        self._files = {}           # rel -> _TBFile
        self._resume = {str(k): int(v) for k, v in (offsets or {}).items()}
        self._plugins = {}         # (run prefix, tag) -> plugin name, from the first metadata seen
        self._warned = set()
        self._next_scan = 0.0
        self.corrupt_records = 0

    @property
    def offsets(self):
        out = dict(self._resume)   # files from before a restart that are not (yet) back
        out.update((rel, f.offset) for rel, f in self._files.items())
        return out

    def poll(self, rescan=False):
        """New points since the last poll; rescan=True walks the tree now (the job ended)."""
        now = time.monotonic()
        if rescan or now >= self._next_scan:
            self._scan()
            # A huge tree must not turn the agent into a full-time directory walker.
            # (rescan_s=0 means every poll, for tests.)
            took = time.monotonic() - now
            self._next_scan = now + took + max(self.rescan_s, 10 * took) if self.rescan_s else 0.0
        points = []
        for rel in sorted(self._files):
            if len(points) >= self.max_points:
                break
            f = self._files[rel]
            try:
                self._read(f, points)
            except FileNotFoundError:
                del self._files[rel]
            except OSError as e:
                self._warn_once(f.rel, "oserror", "cannot read %s: %s", f.path, e)
        return points

    def _warn_once(self, rel, kind, msg, *args):
        if (rel, kind) not in self._warned:
            self._warned.add((rel, kind))
            tb_log.warning(msg, *args)

    def _scan(self):
        stack = [self.root]
        while stack:
            d = stack.pop()
            try:
                it = os.scandir(d)
            except OSError:
                continue
            with it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            if not e.name.startswith(".") and e.name not in _TB_SKIP_DIRS:
                                stack.append(e.path)
                        elif "tfevents" in e.name and e.is_file():
                            self._consider(e)
                    except OSError:
                        continue

    def _consider(self, entry):
        rel = os.path.relpath(entry.path, self.root).replace(os.sep, "/")
        if rel in self._files:
            return
        if rel in self._resume:
            offset = self._resume.pop(rel)
        elif self.started_after_ts is not None and entry.stat().st_mtime < self.started_after_ts:
            return   # from an earlier launch; looked at again if it is ever written to
        else:
            offset = 0
        self._files[rel] = _TBFile(entry.path, rel, offset)

    def _read(self, f, points):
        size = os.stat(f.path).st_size
        if size < f.offset:
            tb_log.warning("%s shrank below %d bytes; reading it again from the start", f.path, f.offset)
            f.offset = 0
            f.bad_header = False
        if size == f.offset:
            return
        want = 12 if f.bad_header else _TB_CHUNK
        with open(f.path, "rb") as fh:
            while True:
                fh.seek(f.offset)
                buf = fh.read(want)
                consumed, need = self._parse(f, buf, points)
                f.offset += consumed
                if need > _TB_HUGE_RECORD:
                    if f.offset + need > size:
                        return   # wait until the writer has finished it
                    f.offset += need
                    continue
                if len(buf) < want or need == 0:
                    return   # end of file, or stopped at a bad length CRC
                if len(points) >= self.max_points:
                    return   # (checked per chunk: the per-record loop stays lean)
                want = max(_TB_CHUNK, need)

    def _parse(self, f, buf, points):
        """Consume the complete records in buf.

        Returns (bytes consumed, bytes needed from there for the next record; 0 to stop).
        """
        n = len(buf)
        pos = 0
        crc = _crc32c
        header = _TB_HEADER.unpack_from
        u32 = _TB_U32.unpack_from
        parse = event_pb2.Event.FromString
        prefix = f.prefix
        plugins = self._plugins
        append = points.append
        isfinite = math.isfinite
        while True:
            if pos + 12 > n:
                return pos, 12
            length, length_crc = header(buf, pos)
            c = crc(buf[pos:pos + 8])
            if (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF != length_crc:
                # The length can't be trusted, so the record boundaries are lost: stop here
                # (TensorBoard abandons the file too). Retried each poll in case we saw a
                # half-written header.
                if not f.bad_header:
                    f.bad_header = True
                    self._warn_once(f.rel, "length", "%s: bad length CRC at byte %d; not reading further",
                                    f.path, f.offset + pos)
                return pos, 0
            f.bad_header = False
            end = pos + 16 + length
            if end > n:
                return pos, 16 + length
            data = buf[pos + 12:end - 4]
            c = crc(data)
            if (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF != u32(buf, end - 4)[0]:
                if end == n:
                    # Nothing after it yet: may be a write still landing. Decide once the
                    # writer has moved on.
                    return pos, 17 + length
                self.corrupt_records += 1
                self._warn_once(f.rel, "data", "%s: bad data CRC at byte %d; skipping the record",
                                f.path, f.offset + pos)
                pos = end
                continue
            pos = end
            try:
                ev = parse(data)
            except Exception:
                self.corrupt_records += 1
                self._warn_once(f.rel, "proto", "%s: undecodable event at byte %d; skipping it",
                                f.path, f.offset + pos)
                continue
            values = ev.summary.value
            if not values:
                continue   # file_version, graph, session_log, ...
            wall_time = ev.wall_time
            if not isfinite(wall_time):
                # TensorBoard drops these too; int() of it would raise.
                self._warn_once(f.rel, "time", "%s: event with wall_time %s at byte %d; skipping it",
                                f.path, wall_time, f.offset + pos)
                continue
            step = ev.step
            ms = int(wall_time * 1000)
            for v in values:
                if v.HasField("simple_value"):
                    append((prefix + v.tag, step, v.simple_value, ms))
                elif v.HasField("tensor"):
                    # TF2 writes the plugin metadata only with a tag's first value.
                    key = (prefix, v.tag)
                    if v.HasField("metadata"):
                        plugins[key] = v.metadata.plugin_data.plugin_name
                    plugin = plugins.get(key)
                    if plugin is not None and plugin != "scalars":
                        continue
                    value = _tb_scalar(v.tensor)
                    if value is not None:
                        append((prefix + v.tag, step, value, ms))


# ---------------------------------------------------------------------------------------
# node stats: NVML (or fake GPUs) + psutil, as node_stats and per-run system metrics
# ---------------------------------------------------------------------------------------

class GpuProbe:
    FAKE_MEM_MB = 24576

    def __init__(self, fake_gpus=0):
        self.fake = int(fake_gpus)
        self.nvml = None
        self.handles = []
        if self.fake:
            return
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                            for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as e:     # no driver, no library, or a broken install
            self.nvml = None
            log.warning("no NVIDIA driver found (%s); reporting host metrics only; "
                        "use --fake-gpus N to test scheduling", e)

    def facts(self):
        if self.fake:
            return [{"index": i, "name": f"Fake GPU {i}", "memory_total_mb": self.FAKE_MEM_MB,
                     "uuid": f"FAKE-{socket.gethostname()}-{i}", "fake": True}
                    for i in range(self.fake)]
        out = []
        for i, h in enumerate(self.handles):
            name = self._try(self.nvml.nvmlDeviceGetName, h) or f"GPU {i}"
            if isinstance(name, bytes):
                name = name.decode()
            uuid = self._try(self.nvml.nvmlDeviceGetUUID, h)
            if isinstance(uuid, bytes):
                uuid = uuid.decode()
            mem = self._try(self.nvml.nvmlDeviceGetMemoryInfo, h)
            out.append({"index": i, "name": name, "uuid": uuid, "fake": False,
                        "memory_total_mb": int(mem.total / 2**20) if mem else None})
        return out

    def sample(self, busy=()):
        if self.fake:
            out = []
            for i in range(self.fake):
                held = i in busy
                util = random.uniform(75, 98) if held else random.uniform(0, 3)
                out.append({"index": i, "util": round(util, 1),
                            "mem_used_mb": int(self.FAKE_MEM_MB *
                                               (random.uniform(0.55, 0.8) if held else 0.012)),
                            "mem_total_mb": self.FAKE_MEM_MB,
                            "temp_c": round(35 + util * 0.4 + random.uniform(-1, 1), 1),
                            "power_w": round(30 + util * 2.5, 1), "fake": True})
            return out
        out = []
        for i, h in enumerate(self.handles):
            util = self._try(self.nvml.nvmlDeviceGetUtilizationRates, h)
            mem = self._try(self.nvml.nvmlDeviceGetMemoryInfo, h)
            temp = self._try(self.nvml.nvmlDeviceGetTemperature, h,
                             getattr(self.nvml, "NVML_TEMPERATURE_GPU", 0))
            power = self._try(self.nvml.nvmlDeviceGetPowerUsage, h)
            out.append({"index": i, "util": util.gpu if util else None,
                        "mem_used_mb": int(mem.used / 2**20) if mem else None,
                        "mem_total_mb": int(mem.total / 2**20) if mem else None,
                        "temp_c": temp, "power_w": power / 1000.0 if power else None,
                        "fake": False})
        return out

    def _try(self, fn, *args):
        try:
            return fn(*args)
        except Exception:          # NVMLError_NotSupported and friends: leave it out
            return None


class StatsReporter(Worker):
    name = "gpuplane-agent-stats"

    def __init__(self, outbox, runner, probe, home, interval=10.0):
        super().__init__()
        self.outbox, self.runner, self.probe, self.home = outbox, runner, probe, home
        self.interval = interval
        self._procs = {}          # pid -> psutil.Process, so cpu_percent measures intervals
        psutil.cpu_percent(None)

    def tick(self):
        ts = now_ms()
        gpus = self.probe.sample(self.runner.busy_gpus())
        vm = psutil.virtual_memory()
        try:
            disk_free = shutil.disk_usage(self.home).free // 2**20
        except OSError:
            disk_free = None
        host = {"cpu": psutil.cpu_percent(None), "mem_used_mb": (vm.total - vm.available) // 2**20,
                "mem_total_mb": vm.total // 2**20, "disk_free_mb": disk_free}
        self.outbox.append("node_stats", {"ts": ts, "gpus": gpus, "host": host})
        by_index = {g["index"]: g for g in gpus}
        step = ts // 1000     # time-based, so an agent restart never reuses a step
        seen = set()
        for att, pid in self.runner.running():
            if att.run_id is None:
                continue
            points = []
            cpu, rss = self._tree_usage(pid, seen)
            points.append(["sys/cpu_percent", step, cpu, ts])
            points.append(["sys/rss_mb", step, rss, ts])
            try:     # a full disk kills checkpoints: watch the job's own filesystem
                free = shutil.disk_usage(att.working_dir).free / 2**20
                points.append(["sys/disk_free_mb", step, round(free, 1), ts])
            except (OSError, TypeError):
                pass
            for g in att.gpus:
                s = by_index.get(g)
                if not s:
                    continue
                for k in ("util", "mem_used_mb", "temp_c", "power_w"):
                    if s.get(k) is not None:
                        points.append([f"sys/gpu{g}/{k}", step, float(s[k]), ts])
            self.outbox.append("metrics", {"ts": ts, "run_id": att.run_id,
                                           "source": "system", "points": points})
        for pid in list(self._procs):
            if pid not in seen:
                del self._procs[pid]

    def _tree_usage(self, pid, seen):
        try:
            root = psutil.Process(pid)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return 0.0, 0.0
        cpu = rss = 0.0
        for p in procs:
            cached = self._procs.get(p.pid)
            if cached is None or not cached.is_running():
                cached = self._procs[p.pid] = p
            seen.add(p.pid)
            try:
                with cached.oneshot():
                    cpu += cached.cpu_percent(None)
                    rss += cached.memory_info().rss / 2**20
            except psutil.NoSuchProcess:
                pass
        return round(cpu, 1), round(rss, 1)


# ---------------------------------------------------------------------------------------
# connection: the one WebSocket to the server
# ---------------------------------------------------------------------------------------

def ws_url(server):
    server = server.rstrip("/")
    for http, ws in (("https://", "wss://"), ("http://", "ws://")):
        if server.startswith(http):
            server = ws + server[len(http):]
    if not server.startswith(("ws://", "wss://")):
        server = "ws://" + server
    if not server.endswith("/api/v1/agent/ws"):
        server += "/api/v1/agent/ws"
    return server


class Connection:
    name = "gpuplane-agent-connection"

    def __init__(self, config, outbox, runner, probe, ack_timeout_s=ACK_TIMEOUT_S):
        self.config, self.outbox, self.runner, self.probe = config, outbox, runner, probe
        self.url = ws_url(config.server)
        self.heartbeat_s = config.heartbeat_s
        self.ack_timeout_s = ack_timeout_s
        self._stop = threading.Event()
        self._thread = None
        self._ws = None
        self.connected = threading.Event()   # set while a session is welcomed
        self.synced = threading.Event()      # set once sync went out on this session

    def start(self):
        self._thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self._thread.start()

    def run(self):
        delay = 0.5
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self._session()
            except Exception as e:
                if not self._stop.is_set():
                    self._log_failure(e)
            finally:
                self.connected.clear()
                self.synced.clear()
                self._close()
            if self._stop.is_set():
                break
            if time.monotonic() - began > 30:
                delay = 0.5
            self._stop.wait(delay * random.uniform(0.5, 1.0) + random.uniform(0, 0.25))
            delay = min(delay * 2, 15.0)

    def _log_failure(self, e):
        from simple_websocket import ConnectionClosed
        if isinstance(e, ConnectionClosed):
            if e.reason == 4401:
                log.error("server %s refused the agent token (%s); check --token",
                          self.config.server, e.message)
            else:
                log.warning("connection closed by server: %s %s", e.reason, e.message or "")
        elif isinstance(e, ConnectionError) and e.args and e.args[0] in (401, 403):
            log.error("server %s refused the agent token (HTTP %s); check --token",
                      self.config.server, e.args[0])
        elif isinstance(e, (OSError, ConnectionError)):
            log.warning("cannot reach %s: %s", self.url, e)
        else:
            log.exception("connection failed")

    def _close(self):
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                ws.close()
            except Exception:
                pass

    def _send(self, obj):
        self._ws.send(obj if isinstance(obj, str) else json.dumps(obj))

    def _receive(self, timeout):
        raw = self._ws.receive(timeout=timeout)
        if raw is None:
            return None
        try:
            msg = json.loads(raw)
        except ValueError:
            log.warning("ignoring a non-JSON frame from the server")
            return None
        return msg if isinstance(msg, dict) else None

    def _session(self):
        from simple_websocket import Client
        self._ws = Client.connect(self.url, headers={
            "Authorization": f"Bearer {self.config.token}"})
        if self._stop.is_set():
            return
        self._send({"type": "hello", "node": self.config.name, "epoch": self.outbox.epoch,
                    "version": VERSION, "hostname": socket.gethostname(),
                    "cpu_slots": self.config.cpu_slots, "fake": self.probe.fake > 0,
                    "gpus": self.probe.facts()})
        deadline = time.monotonic() + self.ack_timeout_s
        welcome = None
        while welcome is None:
            if time.monotonic() > deadline or self._stop.is_set():
                log.warning("no welcome from the server within %.0f s", self.ack_timeout_s)
                return
            msg = self._receive(0.5)
            if msg and msg.get("type") == "welcome":
                welcome = msg
        cursor = int(welcome.get("cursor", 0))
        if welcome.get("heartbeat_s"):
            self.heartbeat_s = float(welcome["heartbeat_s"])
        with self.outbox.lock:
            if cursor > self.outbox.last_seq or cursor < self.outbox.acked:
                # the server's cursor does not fit what we hold: renumber and say hello again
                self.outbox.restart_epoch(f"server cursor {cursor} outside acked "
                                          f"{self.outbox.acked}..{self.outbox.last_seq}")
                return
            self.outbox.ack(cursor)
        log.info("connected to %s as %s (cursor %d, %d to send)", self.url,
                 self.config.name, cursor, self.outbox.last_seq - cursor)
        self.connected.set()
        backlog = self.outbox.last_seq
        sent_upto, inflight, inflight_deadline = cursor, None, 0.0
        next_heartbeat = time.monotonic() + self.heartbeat_s
        # A server that answers heartbeats is expected to keep answering: silence for
        # three of them means the path is dead (no FIN or RST ever comes), so reconnect.
        last_heard, answers_heartbeats = time.monotonic(), False
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_heartbeat:
                self._send({"type": "heartbeat", "ts": now_ms()})
                next_heartbeat = now + self.heartbeat_s
            if answers_heartbeats and now - last_heard > 3 * self.heartbeat_s:
                log.warning("nothing from the server for %.0f s; reconnecting",
                            now - last_heard)
                return
            if inflight is None:
                if not self.synced.is_set():
                    self._maybe_sync(backlog)
                items = self.outbox.pending_after(sent_upto)
                if items:
                    self._send(self.outbox.batch_message(items))
                    inflight, sent_upto = items[-1][0], items[-1][0]
                    inflight_deadline = now + self.ack_timeout_s
            elif now > inflight_deadline:
                log.warning("no ack for seq %d within %.0f s; reconnecting", inflight,
                            self.ack_timeout_s)
                return
            more = inflight is None and self.outbox.last_seq > sent_upto
            # Short waits: new outbox records (an exit, log lines) go out within ~50 ms.
            msg = self._receive(0.02 if more else 0.05)
            if msg is None:
                if not self._ws.connected:
                    return
                continue
            last_heard = time.monotonic()
            kind = msg.get("type")
            if kind == "heartbeat":
                answers_heartbeats = True
            elif kind == "ack":
                self.outbox.ack(msg.get("seq", 0))
                if inflight is not None and int(msg.get("seq", 0)) >= inflight:
                    inflight = None
            elif kind == "resend":
                start = int(msg.get("from", 1))
                if start - 1 < self.outbox.acked:
                    self.outbox.restart_epoch(f"server asked to resend from {start}, "
                                              f"below acked {self.outbox.acked}")
                    return
                sent_upto, inflight = start - 1, None
            elif kind == "start":
                self._command(self.runner.handle_start, msg)
            elif kind == "cancel":
                self._command(self.runner.handle_cancel, msg)
            elif kind == "welcome":
                pass
            else:
                log.debug("ignoring server message of type %r", kind)

    def _maybe_sync(self, backlog):
        # Wait for the backlog of this connection and every job record to be acked; newer
        # log/metric records need not hold it up. Snapshot first, then check: an attempt
        # that ended in between is still listed as running (harmless), never missing with
        # its EXITED unacked.
        msg = self.runner.sync_message()
        if self.outbox.acked >= max(backlog, self.outbox.last_job_seq):
            self._send(msg)
            self.synced.set()
            log.info("sync sent: %d running, %d known", len(msg["running"]),
                     len(msg["known"]))

    def _command(self, fn, msg):
        try:
            fn(msg)
        except Exception:
            log.exception("command %s for job %s attempt %s failed", msg.get("type"),
                          msg.get("job_id"), msg.get("attempt"))

    def stop(self, timeout=10.0):
        self._stop.set()
        self._close()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("thread %s did not exit within %.0f s", self._thread.name, timeout)


# ---------------------------------------------------------------------------------------
# agent + main
# ---------------------------------------------------------------------------------------

class Agent:
    def __init__(self, config, kill_grace_s=KILL_GRACE_S):
        self.config = config
        os.makedirs(config.agent_dir, exist_ok=True)
        self.outbox = Outbox(config.agent_dir)
        http = config.server
        if http.startswith(("ws://", "wss://")):
            http = "http" + http[2:]
        self.runner = Runner(config.agent_dir, self.outbox, kill_grace_s=kill_grace_s,
                             server_url=http.rstrip("/"))
        self.probe = GpuProbe(config.fake_gpus)
        self.stats = StatsReporter(self.outbox, self.runner, self.probe, config.home,
                                   interval=config.stats_interval_s)
        self.connection = Connection(config, self.outbox, self.runner, self.probe)

    def start(self):
        self.runner.start()
        self.stats.start()
        self.connection.start()

    def stop(self):
        # jobs keep running: they belong to their shims, not to us
        self.connection.stop()
        self.stats.stop()
        self.runner.stop()
        self.outbox.close()


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_shim"]:
        if len(argv) != 2:
            print("usage: agent.py _shim DIR", file=sys.stderr)
            return 2
        return shim_main(argv[1])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    try:
        config = load_config(args)
    except ConfigError as e:
        print(f"gpuplane-agent: {e}", file=sys.stderr)
        return 2
    stopping = []

    def on_signal(signum, _frame):
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agent = Agent(config)
    log.info("agent %s starting; home %s; server %s", config.name, config.home,
             config.server)
    agent.start()
    idle = threading.Event()
    while not stopping:
        idle.wait(0.5)
    log.info("stopping (signal %d); running jobs keep running", stopping[0])
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
