"""GPUPlane agent: runs jobs on one GPU host and reports everything to the server.

One file on purpose: copy it to a GPU box, put `server` and `token` in
$GPUCTL_HOME/agent.toml (or GPUCTL_SERVER / GPUCTL_TOKEN in the environment) and run
`python agent.py`. It speaks only the wire protocol in docs/protocol.md and imports nothing
of the server.

Contents (the section headers below, in order):

    settings: every tunable, in one place
    config: flags, the environment and agent.toml
    small helpers and the thread shape (Worker)
    outbox: one ordered, spooled, per-node sequence of records
    attempts: a job's files, environment, command, exit and log lines
    launchers: one interface; a process starts through the shim, its tree is stopped
    containers: a job with an image runs under the same shim as `docker run` (docs/docker.md)
    Slurm: `--runner slurm` hands every start to sbatch (docs/slurm.md)
    hooks of a running attempt: log tail, TensorBoard, checkpoints
    runner: start, watch, cancel and re-adopt job attempts
    the shim: its own session, outlives the agent
    TensorBoard tailing: TBTailer (see docs/tensorboard.md)
    node stats: NVML (or fake GPUs) + psutil, as node_stats and per-run system metrics
    connection: the one WebSocket to the server
    agent + main
    backup of an agent host: `gpuplane-agent backup FILE` (docs/operations.md)

Threads and processes:

    who                   owns                             woken by                 stops
    main thread           the signal flags (main)          SIGTERM/SIGINT, through  after Agent.stop()
                                                           a wakeup fd
    runner (Runner)       every Attempt and all file work: a command, a waiter, an  stop(): flag + wake,
                          launch, tail, TensorBoard,       ack, or its next due     join; then the shim's
                          checkpoints, retention           attempt                  socket is closed
    stats (StatsReporter) node_stats and per-run system    every stats_interval_s   stop(): flag + wake,
                          metrics into the outbox                                   join
    connection            the WebSocket; its sessions;     a session's end, then    stop(): flag + wake,
      (Connection)        the sender of batches            the reconnect backoff;   socket closed, join
                                                           in a session: an
                                                           append, an ack, a resend
    waiter, one per       Attempt.started and .shim_gone;  a line or EOF on the     EOF: the shim wrote
      launched attempt    wakes the runner                 job's pipe from the shim `exit`, or died
    reader, one per       applies the server's acks,       a frame from the server  its session ends
      session             resends, starts and cancels
    heartbeat, one per    the heartbeat timer; a silent    every heartbeat_s        its session ends
      session             server ends the session
    shim (a process:      starts every job (posix_spawn),  a request on its socket, EOF on its socket
      shim_server)        waits for it, writes `pid` and   SIGCHLD (a wakeup fd)    (the agent went) and
                          `exit`; outlives the agent                                no job left
    job processes         the user's command, in its own   -                        exit; a cancel: SIGTERM
                          session, output to its log                                to the group, SIGKILL
    sbatch submitters,    (--runner slurm) one sbatch (a   a start or a due poll    stop(): the runner's
      four (Slurm-        start) or squeue (a poll) at a   queued by the runner     close() after its join
      Launcher)           time; answers go to the runner
    Slurm batch jobs      (--runner slurm) the command on  - (a submitter's squeue  Slurm's end; a cancel:
                          a compute node, under slurmd;    poll, one call for all)  scancel TERM, KILL
                          scancel runs on the runner

Runner, stats and connection are Workers (one shape: start(), run() ticks, stop()); the
waiters, readers and heartbeats are plain threads that end with what they serve.
"""
import argparse
import array
import collections
import errno
import json
import inspect
import logging
import marshal
import math
import os
import random
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

import psutil

VERSION = "0.1.0"
log = logging.getLogger("gpuplane.agent")


# ---------------------------------------------------------------------------------------
# settings: every tunable, in one place
# ---------------------------------------------------------------------------------------
# What a user sets (flags, agent.toml) has its default here and is checked by Config;
# the rest is fixed for the file (tests shrink some of them).

# agent.toml and command-line defaults (Config)
DEFAULT_CPU_SLOTS = 4
DEFAULT_SLURM_MAX_JOBS = 16       # --runner slurm: jobs it may have in Slurm at once
DEFAULT_HEARTBEAT_S = 5.0
DEFAULT_STATS_INTERVAL_S = 10.0
DEFAULT_RETENTION_DAYS = 14.0     # a reported attempt's files are kept this long
DEFAULT_BACKLOG_MB = 32.0         # per attempt: unacked log + metric bytes in the spool

# outbox and connection
BATCH_MAX_RECORDS = 500
BATCH_MAX_BYTES = 1024 * 1024
COMPACT_BYTES = 8 * 1024 * 1024   # acked bytes at the spool's head worth a rewrite ...
COMPACT_MIN_RECORDS = 1000        # ... or acked lines there
RUNNING_HOLD_S = 0.1              # a RUNNING record waits this long for company (Outbox.hold)
ACK_TIMEOUT_S = 15.0              # a batch unacked this long: reconnect (and the welcome wait)
HEARTBEAT_MISSES = 3              # heartbeats the server leaves unanswered: the path is dead
RECONNECT_MIN_S = 0.5             # reconnect backoff: from here, doubled up to ...
RECONNECT_MAX_S = 15.0
RECONNECT_RESET_S = 30.0          # ... a session that lasted this long starts it afresh

# launching and stopping jobs
KILL_GRACE_S = 5.0                # SIGTERM, then SIGKILL after this
LAUNCH_GRACE_S = 10.0             # a half-made attempt dir younger than this may still launch
SHIM_REPLY_TIMEOUT_S = 10.0       # the shim answers a launch with the job's pid
SHIM_RECORD_MAX = 64 * 1024       # a bigger exec record goes through spec.json
CONTAINER_SDK_DIR = "/opt/gpuctl-sdk"   # where a container job finds the SDK

# the runner's timing
LOG_POLL_MIN_S = 0.05             # a busy log is read this often ...
LOG_POLL_MAX_S = 1.0              # ... a quiet one backs off to this
ADOPTED_CHECK_S = 1.0             # liveness of jobs we did not launch (no waiter): polled
IDLE_WAKE_S = 30.0                # nothing running: wake this often anyway (retention, ...)
HOOK_INTERVAL_S = 2.0             # TensorBoard and checkpoint looks at a running attempt
FIRST_HOOK_S = 0.5                # ... the first after its start (a job that ends sooner
                                  # is looked at once, at its end)
RETENTION_CHECK_S = 3600.0        # old attempts' files are looked for this often
RECHECK_S = 0.1                   # an attempt inside a cancel's grace or a drain: looked at again
BACKLOG_WAIT_S = 0.5              # an ended attempt waits this long for acks, then looks again
RUNNER_ERROR_WAIT_S = 1.0         # after a failed tick or a failed look at an attempt

# log lines
LINE_MAX = 16 * 1024              # longer log lines are cut here
LOG_READ_BYTES = 4 * 1024 * 1024  # read from one log in one look
LOG_RECORD_LINES = 1000           # lines ...
LOG_RECORD_BYTES = 256 * 1024     # ... or bytes in one `log` record
BACKLOG_MAX_BYTES = int(DEFAULT_BACKLOG_MB * 2**20)
OOM_TAIL_BYTES = 64 * 1024        # the end of a log searched for an out-of-memory error

# TensorBoard tailing
TB_RESCAN_S = 3.0                 # the tree is walked for new event files this often
TB_MAX_POINTS = 200_000           # points one poll hands out at most
TB_RECORD_POINTS = 5000           # points in one `metrics` record
_TB_CHUNK = 4 << 20               # bytes read per system call
_TB_HUGE_RECORD = 16 << 20        # larger records (graphs, big images) are skipped unread
TB_MAX_DEPTH = 8                  # levels below the TensorBoard dir walked for event files
TB_MAX_ENTRIES = 20_000           # directory entries looked at per walk
TB_MAX_KEY_CHARS = 512            # a longer tag is refused by the server; not sent
TB_UNDECIDED_S = 30.0             # an event file nobody knows the writer of: warned after
AGENT_HOME = None                 # set at start: the home is never walked for a job

# whose file is it (Writers)
WRITERS_SLACK_S = 1.0             # timestamps' coarseness (tensorboardX names: whole s)
MTIME_SLACK_S = 0.01              # a file's mtime lags the clock by a tick (4 ms at 250 Hz)
WRITERS_FRESH_S = 1.0             # a tree / open-file sample is redone after this long
WRITERS_MAX_FDS = 4096            # open files looked at per process

# checkpoints
CKPT_INTERVAL_S = 5.0
CKPT_MAX_DEPTH = 4                # levels below the watch dir
CKPT_MAX_ENTRIES = 20_000         # directory entries looked at per scan
CKPT_DIR_MAX_ENTRIES = 2_000      # entries summed for one checkpoint directory

# Slurm (--runner slurm)
SLURM_POLL_MIN_S = 0.25           # squeue this soon after a submit, a cancel or a change ...
SLURM_POLL_MAX_S = 5.0            # ... backing off to this while nothing changes
SLURM_TIMEOUT_S = 30.0            # one Slurm command
SLURM_SUBMITTERS = 4              # sbatch (and squeue) calls at once
SLURM_REASON_S = 2.0              # a PENDING reason is reported at most this often

FAKE_GPU_MEM_MB = 24576           # the memory of a fake GPU (--fake-gpus)

SDK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sdk")

OOM_PATTERNS = re.compile(
    r"CUDA out of memory|CUDA error: out of memory|OutOfMemoryError"
    r"|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|CUDNN_STATUS_NOT_ENOUGH_WORKSPACE"
    r"|RESOURCE_EXHAUSTED[^\n]*[Oo]ut of memory")


# ---------------------------------------------------------------------------------------
# config: flags, the environment and agent.toml
# ---------------------------------------------------------------------------------------

class ConfigError(Exception):
    pass


def _number(key, value, kind, minimum):
    """A setting as a number of `kind` at least `minimum`, or ConfigError naming it."""
    try:
        if isinstance(value, bool):
            raise ValueError
        out = kind(value)
        if out < minimum:
            raise ValueError
        return out
    except (TypeError, ValueError):
        what = "a whole number" if kind is int else "a number"
        raise ConfigError(f"{key} = {value!r} is not {what} >= {minimum:g}; fix it in "
                          "agent.toml or on the command line") from None


class Config:
    def __init__(self, server, token, name, home, fake_gpus=0, cpu_slots=DEFAULT_CPU_SLOTS,
                 heartbeat_s=DEFAULT_HEARTBEAT_S, stats_interval_s=DEFAULT_STATS_INTERVAL_S,
                 job_retention_days=DEFAULT_RETENTION_DAYS, backlog_mb=DEFAULT_BACKLOG_MB,
                 default_image=None, docker_args=(), docker="docker",
                 runner="process", slurm_partition=None, slurm_account=None, slurm_qos=None,
                 slurm_time_limit=None, sbatch_args=(), slurm_max_jobs=DEFAULT_SLURM_MAX_JOBS,
                 run_as=None):
        self.server = server
        self.token = token
        self.name = name
        self.home = home
        self.fake_gpus = _number("fake_gpus", fake_gpus, int, 0)
        self.cpu_slots = _number("cpu_slots", cpu_slots, int, 0)
        self.heartbeat_s = _number("heartbeat_s", heartbeat_s, float, 0.05)
        self.stats_interval_s = _number("stats_interval_s", stats_interval_s, float, 0.1)
        self.job_retention_days = _number("job_retention_days", job_retention_days, float, 0)
        self.backlog_mb = _number("backlog_mb", backlog_mb, float, 1)
        self.default_image = default_image or None
        if isinstance(docker_args, str) or not all(isinstance(a, str) for a in docker_args):
            raise ConfigError("docker_args must be a list of strings, e.g. "
                              '["--memory=32g", "--shm-size=8g"]')
        self.docker_args = list(docker_args)
        self.docker = str(docker)
        # the Slurm runner (docs/slurm.md)
        if runner not in ("process", "slurm"):
            raise ConfigError(f"runner = {runner!r}: use \"process\" (jobs run on this host) "
                              "or \"slurm\" (jobs go to Slurm with sbatch)")
        self.runner = runner
        self.slurm_partition = slurm_partition or None
        self.slurm_account = slurm_account or None
        self.slurm_qos = slurm_qos or None
        if slurm_time_limit is not None and not re.fullmatch(
                r"\d+|\d+:\d{2}(:\d{2})?|\d+-\d+(:\d{2}){0,2}", str(slurm_time_limit)):
            raise ConfigError(f"slurm_time_limit = {slurm_time_limit!r} is not a Slurm time "
                              "limit: minutes (60), H:MM:SS or D-HH (as sbatch --time takes)")
        self.slurm_time_limit = str(slurm_time_limit) if slurm_time_limit else None
        if isinstance(sbatch_args, str) or not all(isinstance(a, str) for a in sbatch_args):
            raise ConfigError("sbatch_args must be a list of strings, e.g. "
                              '["--constraint=a100", "--exclusive"]')
        self.sbatch_args = list(sbatch_args)
        self.slurm_max_jobs = _number("slurm_max_jobs", slurm_max_jobs, int, 1)
        self.run_as = run_as_user(run_as) if run_as else None

    @property
    def agent_dir(self):
        return os.path.join(self.home, "agent")


def run_as_user(name):
    """(name, uid, gid, home, setpriv) of the Unix user `run_as` names, or ConfigError: jobs
    run as that user, so they cannot read the agent's home (its token, spool, other
    attempts' start records) nor each other's files if each trust domain has its own user
    (docs/security.md). The agent must be root to switch users."""
    import pwd
    try:
        pw = pwd.getpwnam(str(name))
    except KeyError:
        raise ConfigError(f"run_as = {name!r}: no such user on this host; create it "
                          "(useradd --system --create-home NAME) or fix the name") from None
    if pw.pw_uid == 0:
        raise ConfigError("run_as names root; name an unprivileged user")
    if os.geteuid() != 0:
        raise ConfigError(f"run_as = {name!r} needs the agent to run as root (it switches "
                          "each job to that user); run the agent as root, or drop run_as")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise ConfigError("run_as needs setpriv (util-linux) on PATH")
    return (pw.pw_name, pw.pw_uid, pw.pw_gid, pw.pw_dir, setpriv)


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
    p.add_argument("--default-image", metavar="IMG",
                   help="run every job without its own --image in a container of IMG")
    p.add_argument("--docker-arg", action="append", metavar="ARG", dest="docker_args",
                   help="extra `docker run` option for every container job, e.g. "
                        "--docker-arg=--memory=32g (repeatable)")
    p.add_argument("--runner", choices=("process", "slurm"),
                   help="process: run jobs on this host (default); slurm: submit them to "
                        "Slurm with sbatch, from a login node (docs/slurm.md)")
    p.add_argument("--slurm-partition", metavar="P", help="Slurm partition (default: Slurm's)")
    p.add_argument("--slurm-account", metavar="A", help="Slurm account to charge")
    p.add_argument("--slurm-qos", metavar="Q", help="Slurm QoS")
    p.add_argument("--slurm-time", metavar="T", dest="slurm_time_limit",
                   help="time limit of a job that sets none (minutes, or H:MM:SS)")
    p.add_argument("--sbatch-arg", action="append", metavar="ARG", dest="sbatch_args",
                   help="extra sbatch option for every job, e.g. --sbatch-arg=--constraint=a100 "
                        "(repeatable)")
    p.add_argument("--slurm-max-jobs", type=int, metavar="N",
                   help="jobs this agent may have in Slurm at once, pending or running "
                        f"(default {DEFAULT_SLURM_MAX_JOBS}): the node's slots")
    p.add_argument("--run-as", metavar="USER",
                   help="run every job as this Unix user (the agent runs as root), so jobs "
                        "cannot read the agent's token, spool or other jobs' start records "
                        "(docs/security.md)")
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
                  cpu_slots=pick(args.cpu_slots, "cpu_slots", DEFAULT_CPU_SLOTS),
                  heartbeat_s=pick(args.heartbeat, "heartbeat_s", DEFAULT_HEARTBEAT_S),
                  stats_interval_s=pick(args.stats_interval, "stats_interval_s",
                                        DEFAULT_STATS_INTERVAL_S),
                  job_retention_days=toml.get("job_retention_days", DEFAULT_RETENTION_DAYS),
                  backlog_mb=toml.get("backlog_mb", DEFAULT_BACKLOG_MB),
                  default_image=pick(args.default_image, "default_image"),
                  docker_args=pick(args.docker_args, "docker_args", []),
                  docker=toml.get("docker", "docker"),
                  runner=pick(args.runner, "runner", "process"),
                  slurm_partition=pick(args.slurm_partition, "slurm_partition"),
                  slurm_account=pick(args.slurm_account, "slurm_account"),
                  slurm_qos=pick(args.slurm_qos, "slurm_qos"),
                  slurm_time_limit=pick(args.slurm_time_limit, "slurm_time_limit"),
                  sbatch_args=pick(args.sbatch_args, "sbatch_args", []),
                  slurm_max_jobs=pick(args.slurm_max_jobs, "slurm_max_jobs",
                                      DEFAULT_SLURM_MAX_JOBS),
                  run_as=pick(getattr(args, "run_as", None), "run_as"))


# ---------------------------------------------------------------------------------------
# small helpers and the thread shape (Worker)
# ---------------------------------------------------------------------------------------

def now_ms():
    return int(time.time() * 1000)


def write_json_atomic(path, obj, private=True, sync=True):
    """tmp file, fsync (unless `sync` is False), rename: the shim's _shim_write (the shim
    needs it too). Every file under the agent's home is private to its user."""
    _shim_write(path, json.dumps(obj), 0o600, sync)


def _private_opener(path, flags):
    return os.open(path, flags, 0o600)


def make_private_dirs(path):
    """makedirs with mode 0700, and tighten it if it already existed."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    try:
        if os.stat(path).st_mode & 0o077:
            os.chmod(path, 0o700)
    except OSError:
        pass


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
    """The agent's thread shape (runner, stats, connection): start() runs a thread that
    waits `begin()` seconds, then calls tick() until stop(), waiting between ticks for
    the seconds tick() returns (None: `interval`; after an exception: `interval` too),
    or less when wake() or stop() is called.

    stop() sets the flag, wakes the wait, calls `stopping()` (a subclass's way to end a
    tick that is blocked elsewhere: a socket, another event) and joins. (The server has a
    Worker of its own, in gpuplane/; the agent imports nothing of the server.)"""
    interval = 1.0
    name = "worker"

    def __init__(self):
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = None

    def start(self):
        self._thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self._thread.start()

    def begin(self):
        """On the thread, before the first tick. -> seconds to wait before it."""
        return self.interval

    def tick(self):
        """One round of work. -> seconds until the next, or None for `interval`."""
        raise NotImplementedError

    def run(self):
        timeout = self.begin()
        while True:
            if self._wake.wait(timeout):
                self._wake.clear()
            if self._stop.is_set():
                return
            try:
                timeout = self.tick()
            except Exception:
                log.exception("%s: tick failed", self.name)
                timeout = None
            if timeout is None:
                timeout = self.interval

    def wake(self):
        self._wake.set()

    def stopping(self):
        """Called by stop() after the flag is set and the wait woken (any thread)."""

    def stop(self, timeout=10.0):
        self._stop.set()
        self._wake.set()
        self.stopping()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("thread %s did not exit within %.0f s", self._thread.name, timeout)


# ---------------------------------------------------------------------------------------
# outbox: one ordered, spooled, per-node sequence of records
# ---------------------------------------------------------------------------------------
#
# Records are appended (flushed) to agent/spool/outbox.jsonl, and fsynced before they can
# be sent: the sender fsyncs once for every record appended since its last batch (a group
# commit), so no thread that reports waits on the disk, and the server never holds a
# record that a power cut could take from the spool. A record may carry a private `_att`
# field, {"key": "<job>/<attempt>", ...}, with the attempt's tail state after that record
# (log offset, line_no, TB offsets, reported flags); it is written last in the line and cut
# off for the wire. Because it is written in the same line as the data, the tail position
# and the data it produced can never disagree after a crash.
# agent/state.json holds epoch, next_seq, acked and a snapshot of all attempt states as of
# `snapshot_seq`; on start the spool records above snapshot_seq are folded on top of it.
# Memory holds only where each unacked record sits in the spool (three integers a record);
# batches are read back from the file, so a long outage costs disk, not memory.

def _spool_line(rec, att):
    """-> (line bytes, wire prefix length): the wire form is line[:n] + b"}"."""
    wire = json.dumps(rec, separators=(",", ":")).encode()
    if att:
        line = wire[:-1] + b',"_att":' + json.dumps(att, separators=(",", ":")).encode() + b"}\n"
    else:
        line = wire + b"\n"
    return line, len(wire) - 1


class Outbox:
    def __init__(self, agent_dir, compact_min=COMPACT_MIN_RECORDS):
        self.dir = agent_dir
        self.spool_dir = os.path.join(agent_dir, "spool")
        self.spool_path = os.path.join(self.spool_dir, "outbox.jsonl")
        self.state_path = os.path.join(agent_dir, "state.json")
        make_private_dirs(self.spool_dir)
        self.lock = threading.RLock()
        self.compact_min = compact_min
        self.epoch = None
        self.next_seq = 1
        self.acked = 0
        self.attempts = {}          # key -> tail/report state (see above)
        # where the unacked records (seq acked+1, acked+2, ...) sit in the spool
        self._offs = array.array("q")     # line start
        self._lens = array.array("q")     # line length
        self._cuts = array.array("q")     # wire prefix length
        self._spool = None
        self._reader = None
        self._dropped_lines = 0     # acked lines still in the spool file
        self._synced = 0            # bytes of the spool file known to be on disk
        self._file_no = 0           # which spool file that is (a rewrite makes another)
        self.last_job_seq = 0       # seq of the newest `job` record
        self._loaded_seq = 0        # the last seq the spool held at load; None once a
                                    # server's cursor was accepted (last_held_seq)
        self.listeners = []         # called (outside the lock) after each append
        self._holds = {}            # seq -> monotonic time until which it may wait (hold)
        self.ack_listeners = []     # called (outside the lock) after an ack moved `acked`
        self._load()

    # -- start-up ------------------------------------------------------------------------

    def _scan_spool(self, quiet=False):
        """Yield the spool's records in file order, skipping torn or unparseable lines."""
        try:
            f = open(self.spool_path, "rb")
        except FileNotFoundError:
            return
        with f:
            prev = None
            for i, line in enumerate(f, start=1):
                if prev is not None:
                    yield prev
                prev = None
                try:
                    rec = json.loads(line)
                    rec["seq"] = int(rec["seq"])
                    rec["kind"]
                    prev = rec
                except (ValueError, KeyError, TypeError):
                    if quiet:
                        continue
                    if not line.endswith(b"\n"):
                        log.warning("outbox: skipping a torn last line in %s (crash mid-write?)",
                                    self.spool_path)
                    else:
                        log.warning("outbox: skipping unparseable line %d in %s", i,
                                    self.spool_path)
            if prev is not None:
                yield prev

    def _load(self):
        state = read_json(self.state_path)
        spool_exists = os.path.exists(self.spool_path)
        snapshot = 0
        if state is not None:
            self.epoch = state["epoch"]
            self.acked = int(state.get("acked", 0))
            self.attempts = state.get("attempts", {})
            snapshot = int(state.get("snapshot_seq", 0))
        # one pass to learn the seqs and fold tail states; records stay on disk
        seqs, job_seqs, last = [], [], 0
        ordered = True
        for r in self._scan_spool():
            if (state is None or r["seq"] > snapshot) and "_att" in r:
                self._fold(r["_att"])
            if state is not None and r["seq"] <= self.acked:
                continue
            ordered = ordered and r["seq"] > last
            last = r["seq"]
            seqs.append(r["seq"])
            if r["kind"] == "job":
                job_seqs.append(r["seq"])
        renumber, keep_after = False, self.acked
        if state is None:
            self.epoch = None
            renumber = self._new_epoch("no state.json" if seqs else None, len(seqs))
        else:
            self.next_seq = max(int(state.get("next_seq", 1)), (seqs[-1] if seqs else 0) + 1)
            lost = not spool_exists and self.next_seq - 1 > self.acked
            contiguous = ordered and seqs == list(range(self.acked + 1, self.acked + 1 + len(seqs))) \
                and (not seqs or seqs[-1] == self.next_seq - 1)
            if lost or not contiguous:
                # The server would wait forever for the missing seqs: start over.
                renumber = self._new_epoch("spool lost" if lost else "gap in spool", len(seqs))
        self._rewrite(renumber=renumber, keep_after=keep_after)   # drops acked and torn lines, writes renumbered seqs
        self._loaded_seq = self.last_seq
        log.info("outbox: epoch %s, next seq %d, acked %d, %d pending",
                 self.epoch, self.next_seq, self.acked, len(self._offs))

    def _new_epoch(self, reason, pending):
        """Start a fresh epoch; pending records get renumbered from 1 by the next rewrite
        (the server resets its cursor to 0 for a new epoch; natural keys keep replays from
        doubling). -> True."""
        old = self.epoch
        self.epoch = os.urandom(8).hex()
        self.acked = 0
        self.next_seq = pending + 1
        if reason:
            log.warning("outbox: new epoch %s (was %s): %s; %d records renumbered",
                        self.epoch, old, reason, pending)
        return True

    def _fold(self, att):
        key = att.get("key")
        if key:
            st = self.attempts.setdefault(key, {})
            st.update({k: v for k, v in att.items() if k != "key"})

    # -- writing -------------------------------------------------------------------------

    def append(self, kind, fields, att=None, hold_s=0.0):
        """Spool one record (flushed; sync() makes it durable) and return its seq.
        hold_s: it may wait that long to go out with the next record (hold())."""
        with self.lock:
            rec = {"seq": self.next_seq, "kind": kind, "ts": fields.pop("ts", now_ms())}
            rec.update(fields)
            line, cut = _spool_line(rec, att)
            where = self._spool.tell()
            try:
                self._spool.write(line)
                self._spool.flush()
            except OSError:
                # e.g. disk full: never leave half a line for the next record to glue onto
                self._spool.truncate(where)
                self._spool.seek(0, os.SEEK_END)
                raise
            self.next_seq += 1
            self._offs.append(where)
            self._lens.append(len(line))
            self._cuts.append(cut)
            if kind == "job":
                self.last_job_seq = rec["seq"]
            if att:
                self._fold(att)
            seq = rec["seq"]
            if hold_s > 0:
                self._holds[seq] = time.monotonic() + hold_s
        for fn in self.listeners:
            fn()
        return seq

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

    def last_held_seq(self):
        """The last seq a server's cursor may reach. Until a first cursor is checked: the
        last one the spool held at load. state.json's `next_seq` is saved only when the
        spool is compacted, so a spool that lost its tail (cut, a disk error) hands out
        again seqs the server has already applied, from records now gone: a cursor past
        what was loaded says so, and the outbox starts a new epoch instead of sending new
        records under seqs the server would skip."""
        return self.last_seq if self._loaded_seq is None else self._loaded_seq

    def accept_cursor(self, cursor):
        """A server's cursor at its welcome: acked when it fits what the outbox holds
        (-> None), else why not (-> a sentence: the caller starts a new epoch)."""
        with self.lock:
            held = self.last_held_seq()
            if cursor > held or cursor < self.acked:
                return f"server cursor {cursor} outside acked {self.acked}..{held}"
            self.ack(cursor)
            self._loaded_seq = None
            return None

    def sync(self):
        """fsync what was appended since the last sync, outside the lock: one fsync for
        every record appended meanwhile, and appends go on while it runs."""
        with self.lock:
            end = self._spool.tell()
            if end <= self._synced:
                return
            fd, file_no = os.dup(self._spool.fileno()), self._file_no
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        with self.lock:
            if self._file_no == file_no:
                self._synced = max(self._synced, end)

    def pending_after(self, seq, max_records=BATCH_MAX_RECORDS, max_bytes=BATCH_MAX_BYTES):
        """Up to one batch of (seq, wire json) with seq > `seq`, in order: only records
        on disk (it syncs first), so nothing is sent that a power cut could take back."""
        self.sync()
        with self.lock:
            start = max(0, seq - self.acked)      # pending is contiguous from acked + 1
            end, size = start, 0
            while end < len(self._offs):
                if self._offs[end] + self._lens[end] > self._synced:
                    break                         # appended after the sync: next batch
                n = self._cuts[end] + 2
                if end > start and (end - start >= max_records or size + n > max_bytes):
                    break
                size += n
                end += 1
            if end == start:
                return []
            base = self._offs[start]
            self._reader.seek(base)
            data = self._reader.read(self._offs[end - 1] + self._lens[end - 1] - base)
            out = []
            for i in range(start, end):
                at = self._offs[i] - base
                out.append((self.acked + 1 + i,
                            data[at:at + self._cuts[i]].decode() + "}"))
            return out

    def unacked(self):
        """Every unacked record as the server will see it (for tests and debugging)."""
        out, seq = [], self.acked
        while True:
            items = self.pending_after(seq)
            if not items:
                return out
            out.extend(json.loads(w) for _s, w in items)
            seq = items[-1][0]

    def hold(self, items):
        """Seconds the batch `items` (pending_after()) may wait before it is sent: while
        every record in it may still wait (append's hold_s), until the first may not; else
        0. A RUNNING record waits a little for its job's next lines or its EXITED: a job of
        a few ms then costs one batch, one transaction and one ack on each side, not two,
        and nothing waits behind it (any other record sends it along at once)."""
        now = time.monotonic()
        with self.lock:
            until = [self._holds.get(seq, 0.0) for seq, _w in items]
        first = min(until, default=0.0)
        return first - now if first > now else 0.0

    def batch_message(self, items):
        return ('{"type":"batch","epoch":%s,"records":[%s]}'
                % (json.dumps(self.epoch), ",".join(w for _s, w in items)))

    def ack(self, seq):
        with self.lock:
            seq = min(int(seq), self.last_seq)
            if seq <= self.acked:
                return
            n = seq - self.acked
            del self._offs[:n]
            del self._lens[:n]
            del self._cuts[:n]
            self._dropped_lines += n
            self.acked = seq
            if self._holds:
                self._holds = {k: v for k, v in self._holds.items() if k > seq}
            # Compacting costs a state.json and the pending bytes: do it when the acked
            # head of the file is at least as big and holds enough lines (amortised: not
            # at every ack), so the file stays under twice what is pending. Acked lines
            # left in the spool are harmless: loading resends them from state.json's
            # `acked`, and the server skips what its cursor already covers.
            end = self._spool.tell()
            head = self._offs[0] if self._offs else end
            if head >= end - head and (self._dropped_lines >= self.compact_min
                                       or head >= COMPACT_BYTES):
                if self._offs:
                    self._rewrite()
                else:
                    self._empty()
        for fn in self.ack_listeners:
            fn()

    def restart_epoch(self, reason):
        """The server's cursor does not fit our history (e.g. its database was restored)."""
        with self.lock:
            keep_after = self.acked
            self._new_epoch(reason, len(self._offs))
            self._rewrite(renumber=True, keep_after=keep_after)
            self._loaded_seq = self.last_seq
            self._holds = {}            # their seqs are others now: they go at once

    # -- files ---------------------------------------------------------------------------

    def save_state(self):
        with self.lock:
            write_json_atomic(self.state_path, {
                "epoch": self.epoch, "next_seq": self.next_seq, "acked": self.acked,
                "snapshot_seq": self.last_seq, "attempts": self.attempts}, private=True)

    def _empty(self):
        """Everything is acked: state.json (its snapshot covers the spool), then truncate
        the spool in place. The truncation need not be durable: lines that come back after
        a crash are at or below state.json's `acked`, and loading skips them."""
        self.save_state()
        self._spool.truncate(0)
        self._spool.seek(0, os.SEEK_END)
        self._synced, self._file_no = 0, self._file_no + 1
        self._reader.close()        # its buffer may hold the old bytes
        self._reader = open(self.spool_path, "rb")
        self._dropped_lines = 0
        self.last_job_seq = 0

    def _rewrite(self, renumber=False, keep_after=None):
        """Compact: state.json first (so its snapshot covers what the spool drops), then
        the spool with only unacked records (renumbered from acked + 1 when asked), both
        atomically. Streams the records: a long spool never sits in memory."""
        self.save_state()
        if not (self._dropped_lines or self._spool is None or renumber):
            return
        keep_after = self.acked if keep_after is None else keep_after
        tmp = self.spool_path + ".tmp"
        offs, lens, cuts = array.array("q"), array.array("q"), array.array("q")
        seq, job_seq = self.acked, 0
        with open(tmp, "wb", opener=_private_opener) as out:
            for rec in self._scan_spool(quiet=True):
                if rec["seq"] <= keep_after:
                    continue
                seq += 1
                rec["seq"] = seq
                att = rec.pop("_att", None)
                line, cut = _spool_line(rec, att)
                offs.append(out.tell())
                lens.append(len(line))
                cuts.append(cut)
                out.write(line)
                if rec["kind"] == "job":
                    job_seq = seq
            out.flush()
            os.fsync(out.fileno())
        if seq != self.next_seq - 1:
            # records vanished between the scans (unparseable now): renumber what is left
            log.warning("outbox: %d records expected, %d found; renumbering in a new epoch",
                        self.next_seq - 1 - self.acked, seq - self.acked)
            if not renumber:
                os.unlink(tmp)
                self._new_epoch("spool changed under us", seq - self.acked)
                return self._rewrite(renumber=True, keep_after=keep_after)
            self.next_seq = seq + 1
        for f in (self._spool, self._reader):
            if f is not None:
                f.close()
        os.replace(tmp, self.spool_path)
        fsync_dir(self.spool_dir)
        self._offs, self._lens, self._cuts = offs, lens, cuts
        self.last_job_seq = job_seq
        self._dropped_lines = 0
        self._spool = open(self.spool_path, "ab", opener=_private_opener)
        self._reader = open(self.spool_path, "rb")
        self._synced, self._file_no = self._spool.tell(), self._file_no + 1   # fsynced above
        if renumber:
            self.save_state()

    def close(self):
        with self.lock:
            if self._spool is not None and not self._spool.closed:
                self.save_state()
                self._spool.close()
                self._reader.close()


# ---------------------------------------------------------------------------------------
# attempts: a job's files, environment, command, exit and log lines
# ---------------------------------------------------------------------------------------
#
# agent/jobs/<job>/<attempt>/ holds spec.json (the start command and the resolved exec),
# launch.json (the shim's pid), pid (the command's pid + start time, written by the shim),
# log, exit (written by the shim), cancel (the time a cancel was asked for) and reported
# (the final record, once it is in the outbox).

# Variables of the agent's environment a job never inherits: the agent's own settings
# (the token among them) and the shim's.
_PRIVATE_ENV = re.compile(r"^GPUCTL_")


def inherited_environment(secrets=(), base_env=None):
    """What a job inherits of the agent's environment: none of its own settings, no
    value that is one of its secrets."""
    return {k: v for k, v in (base_env if base_env is not None else os.environ).items()
            if not _PRIVATE_ENV.match(k) and v not in secrets}


def job_environment(msg, inherited, sdk_dir=SDK_DIR):
    """The job's environment: `inherited` (inherited_environment()), the job's own
    variables, then GPUPlane's."""
    env = dict(inherited)
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


def delete_checkpoint_file(path, working_dir):
    """-> (deleted, bytes freed, why not). Only a registered file or directory inside the
    job's working dir (after resolving every symlink on the way), never a symlink itself
    (nor, so, its target), never the working dir."""
    if not (isinstance(path, str) and isinstance(working_dir, str)
            and os.path.isabs(path) and os.path.isabs(working_dir)):
        return False, 0, "not an absolute path inside an absolute working dir"
    root = os.path.realpath(working_dir)
    if os.path.islink(path):
        return False, 0, "a symlink: neither it nor its target is deleted"
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root or real == root:
        return False, 0, "outside the job's working dir"
    if not os.path.lexists(path):
        return True, 0, "already gone"
    if os.path.isdir(real):
        freed = 0
        for top, _dirs, files in os.walk(real):
            for name in files:
                try:
                    freed += os.lstat(os.path.join(top, name)).st_size
                except OSError:
                    pass
        shutil.rmtree(real)
        return True, freed, None
    freed = os.lstat(real).st_size
    os.unlink(real)
    return True, freed, None


def pick_resume(candidates):
    """The checkpoint an attempt after a lost or failed one resumes from: the first of the
    server's candidates (the highest step first) whose path still exists here, or None."""
    for c in candidates or []:
        path = c.get("path") if isinstance(c, dict) else None
        if isinstance(path, str) and os.path.isabs(path) and os.path.exists(path):
            return c
    return None


def resume_environment(resume):
    """GPUCTL_RESUME_FROM (the path) and GPUCTL_RESUME_STEP (its step, when known)."""
    env = {"GPUCTL_RESUME_FROM": resume["path"]}
    if isinstance(resume.get("step"), int):
        env["GPUCTL_RESUME_STEP"] = str(resume["step"])
    return env


def as_user(run_as, argv, env):
    """The exec of a job run as another user (--run-as): setpriv switches uid, gid and
    groups and drops every capability before it execs the command."""
    name, uid, gid, home, setpriv = run_as
    env = dict(env, USER=name, LOGNAME=name, HOME=home)
    return ([setpriv, f"--reuid={uid}", f"--regid={gid}", "--init-groups",
             "--inh-caps=-all", "--bounding-set=-all", "--", *argv], setpriv, env)


def shim_environment():
    """The shim's own environment: nothing of the agent's (a job can read its parent's
    /proc/PID/environ); the job's environment travels in spec.json."""
    return {"PATH": os.environ.get("PATH", os.defpath), "LC_ALL": "C.UTF-8"}


def resolve_command(command, working_dir, env):
    """-> (argv, executable) or raise ValueError naming what is wrong."""
    if not working_dir or not isinstance(working_dir, str) or not os.path.isabs(working_dir):
        raise ValueError(f"working dir must be an absolute path, got {working_dir!r}")
    if "\0" in working_dir:
        raise ValueError("working dir contains a NUL byte; remove it and submit again")
    if not os.path.isdir(working_dir):
        raise ValueError(f"working dir does not exist on this host: {working_dir}")
    for k, v in env.items():
        if "\0" in k or "\0" in v or "=" in k or not k:
            raise ValueError(f"environment variable {k!r} cannot be passed to a process "
                             "(empty name, '=' or a NUL byte); fix the job's env")
    if isinstance(command, str):
        if "\0" in command:
            raise ValueError("command contains a NUL byte; remove it and submit again")
        return ["/bin/sh", "-c", command], "/bin/sh"
    if not command or not all(isinstance(a, str) for a in command):
        raise ValueError(f"command must be a non-empty list of strings, got {command!r}")
    if any("\0" in a for a in command):
        raise ValueError("command contains a NUL byte; remove it and submit again")
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


def catches(att, name):
    """Whether a process of the attempt's command (it, or a descendant) handles the signal
    (/proc/PID/status SigCgt): the server's default warning goes only to a program that
    does, since the default action of SIGUSR1 is to end it."""
    info = att.pid()
    if not info:
        return False
    bit = 1 << (getattr(signal, "SIG" + name) - 1)
    try:
        procs = [psutil.Process(info["pid"])]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return False
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                for line in f:
                    if line.startswith("SigCgt:"):
                        if int(line.split()[1], 16) & bit:
                            return True
                        break
        except OSError:
            continue
    return False


def _seconds(s):
    s = int(s)
    return (f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else
            f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def classify_exit(exit_info, log_path, cancel_info):
    """-> (failure_kind, message) for an exit file."""
    if exit_info.get("failure_kind"):
        return exit_info["failure_kind"], exit_info.get("message")
    ended = exit_info.get("ended_at") or now_ms()
    code, sig = exit_info.get("exit_code"), exit_info.get("signal")
    if cancel_info is not None and cancel_info.get("requested_at", 0) <= ended:
        # A program that exited 0 before SIGTERM reached it ended on its own: a stop
        # that came too late (an early stop judged on its last steps) keeps its own end.
        term_at = cancel_info.get("term_at")
        if code == 0 and not sig and (term_at is None or ended <= term_at):
            return None, None
        if cancel_info.get("timeout"):
            return "TIMEOUT", (f"stopped at its time limit of {_seconds(cancel_info['timeout'])}"
                               " (--time); a longer limit or a resume from its checkpoint")
        return "CANCELLED", "cancelled"
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
    """One (job, attempt): what the agent knows about it. The runner thread owns it and
    is the only one to read or write it, except for two flags its waiter thread sets
    (ProcessLauncher._wait): `started` (the shim's line: the command runs) and `shim_gone` (EOF:
    the shim wrote `exit` or died). Each is a bool set once, from False to True, and the
    waiter wakes the runner after setting it; the runner only reads them."""

    def __init__(self, job_id, attempt, path, spec=None):
        self.job_id, self.attempt, self.dir = int(job_id), int(attempt), path
        self.key = f"{self.job_id}/{self.attempt}"
        if spec is None:
            spec = read_json(self.file("spec.json")) or {}
        start = spec.get("start", {})
        self.received_at = spec.get("received_at") or now_ms()
        self.run_id = start.get("run_id")
        self.gpus = list(start.get("gpus") or [])
        self.working_dir = start.get("working_dir")
        self.tb_dir = start.get("tb_dir")
        self.watch_dir = start.get("watch_dir")
        self.container = spec.get("container")   # a container's name, for image jobs
        # its time limit and the warning before it, [signal name, seconds before]
        # (docs/scheduling.md); the runner enforces them unless the launcher's own does
        self.time_limit_s = start.get("time_limit_s")
        self.time_signal = start.get("time_signal")
        self.time_signal_asked = bool(start.get("time_signal_asked"))
        self.warned = False
        self.started_wall = None          # when its command started (the `pid` file's mtime)
        # which launcher runs it (LAUNCHERS): spec.json says since it records it
        self.launcher_kind = spec.get("launcher") or ("docker" if self.container else None)
        self.launcher = None              # set by the runner: that launcher
        self.resumed_from = spec.get("resumed_from")   # the checkpoint id it resumes from
        self.container_stop_sent = False
        self.scrubbed = False             # spec.json holds no secret (without_secrets)
        self.slurm_id = None              # --runner slurm: the batch job's id, its last
        self.slurm_reason = None          # PENDING reason (and when it was reported), and
        self.slurm_reason_at = None       # whether its log appeared
        self.log_seen = False
        self.submitting = False           # handed to an sbatch submitter, no answer yet
        self.watched = False              # this agent process launched it: a waiter watches
        self.shim_gone = False            # our waiter saw the shim exit
        self.started = False              # ... or its line: the command runs
        self.pid_info = None
        self.running_reported = False
        self.final = False
        self.term_sent = False
        self.killed = False
        self.tree = {}                    # pid -> create_time of every descendant seen
        self.writers = Writers(self)      # which files its processes wrote
        self.log = LogTail(self)
        self.tb = TensorBoardHook(self)
        self.ckpt = CheckpointHook(self)
        self.next_hook = 0.0
        self.due = 0.0                    # when the runner looks at it next (monotonic)
        self.poked = False                # its waiter has news: look at it now
        self.inflight = collections.deque()   # (seq, bytes) of log and metric records
        self.draining = False
        self.poll_s = LOG_POLL_MIN_S

    def file(self, name):
        return os.path.join(self.dir, name)

    def load_state(self, st):
        self.log.load(st)
        self.running_reported = bool(st.get("running", False))
        self.tb.offsets = dict(st.get("tb", {}))
        self.ckpt.load(st.get("ckpt", {}))

    def pid(self, ended=False):
        # a shim we watch says when it has written the file (its line, or its exit); so
        # does an `exit` found (ended): `pid` is written before it if the command ran, and
        # a fast job can end before its waiter thread has seen the shim's line
        if self.pid_info is None and (ended or self.started or self.shim_gone
                                      or not self.watched):
            self.pid_info = read_json(self.file("pid"))
        return self.pid_info

    def command_alive(self):
        info = self.pid()
        return bool(info) and proc_alive(info.get("pid"), info.get("create_time"))

    def backlog(self, acked):
        """Bytes of this attempt's log and metric records the server has not acked."""
        while self.inflight and self.inflight[0][0] <= acked:
            self.inflight.popleft()
        return sum(n for _s, n in self.inflight)

    def resolve(self, rel):
        """A job-relative path as an absolute one (None when there is nothing to join)."""
        if not rel:
            return None
        if os.path.isabs(rel):
            return os.path.normpath(rel)
        if not self.working_dir:
            return None
        return os.path.normpath(os.path.join(self.working_dir, rel))


# ---------------------------------------------------------------------------------------
# launchers: one interface; a process starts through the shim, its tree is stopped
# ---------------------------------------------------------------------------------------

def shim_record(exec_record):
    """An attempt's exec record as the shim's message carries it (marshal: cheaper to load
    than spec.json), or None when it is too big for one message (SHIM_RECORD_MAX): the
    shim then reads it from spec.json."""
    packed = marshal.dumps(exec_record)
    return packed if len(packed) <= SHIM_RECORD_MAX else None


# Every way of running an attempt is a launcher with one interface, chosen from one table
# (LAUNCHERS, in the runner's section); the runner calls only these, never asks the kind:
#
#   kind                          its row in LAUNCHERS, and what spec.json records
#   for_runner(runner)            -> the launcher for this agent, or None (not configured)
#   takes(start)                  whether a start message is this launcher's
#   exec_spec(start, env, path)   -> (exec record, more spec.json fields); ValueError:
#                                 the attempt fails to dispatch, with that sentence
#   pack(exec record)             -> bytes the launch carries, or None (then spec.json
#                                 keeps the whole record, secrets and all, until it runs)
#   launch(att, exec record, packed), adopt(att) (an attempt from before a restart)
#   poll(now), due(now)           its own work each tick, and when it is next due
#   alive(att)                    whether the attempt may still run (no `exit` expected yet)
#   enforce_cancel(att, cancel)   -> True once nothing of the job is left
#   classify(att, exit info)      -> the exit as the job saw it (a container's own code)
#   signal(att, name)             a signal to the running job (the warning before its limit)
#   limits_time                   True where the launcher's own system stops a job at its
#                                 limit (Slurm's --time); else the runner does
#   clean(active), warm(), close()  leftovers of lost attempts; start and stop
#
# A new runner kind is one class here and one row in LAUNCHERS.

def mark_stop_sent(att, cancel):
    """Record in the attempt's `cancel` file when the stop went to a program still running
    (SIGTERM to its group, `docker stop`, scancel): an exit 0 after it obeyed the stop, one
    before it did not see it and keeps its own end (classify_exit)."""
    if "term_at" not in cancel:
        cancel["term_at"] = now_ms()
        write_json_atomic(att.file("cancel"), cancel, private=True)


class ProcessLauncher:
    """Starts attempts through the shim and stops their process trees (SIGTERM to the
    group, SIGKILL to it and every descendant seen once the grace period is over).

    The shim (SHIM_SOURCE) is one `python -I -S` process per agent that starts each job
    with posix_spawn and waits for it, in a session of its own: jobs outlive the agent,
    and a shim whose agent has gone ends once its jobs have. Starting a job through it
    costs a message and a spawn, where a shim per job cost an interpreter start (15 to
    20 ms of CPU) and a forked one 3 to 4 ms."""

    kind = "process"

    def __init__(self, kill_grace_s, wake, err_path=os.devnull, run_as=None):
        self.kill_grace_s = kill_grace_s
        self.wake = wake
        self.err_path = err_path
        self.run_as = run_as        # (name, uid, gid, home, setpriv) or None
        self._server = None         # (Popen, socket) of this agent's shim
        self._retired = []          # shims we stopped handing jobs to (reaped when they end)

    @classmethod
    def for_runner(cls, runner):
        if runner.slurm is not None:
            return None
        return cls(runner.kill_grace_s_setting, runner.poke,
                   os.path.join(runner.jobs_dir, "shim.err"), runner.run_as)

    def takes(self, start):
        return True                 # what no other launcher takes

    def exec_spec(self, start, env, path):
        argv, exe = resolve_command(start.get("command"), start.get("working_dir"), env)
        if self.run_as is not None:
            argv, exe, env = as_user(self.run_as, argv, env)
        return {"argv": argv, "executable": exe, "cwd": start["working_dir"], "env": env}, {}

    def pack(self, exec_record):
        return shim_record(exec_record)

    def adopt(self, att):
        pass                        # its pid and exit files say everything

    def poll(self, now):
        pass

    def due(self, now):
        return float("inf")

    def classify(self, att, exit_info):
        return exit_info

    def clean(self, active):
        pass

    limits_time = False

    def signal(self, att, name):
        info = att.pid()
        if info:
            _killpg(info["pid"], getattr(signal, "SIG" + name))

    def warm(self):
        """Start the shim if it is not running (the runner calls this at start, so the
        first job does not wait for an interpreter). -> (Popen, socket)"""
        self._retired = [p for p in self._retired if p.poll() is None]
        if self._server is not None and self._server[0].poll() is None:
            return self._server
        self._retire()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs, open(self.err_path, "ab", opener=_private_opener) as err:
            p = subprocess.Popen(shim_server_command(), stdin=theirs,
                                 stdout=subprocess.DEVNULL, stderr=err,
                                 start_new_session=True, close_fds=True,
                                 env=shim_environment())
        ours.settimeout(SHIM_REPLY_TIMEOUT_S)
        self._server = (p, ours)
        return self._server

    def _retire(self):
        """Hand the shim no more jobs: it reads EOF and ends once the jobs it has ended."""
        server, self._server = self._server, None
        if server is not None:
            server[1].close()
            if server[0].poll() is None:
                self._retired.append(server[0])

    def launch(self, att, exec_record, packed):
        """Hand the attempt to the shim with its exec record (`packed`: shim_record(); None:
        too big for one message, the shim reads it from spec.json) and the write end of a
        pipe: a line when the command runs and EOF once its exit is written both wake the
        runner, so nothing polls for either."""
        request = os.fsencode(att.dir) + b"\0" + (packed or b"")
        r, w = os.pipe()
        try:
            for attempt in (1, 2):
                _proc, sock = self.warm()
                try:
                    socket.send_fds(sock, [request], [w])
                    break
                except OSError:
                    # not delivered: the shim died since the last launch; once more with a
                    # new one, then the attempt ends LOST (nothing runs, no exit status)
                    self._retire()
                    if attempt == 2:
                        os.close(r)
                        raise
        finally:
            os.close(w)
        # From here the pipe tells: if the shim holds no copy of its write end (it never
        # got this job, or died), the waiter sees EOF.
        att.watched = True
        threading.Thread(target=self._wait, args=(att, r), daemon=True,
                         name=f"gpuplane-agent-wait-{att.key}").start()
        try:
            reply = sock.recv(4096).decode("utf-8", "replace")
        except OSError as e:
            reply = f"no reply from the shim ({e})"
        if reply.startswith("pid ") or reply == "ended":
            log.debug("job %s attempt %s: %s", att.job_id, att.attempt, reply)
            return
        log.error("job %s attempt %s: not started: %s", att.job_id, att.attempt,
                  reply or "the shim ended before it replied")
        if reply.startswith("refused"):
            # the shim is fine and runs nothing for it: the attempt failed to dispatch
            if read_json(att.file("exit")) is None:
                write_exit(att.dir, failure_kind="DISPATCH_FAILED",
                           message=f"the job's shim could not start it: {reply}")
        else:
            self._retire()          # gone or stuck: the next job gets a new shim

    def _wait(self, att, fd):
        try:
            with open(fd, "rb", buffering=0) as pipe:
                while pipe.readline():
                    att.started = True
                    self.wake(att)
        finally:
            att.shim_gone = True
            self.wake(att)

    def close(self):
        self._retire()

    def alive(self, att):
        """While the shim that runs it is there (no `exit` written yet)."""
        if att.watched:
            return not att.shim_gone
        info = att.pid() or read_json(att.file("launch.json"))
        if info and info.get("shim_pid"):
            return proc_alive(info["shim_pid"], info.get("shim_create_time"))
        # no pid file yet: a crash between mkdir and launch, or a launch right now
        # (launch.json: written by agents of before the shim per agent)
        try:
            age = time.time() - os.stat(att.dir).st_mtime
        except OSError:
            return False
        return age < LAUNCH_GRACE_S

    def enforce_cancel(self, att, cancel):
        """-> True once nothing of the job is left (or it never started)."""
        info = att.pid()
        if not info:
            return not self.alive(att) or read_json(att.file("exit")) is not None
        pgid = info["pid"]
        self._remember_tree(att, info)
        if not att.term_sent:
            att.term_sent = True
            if proc_alive(pgid, info.get("create_time")):
                mark_stop_sent(att, cancel)
            _killpg(pgid, signal.SIGTERM)
        survivors = self._survivors(att, pgid)
        if not survivors:
            return True
        if now_ms() - (cancel.get("stop_at") or cancel.get("requested_at", 0)) >= \
                self.kill_grace_s * 1000:
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


def _killpg(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------------------------------
# containers: a job with an image runs under the same shim as `docker run` (docs/docker.md)
# ---------------------------------------------------------------------------------------
# The shim's child is the docker CLI, attached: the container's output is the job's log,
# its exit code the CLI's, and a restarted agent re-adopts the shim as for any job. What
# a process tree cannot tell, the engine can: a cancel also stops the container (SIGTERM,
# SIGKILL after the grace), and an exit is checked for the OOM killer before the
# container is removed.

_DOCKER_ERROR_CODE = 125      # `docker run` itself failed: no container ran


def _container_safe(text):
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:60] or "node"


class Docker:
    def __init__(self, node, binary="docker", extra_args=(), default_image=None):
        self.node = node
        self.binary = binary
        self.extra_args = list(extra_args or ())
        self.default_image = default_image or None
        self._nvidia = None

    def prefix(self):
        return f"gpuplane-{_container_safe(self.node)}-"

    def name(self, job_id, attempt):
        return f"{self.prefix()}{int(job_id)}-{int(attempt)}"

    def path(self):
        return shutil.which(self.binary)

    def _run(self, *args, timeout=30):
        return subprocess.run([self.path() or self.binary, *args], capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def nvidia_runtime(self):
        if self._nvidia is None:
            try:
                r = self._run("info", "--format", "{{json .Runtimes}}", timeout=15)
                self._nvidia = r.returncode == 0 and "nvidia" in r.stdout
            except (OSError, subprocess.SubprocessError):
                self._nvidia = False
        return self._nvidia

    def exec_spec(self, msg, env, image, sdk_dir=SDK_DIR):
        """The shim's exec record for `docker run`. Raises ValueError with a sentence."""
        exe = self.path()
        if exe is None:
            raise ValueError(f"this job runs in the image {image!r} but {self.binary!r} is "
                             "not installed on this host; install Docker or submit without "
                             "--image")
        wd = msg.get("working_dir")
        resolve_command(["true"], wd, env)    # the working dir and env checks, the same
        command = msg.get("command")
        if isinstance(command, str):
            command = ["/bin/sh", "-c", command]
        if not command or not all(isinstance(a, str) and "\0" not in a for a in command):
            raise ValueError(f"command must be a non-empty list of strings, got {command!r}")
        passed = dict((k, v) for k, v in (msg.get("env") or {}).items())
        for k in ("GPUCTL_RUN_ID", "GPUCTL_JOB_ID", "GPUCTL_SERVER", "GPUCTL_TOKEN",
                  "PYTHONUNBUFFERED"):
            passed[k] = env.get(k, "")
        gpus = [] if msg.get("cpu_only") else list(msg.get("gpus") or [])
        argv = [exe, "run", "--name", self.name(msg["job_id"], msg["attempt"]),
                # the event files it writes name this host: whose they are (Writers)
                "--hostname", container_hostname(msg["job_id"], msg["attempt"]),
                "--init", "--pull", "never", "--network", "host",
                "--user", f"{os.getuid()}:{os.getgid()}",
                "--label", f"gpuplane.node={self.node}",
                "--label", f"gpuplane.job={int(msg['job_id'])}",
                "--label", f"gpuplane.attempt={int(msg['attempt'])}",
                "-v", f"{wd}:{wd}", "-w", wd]
        if gpus and self.nvidia_runtime():
            # the container sees its cards as 0..n-1
            argv += ["--gpus", f"device={','.join(str(g) for g in gpus)}"]
            passed["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(gpus)))
        else:
            passed["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        if "PYTHONPATH" not in (msg.get("env") or {}) and os.path.isdir(sdk_dir):
            argv += ["-v", f"{sdk_dir}:{CONTAINER_SDK_DIR}:ro"]
            passed["PYTHONPATH"] = CONTAINER_SDK_DIR
        cli_env = dict(env)
        for k, v in passed.items():
            argv += ["-e", k]          # the value comes from the CLI's environment, not argv
            cli_env[k] = v
        argv += self.extra_args + [image] + list(command)
        return {"argv": argv, "executable": exe, "cwd": wd, "env": cli_env}

    def stop(self, name, grace_s):
        """SIGTERM to the container, SIGKILL after grace_s; does not wait."""
        try:
            subprocess.Popen([self.path() or self.binary, "stop", "-t",
                              str(max(1, int(grace_s))), name], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        except OSError as e:
            log.warning("docker stop %s failed: %s", name, e)

    def inspect(self, name):
        """-> {"oom_killed", "exit_code", "running"} or None when there is no container."""
        try:
            r = self._run("inspect", "--format",
                          "{{.State.OOMKilled}} {{.State.ExitCode}} {{.State.Running}}", name)
        except (OSError, subprocess.SubprocessError):
            return None
        if r.returncode != 0:
            return None
        oom, code, running = (r.stdout.split() + ["", "", ""])[:3]
        return {"oom_killed": oom == "true", "exit_code": int(code) if code.isdigit() else None,
                "running": running == "true"}

    def remove(self, name):
        try:
            self._run("rm", "-f", name)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("docker rm %s failed: %s", name, e)

    def leftovers(self):
        """Names of this node's containers (running or not)."""
        if self.path() is None:
            return []
        try:
            r = self._run("ps", "-a", "--filter", f"label=gpuplane.node={self.node}",
                          "--format", "{{.Names}}", timeout=15)
        except (OSError, subprocess.SubprocessError):
            return []
        if r.returncode != 0:
            return []
        return [n for n in r.stdout.split() if n.startswith(self.prefix())]

    def classify(self, name, exit_info):
        """Refine an exit with what the engine knows, then remove the container.
        -> the exit record to classify."""
        info = self.inspect(name)
        if info is None:
            if exit_info.get("exit_code") == _DOCKER_ERROR_CODE:
                return dict(exit_info, failure_kind="DISPATCH_FAILED",
                            message="docker could not start the container (see the job's "
                                    "log: a missing image, a bad option, no daemon)")
            return exit_info
        self.remove(name)
        if info["oom_killed"]:
            return dict(exit_info, exit_code=info["exit_code"], failure_kind="OOM",
                        message="the container was killed by the kernel's OOM killer "
                                "(its memory limit was reached)")
        if exit_info.get("exit_code") is None and info["exit_code"] is not None:
            exit_info = dict(exit_info, exit_code=info["exit_code"], signal=None)
        return exit_info


class DockerLauncher:
    """A job with an image: `docker run` under the shim (ProcessLauncher's, shared), and
    the engine for what a process tree cannot tell — a cancel also stops the container, its
    exit is the container's own (OOM-killed, or docker's "could not run"), and containers
    of attempts this node no longer runs are removed."""

    kind = "docker"

    def __init__(self, docker, launchers, kill_grace_s):
        self.docker = docker
        self._launchers = launchers     # the runner's: the shim is its "process" launcher
        self.kill_grace_s = kill_grace_s

    @property
    def process(self):
        return self._launchers["process"]

    @classmethod
    def for_runner(cls, runner):
        if runner.slurm is not None:
            return None
        return cls(runner.docker, runner.launchers, runner.kill_grace_s_setting)

    def takes(self, start):
        return bool(start.get("image") or self.docker.default_image)

    def exec_spec(self, start, env, path):
        job_id, attempt = start["job_id"], start["attempt"]
        return (self.docker.exec_spec(start, env, start.get("image") or
                                      self.docker.default_image),
                {"container": self.docker.name(job_id, attempt)})

    def pack(self, exec_record):
        return self.process.pack(exec_record)

    def launch(self, att, exec_record, packed):
        self.process.launch(att, exec_record, packed)

    def adopt(self, att):
        pass

    def poll(self, now):
        pass

    def due(self, now):
        return float("inf")

    def alive(self, att):
        return self.process.alive(att)

    limits_time = False

    def signal(self, att, name):
        self.process.signal(att, name)      # `docker run` hands it to the container

    def enforce_cancel(self, att, cancel):
        if att.container and not att.container_stop_sent:
            att.container_stop_sent = True
            if self.process.alive(att):
                mark_stop_sent(att, cancel)
            self.docker.stop(att.container, self.kill_grace_s)
        return self.process.enforce_cancel(att, cancel)

    def classify(self, att, exit_info):
        if not att.container:
            return exit_info
        if exit_info.get("failure_kind") == "LOST":
            self.docker.remove(att.container)
            return exit_info
        return self.docker.classify(att.container, exit_info)

    def clean(self, active):
        """Containers of this node that belong to no attempt still running here (the
        agent died before removing them, or their shim vanished) are removed."""
        keep = {att.container for att in active.values() if att.container}
        for name in self.docker.leftovers():
            if name not in keep:
                log.warning("removing container %s: no running attempt of this node owns it",
                            name)
                self.docker.remove(name)

    def warm(self):
        pass                        # the shim is ProcessLauncher's

    def close(self):
        pass


# ---------------------------------------------------------------------------------------
# Slurm: `--runner slurm` hands every start to sbatch (docs/slurm.md)
# ---------------------------------------------------------------------------------------
# The agent runs on a login node and Slurm places the jobs: a start becomes a batch job
# whose output goes to the attempt's `log` (the agent's home is on a filesystem the
# compute nodes share), its state comes from one `squeue` call for all of this agent's
# jobs, polled with backoff, and a cancel is scancel. Everything else (log tailing,
# TensorBoard, checkpoints, the outbox) is the runner's, as for a local job: SlurmLauncher
# is the launcher of a Slurm agent, writing the attempt's `pid` file when Slurm runs the
# job and its `exit` file when Slurm says it ended.
#
# Files of an attempt, besides the runner's: job.sh (the batch script) and slurm.json (the
# Slurm job id; written with `submitting` before sbatch runs, so a crash in between is
# found again by the job's name instead of being submitted twice).

SLURM_FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
               "PREEMPTED", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED")
SLURM_STARTED = ("RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING",
                 "STAGE_OUT") + SLURM_FINAL
# A job Slurm could not run through no fault of its own: a new attempt, as for a lost node.
SLURM_LOST = ("NODE_FAIL", "PREEMPTED", "BOOT_FAIL")
# Variables of Slurm's own that must not reach sbatch from the agent's environment (an
# agent started inside an allocation would hand its job id to every job); SLURM_CONF,
# which says where the cluster is, does.
_SLURM_PRIVATE_ENV = re.compile(r"^SLURM_(?!CONF$)")


class SlurmError(Exception):
    pass


class Slurm:
    """The Slurm commands the runner needs, each one call for all of this agent's jobs."""

    def __init__(self, node, partition=None, account=None, qos=None, time_limit=None,
                 sbatch_args=(), max_jobs=16):
        self.node = node
        self.partition = partition or None
        self.account = account or None
        self.qos = qos or None
        self.time_limit = time_limit or None
        self.sbatch_args = list(sbatch_args or ())
        self.max_jobs = max_jobs

    def job_name(self, job_id, attempt):
        return f"gpuplane-{_container_safe(self.node)}-{int(job_id)}-{int(attempt)}"

    def _run(self, *argv, env=None, timeout=SLURM_TIMEOUT_S):
        try:
            return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL, env=env)
        except FileNotFoundError:
            raise SlurmError(f"{argv[0]} not found on this host: the Slurm runner needs the "
                             "Slurm client commands (sbatch, squeue, scancel, sinfo) on PATH")
        except (OSError, subprocess.SubprocessError) as e:
            raise SlurmError(f"{argv[0]} failed: {e}")

    # -- what the partition offers (sinfo) ------------------------------------------------

    def offers(self):
        """-> {"partition", "nodes", "max_gpus", "cpus", "mem_mb", "gres", "time_limit",
        "states"} of the partition (the default one when none is set), or with "error"."""
        argv = ["sinfo", "-h", "-o", "%P|%D|%c|%m|%G|%l|%t|%a"]
        if self.partition:
            argv += ["-p", self.partition]
        try:
            r = self._run(*argv)
        except SlurmError as e:
            return {"partition": self.partition, "error": str(e)}
        if r.returncode != 0:
            return {"partition": self.partition, "error": r.stderr.strip()[:500]}
        out = {"partition": self.partition, "nodes": 0, "max_gpus": 0, "cpus": 0,
               "mem_mb": 0, "gres": [], "time_limit": None, "states": {}}
        for line in r.stdout.splitlines():
            f = line.split("|")
            if len(f) < 8:
                continue
            part = f[0].rstrip("*")
            if not self.partition and not f[0].endswith("*"):
                continue                 # the default partition only
            out["partition"] = part
            nodes = int(f[1]) if f[1].isdigit() else 0
            out["nodes"] += nodes
            out["cpus"] = max(out["cpus"], _leading_int(f[2]))
            out["mem_mb"] = max(out["mem_mb"], _leading_int(f[3]))
            out["max_gpus"] = max(out["max_gpus"], gres_gpus(f[4]))
            if f[4] and f[4] != "(null)" and f[4] not in out["gres"]:
                out["gres"].append(f[4])
            out["time_limit"] = f[5]
            out["states"][f[6]] = out["states"].get(f[6], 0) + nodes
            out["available"] = f[7]
        return out

    # -- submit ---------------------------------------------------------------------------

    def script(self, command):
        """The batch script: the command, exec'd so Slurm's signals reach it."""
        import shlex
        return ("#!/bin/sh\n# GPUPlane (agent.py's Slurm runner): the job's command\n"
                "exec " + " ".join(shlex.quote(a) for a in command) + "\n")

    def sbatch_argv(self, msg, attempt_dir):
        job_id, attempt = int(msg["job_id"]), int(msg["attempt"])
        log_path = os.path.join(attempt_dir, "log")
        argv = ["sbatch", "--parsable", f"--job-name={self.job_name(job_id, attempt)}",
                f"--chdir={msg['working_dir']}", f"--output={log_path}",
                f"--error={log_path}", "--open-mode=append", "--no-requeue",
                f"--comment=gpuplane job {job_id} attempt {attempt}"]
        for flag, value in (("--partition", self.partition), ("--account", self.account),
                            ("--qos", self.qos)):
            if value:
                argv.append(f"{flag}={value}")
        gpus = 0 if msg.get("cpu_only") else int(msg.get("gpu_count") or
                                                   len(msg.get("gpus") or []))
        if gpus:
            argv.append(f"--gres=gpu:{gpus}")
        if msg.get("cpus"):
            argv.append(f"--cpus-per-task={int(msg['cpus'])}")
        if msg.get("mem_mb"):
            argv.append(f"--mem={int(msg['mem_mb'])}M")
        minutes = msg.get("time_limit_min") or self.time_limit
        if minutes:
            argv.append(f"--time={minutes}")
        return argv + self.sbatch_args + [os.path.join(attempt_dir, "job.sh")]

    def exec_spec(self, msg, env, attempt_dir):
        """The runner's exec record for a Slurm job. Raises ValueError with a sentence."""
        if msg.get("image"):
            raise ValueError("this agent runs its jobs through Slurm, which does not take "
                             "GPUPlane's --image; submit without it (a cluster's container "
                             "support goes in the agent's sbatch_args)")
        # The working dir must be on the shared filesystem; the program need not exist on
        # the login node (modules, compute-node installs): a missing one fails in the job.
        resolve_command(["true"], msg.get("working_dir"), env)
        command = msg.get("command")
        if isinstance(command, str):
            command = ["/bin/sh", "-c", command]
        if not command or not all(isinstance(a, str) and a and "\0" not in a
                                  for a in command[:1]) or \
                not all(isinstance(a, str) and "\0" not in a for a in command):
            raise ValueError(f"command must be a non-empty list of strings, got {command!r}")
        env = {k: v for k, v in env.items() if not _SLURM_PRIVATE_ENV.match(k)}
        # Slurm sets CUDA_VISIBLE_DEVICES to the cards it gives the job (--gres); a
        # cpu_only job sees none, as on a local agent.
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if msg.get("cpu_only"):
            env["CUDA_VISIBLE_DEVICES"] = ""
        return {"slurm": True, "argv": self.sbatch_argv(msg, attempt_dir),
                "script": self.script(command), "cwd": msg["working_dir"], "env": env}

    def sbatch(self, exec_record):
        """-> the Slurm job id; SlurmError with sbatch's own words when it refuses."""
        r = self._run(*exec_record["argv"], env=exec_record["env"])
        if r.returncode != 0:
            raise SlurmError(f"sbatch refused the job: {r.stderr.strip()[:800] or r.returncode}")
        job_id = r.stdout.strip().split(";")[0].strip()
        if not job_id.split("_")[0].isdigit():
            raise SlurmError(f"sbatch said {r.stdout.strip()[:200]!r}, not a job id")
        return job_id

    # -- states ---------------------------------------------------------------------------

    def states(self, ids):
        """{slurm id: {"state", "reason", "exit_code", "signal", "node"}} of the jobs
        slurmctld still holds (one squeue call); ids it forgot are left out."""
        if not ids:
            return {}
        r = self._run("squeue", "-h", "-t", "all", "-j", ",".join(sorted(ids)), "-O",
                      "JobID:|,State:|,exit_code:|,NodeList:|,Reason:")
        if r.returncode != 0:
            if "Invalid job id" in r.stderr:
                return {}
            raise SlurmError(f"squeue failed: {r.stderr.strip()[:300]}")
        out = {}
        for line in r.stdout.splitlines():
            f = line.split("|", 4)
            if len(f) < 5 or f[0].strip() not in ids:
                continue
            status = _leading_int(f[2])
            out[f[0].strip()] = {"state": f[1].strip().split()[0] if f[1].strip() else "",
                                 "exit_code": status >> 8, "signal": status & 0x7f or None,
                                 "node": f[3].strip(), "reason": f[4].strip()}
        return out

    def accounting(self, ids=(), name=None):
        """Finished jobs slurmctld has forgotten, from sacct (slurmdbd) or, without it,
        the job completion log (`sacct -c`). -> {id: state dict} as states()."""
        sel = ["-j", ",".join(sorted(ids))] if ids else ["--name", name]
        out = {}
        for extra in ([], ["-c"]):
            try:
                r = self._run("sacct", *extra, "-n", "-P", "-X", "-S", "now-30days", *sel,
                              "-o", "JobIDRaw,State,ExitCode,NodeList,JobName")
            except SlurmError:
                return out
            if r.returncode != 0 or not r.stdout.strip():
                continue
            for line in r.stdout.splitlines():
                f = line.split("|")
                # what was asked for only: `sacct -c` (the completion log) filters less
                if len(f) < 5 or (f[0] not in ids if ids else f[4] != name):
                    continue
                code, _, sig = f[2].partition(":")
                out[f[0]] = {"state": f[1].split()[0] if f[1] else "", "reason": "",
                             "exit_code": _leading_int(code),
                             "signal": _leading_int(sig) or None, "node": f[3]}
            if out:
                return out
        return out

    def find(self, name):
        """The ids of jobs of this name slurmctld holds (a submit the agent did not see
        answered)."""
        r = self._run("squeue", "-h", "-t", "all", "--name", name, "-o", "%i")
        ids = r.stdout.split() if r.returncode == 0 else []
        return ids or sorted(self.accounting(name=name))

    def scancel(self, slurm_id, signal_name=None):
        argv = ["scancel"]
        if signal_name:
            argv += [f"--signal={signal_name}", "--full"]
        try:
            r = self._run(*argv, slurm_id)
        except SlurmError as e:
            log.warning("%s", e)
            return False
        if r.returncode != 0:
            log.info("scancel %s %s: %s", signal_name or "", slurm_id, r.stderr.strip()[:300])
        return r.returncode == 0


def _leading_int(text):
    m = re.match(r"\s*(\d+)", text or "")
    return int(m.group(1)) if m else 0


def gres_gpus(gres):
    """GPUs one node offers from sinfo's %G ("gpu:4", "gpu:a100:8(S:0-1)", "(null)")."""
    total = 0
    for part in (gres or "").split(","):
        bits = part.split("(")[0].split(":")
        if bits[0] == "gpu" and len(bits) >= 2 and bits[-1].isdigit():
            total += int(bits[-1])
    return total


def slurm_end(info, cancel):
    """An exit record for a Slurm job in a final state (`info` from states())."""
    state = info["state"]
    rec = exit_record(exit_code=info.get("exit_code"), signal=info.get("signal"),
                      slurm_state=state)
    where = f" on {info['node']}" if info.get("node") else ""
    if state == "OUT_OF_MEMORY":
        rec.update(failure_kind="OOM", message=f"Slurm: OUT_OF_MEMORY{where}: the job went "
                   "over its memory (--mem); give it more or use less")
    elif state in ("TIMEOUT", "DEADLINE"):
        rec.update(failure_kind="TIMEOUT", message=f"Slurm: {state}{where}: the job ran past "
                   "its time limit (--time); give it more time or checkpoint and resume")
    elif state in SLURM_LOST:
        rec.update(failure_kind="LOST", message=f"Slurm: {state}{where}; retried as a new "
                   "attempt")
    elif state == "CANCELLED" and cancel is None:
        rec.update(failure_kind="CANCELLED", message="cancelled in Slurm by someone else "
                   "(scancel or an administrator), not through GPUPlane")
    elif state in ("COMPLETED", "FAILED", "CANCELLED"):
        pass        # the exit code (and the log's OOM patterns) decide, as for a process
    else:
        rec.update(failure_kind="EXIT_CODE", message=f"Slurm: {state}{where}")
    return rec


def _write_quick(path, obj):
    """An atomic write without fsync, for a Slurm attempt's slurm.json, pid and exit:
    what a power cut may lose there, Slurm tells again (squeue, sacct, the job's name) when
    the agent re-adopts the attempt."""
    write_json_atomic(path, obj, sync=False)


class SlurmLauncher:
    """The launcher of a Slurm agent (--runner slurm): every start is an sbatch; follow the
    states, cancel. The runner thread calls poll() at each tick; it runs squeue once when
    due, never per job.

    sbatch waits for slurmctld's answer (tens of ms, more on a busy cluster), so a few
    submitter threads run it, each taking (attempt, exec record) from a queue and handing
    back (attempt, id or error); the runner thread alone touches the attempt, when it
    collects the answer. A queue of starts then costs what Slurm takes to accept them,
    not that times the runner's other work."""

    kind = "slurm"

    @classmethod
    def for_runner(cls, runner):
        if runner.slurm is None:
            return None
        launcher = cls(runner.slurm, runner.kill_grace_s_setting, runner.wake)
        launcher.report = runner.reporter.queued_in_slurm
        return launcher

    def takes(self, start):
        return True                 # a Slurm agent runs every job through Slurm

    def exec_spec(self, start, env, path):
        return self.slurm.exec_spec(start, env, path), {}

    def pack(self, exec_record):
        return None                 # sbatch reads the record from spec.json

    limits_time = True              # sbatch --time and --signal

    def signal(self, att, name):
        pass

    def classify(self, att, exit_info):
        return exit_info

    def clean(self, active):
        pass

    def __init__(self, slurm, kill_grace_s, wake, submitters=SLURM_SUBMITTERS):
        self.slurm = slurm
        self.kill_grace_s = kill_grace_s
        self.wake = wake
        self.poll_s = SLURM_POLL_MIN_S
        self.next_poll = 0.0
        self.pending = {}           # slurm id -> Attempt, for every attempt not yet ended
        self.report = None          # callable(att, reason): a `job` PENDING record
        self.failures = 0
        self.submitters = submitters
        # for the submitters: (att, exec record) to submit, or (None, ids) to poll; back
        # from them: (att, when sbatch answered, the Slurm id, error), or (None, ids,
        # {id: state}, error)
        self._submits = collections.deque()
        self._answers = collections.deque()
        self._ready = threading.Condition()
        self._threads = []
        self._closing = False
        self._polling = False       # a poll is with the submitters

    def warm(self):
        while len(self._threads) < self.submitters:
            t = threading.Thread(target=self._submitter, daemon=True,
                                 name=f"gpuplane-agent-sbatch-{len(self._threads)}")
            t.start()
            self._threads.append(t)

    def close(self):
        with self._ready:
            self._closing = True
            self._ready.notify_all()
        for t in self._threads:
            t.join(SLURM_TIMEOUT_S)

    def _submitter(self):
        while True:
            with self._ready:
                while not self._submits and not self._closing:
                    self._ready.wait()
                if self._closing:
                    return
                att, rec = self._submits.popleft()
            try:
                # (None, ids) is a poll of those jobs' states; else a start to submit
                answer = self._query(rec) if att is None else self.slurm.sbatch(rec)
                self._answers.append((att, rec if att is None else now_ms(), answer, None))
            except Exception as e:      # SlurmError, or anything unforeseen: said once
                self._answers.append((att, rec, None, e if isinstance(e, SlurmError)
                                      else SlurmError(f"{'squeue' if att is None else 'sbatch'} "
                                                      f"failed: {e}")))
            self.wake()

    def kick(self):
        self.poll_s = SLURM_POLL_MIN_S
        self.next_poll = 0.0

    def adopt(self, att):
        """An attempt from before a restart: its id from slurm.json (or Slurm, by name)."""
        info = read_json(att.file("slurm.json")) or {}
        att.watched = True
        att.slurm_id = info.get("job_id")
        att.pid_info = read_json(att.file("pid"))
        att.started = att.pid_info is not None
        if att.slurm_id is None and "refused" not in info and \
                read_json(att.file("exit")) is None:
            # a crash after the start was taken and before sbatch's answer was written:
            # the job's name says whether Slurm has it (never submitted twice)
            try:
                found = self.slurm.find(self.slurm.job_name(att.job_id, att.attempt))
            except SlurmError as e:
                log.warning("job %s attempt %s: cannot look it up in Slurm: %s", att.job_id,
                            att.attempt, e)
                found = None
            exec_record = (read_json(att.file("spec.json")) or {}).get("exec")
            if found:
                att.slurm_id = found[0]
                _write_quick(att.file("slurm.json"), {"job_id": att.slurm_id})
            elif found is not None and exec_record:
                # Slurm has no job of its name: it was never submitted; submit it now
                log.info("job %s attempt %s was never submitted to Slurm; submitting it",
                         att.job_id, att.attempt)
                self.launch(att, exec_record, None)
            elif found is not None:
                write_exit(att.dir, failure_kind="LOST", message="the agent stopped before "
                           "submitting it and its start is gone; retried as a new attempt")
        if att.slurm_id is not None:
            self.pending[att.slurm_id] = att
        self.kick()

    def launch(self, att, exec_record, packed=None):
        """Hand the attempt to a submitter; collect() takes its answer."""
        att.watched = True
        att.slurm_id = None
        with open(att.file("job.sh"), "w", opener=lambda p, f: os.open(p, f, 0o700)) as f:
            f.write(exec_record["script"])
        att.submitting = True
        if not self._threads:
            self.warm()
        with self._ready:
            self._submits.append((att, exec_record))
            self._ready.notify()

    def collect(self):
        """sbatch's answers (runner thread): the id in slurm.json, or DISPATCH_FAILED."""
        while self._answers:
            att, what, answer, err = self._answers.popleft()
            if att is None:
                self._apply(what, answer or {}, err)
                continue
            slurm_id, answered_at = answer, what
            att.submitting = False
            if err is not None:
                log.error("job %s attempt %s: %s", att.job_id, att.attempt, err)
                with open(att.file("log"), "ab", opener=_private_opener) as f:
                    f.write(f"gpuplane: {err}\n".encode())
                _write_quick(att.file("slurm.json"), {"job_id": None, "refused": str(err)})
                write_exit(att.dir, failure_kind="DISPATCH_FAILED", message=str(err))
                continue
            _write_quick(att.file("slurm.json"), {"job_id": slurm_id,
                                                  "submitted_at": answered_at})
            att.slurm_id = slurm_id
            # its first PENDING reason waits SLURM_REASON_S too: most jobs of a short
            # queue start before, and a record less per job is an fsync less
            att.slurm_reason_at = time.monotonic()
            self.pending[slurm_id] = att
            log.info("job %s attempt %s: Slurm job %s", att.job_id, att.attempt, slurm_id)
            self.kick()

    def alive(self, att):
        """True while Slurm has not said the job ended (its `exit` file). The output file
        appears when the job starts on its node: then squeue is asked at once instead of
        at the end of its backoff."""
        if att.submitting:
            return True
        if att.slurm_id is None or att.slurm_id not in self.pending:
            return False
        if not att.started and not att.log_seen and os.path.exists(att.file("log")):
            att.log_seen = True
            self.kick()
        return True

    def enforce_cancel(self, att, cancel):
        """scancel: SIGTERM to every step of a running job, SIGKILL once the grace period
        is over; a job still pending is cancelled at once. -> True once Slurm says it
        ended (or it was never submitted)."""
        if att.submitting:
            return False                # cancelled once sbatch has answered
        slurm_id = att.slurm_id
        if slurm_id is None or slurm_id not in self.pending:
            return True
        if not att.term_sent:
            att.term_sent = True
            mark_stop_sent(att, cancel)     # Slurm ends it: whatever its exit code says
            if att.started:
                self.slurm.scancel(slurm_id, "TERM")
            else:
                self.slurm.scancel(slurm_id)
            self.kick()
        elif not att.killed and now_ms() - (cancel.get("stop_at") or
                                            cancel.get("requested_at", 0)) >= \
                self.kill_grace_s * 1000:
            att.killed = True
            log.info("job %s attempt %s: Slurm job %s still there after SIGTERM; SIGKILL",
                     att.job_id, att.attempt, slurm_id)
            self.slurm.scancel(slurm_id, "KILL")
            self.slurm.scancel(slurm_id)
            self.kick()
        return False

    def due(self, now):
        # a poll with the submitters wakes the runner when it answers
        return self.next_poll if self.pending and not self._polling else now + IDLE_WAKE_S

    def poll(self, now):
        """When due, one squeue for every job not yet ended, run by a submitter thread
        (the runner goes on tailing meanwhile); collect() applies what it found."""
        self.collect()
        if not self.pending or now < self.next_poll or self._polling:
            return
        self._polling = True
        with self._ready:
            self._submits.append((None, set(self.pending)))
            self._ready.notify()
        if not self._threads:
            self.warm()

    def _query(self, ids):
        """(submitter thread) -> {id: state} from squeue, and sacct for the ones it
        forgot; SlurmError when Slurm cannot be asked."""
        found = self.slurm.states(ids)
        missing = ids - set(found)
        if missing:
            found.update(self.slurm.accounting(missing))
        return found

    def _apply(self, ids, found, err):
        """(runner thread) write `pid` when Slurm runs a job, `exit` when it ends; report a
        PENDING reason when it changes (a change within SLURM_REASON_S of the submit or of
        the last report waits for a later poll: a queue's reasons flap between Priority
        and Resources)."""
        now = time.monotonic()
        self._polling = False
        if err is not None:
            self.failures += 1
            if self.failures in (1, 10) or self.failures % 100 == 0:
                log.warning("cannot read Slurm's job states (%d tries): %s", self.failures,
                            err)
            self.next_poll = now + SLURM_POLL_MAX_S
            return
        self.failures = 0
        changed = False
        for slurm_id in ids:
            att = self.pending.get(slurm_id)
            if att is None:
                continue
            info = found.get(slurm_id)
            unknown = info is None
            if unknown:
                # neither slurmctld nor accounting knows it: gone with its exit status
                info = {"state": "NODE_FAIL", "node": "", "exit_code": None, "signal": None,
                        "reason": ""}
                log.warning("job %s attempt %s: Slurm job %s is unknown to squeue and sacct",
                            att.job_id, att.attempt, slurm_id)
            state = info["state"]
            if state in SLURM_STARTED and att.pid_info is None:
                att.pid_info = {"pid": None, "slurm_job_id": slurm_id, "node": info["node"],
                                "started_at": now_ms()}
                _write_quick(att.file("pid"), att.pid_info)
                att.started = True
                changed = True
            if state in SLURM_FINAL:
                end = slurm_end(info, read_json(att.file("cancel")))
                if unknown:
                    end["message"] = (f"Slurm job {slurm_id} is known neither to squeue nor "
                                      "to sacct (purged while the agent was away?); "
                                      "retried as a new attempt")
                _write_quick(att.file("exit"), end)
                del self.pending[slurm_id]
                changed = True
            elif state == "PENDING" and info["reason"] != att.slurm_reason and \
                    (att.slurm_reason_at is None or now - att.slurm_reason_at >= SLURM_REASON_S):
                att.slurm_reason, att.slurm_reason_at = info["reason"], now
                if self.report:
                    self.report(att, info["reason"])
                changed = True
        self.poll_s = SLURM_POLL_MIN_S if changed else min(SLURM_POLL_MAX_S, self.poll_s * 2)
        self.next_poll = now + self.poll_s


# ---------------------------------------------------------------------------------------
# hooks of a running attempt: log tail, TensorBoard, checkpoints
# ---------------------------------------------------------------------------------------

class LogTail:
    """Turns new bytes of the attempt's log into `log` records. -> poll() says whether it
    found anything, so the runner can look less often at a quiet log."""

    def __init__(self, att):
        self.att = att
        self.offset, self.line_no, self.skip = 0, 0, False

    def load(self, st):
        self.offset = int(st.get("offset", 0))
        self.line_no = int(st.get("line_no", 0))
        self.skip = bool(st.get("skip", False))

    def poll(self, emit, at_eof, max_bytes):
        path = self.att.file("log")
        try:
            size = os.path.getsize(path)
        except OSError:
            return False
        if self.offset >= size:
            return False
        with open(path, "rb") as f:
            f.seek(self.offset)
            # never less than a longest line: each poll consumes something until the end
            data = f.read(min(size - self.offset, max(max_bytes, LINE_MAX + 2)))
        reached_end = self.offset + len(data) >= size
        items, consumed, skip = split_log(data, self.skip, at_eof and reached_end)
        self._emit(emit, items)
        self.offset += consumed
        self.skip = skip
        return consumed > 0

    def _emit(self, emit, items):
        att, base, ts = self.att, self.offset, now_ms()
        chunk, size = [], 0
        for i, (raw, end, skip_after) in enumerate(items):
            self.line_no += 1
            text = raw.decode("utf-8", "replace")
            chunk.append([self.line_no, ts, text])
            size += len(text) + 32
            if len(chunk) >= LOG_RECORD_LINES or size >= LOG_RECORD_BYTES or i == len(items) - 1:
                emit("log", {"job_id": att.job_id, "attempt": att.attempt, "lines": chunk},
                     {"key": att.key, "offset": base + end, "line_no": self.line_no,
                      "skip": skip_after}, size)
                chunk, size = [], 0


# -- whose file is it (docs/tensorboard.md, "Whose file is it") ---------------------------
#
# A file under a folder an attempt watches is that attempt's only on evidence, in order:
#   1. a process of the attempt holds it open for writing (a TensorBoard writer keeps its
#      event file open; a big torch.save takes seconds) -- or a neighbour's process does;
#   2. the event file's name: `events.out.tfevents.<time>.<host>[.<pid>.<n>]` (torch and
#      TensorFlow write the pid; tensorboardX only the host): a time before the attempt
#      started is never it; a container attempt's own hostname (gp-<job>-<attempt>) is
#      it; a pid of its process tree (or its session) is it, a neighbour's is not;
#   3. with no such evidence: written after it started, and no neighbour -- another
#      attempt of this node alive while the file was written, whose folders hold it --
#      could have written it.
# Otherwise nobody is sure: the file is not read for the attempt, and one warning event
# says which and how to give each job a folder of its own.

OWN, OTHER, UNKNOWN = "own", "other", "unknown"
_TB_NAME = re.compile(r"tfevents\.(\d{9,11})\.(.+?)(?:\.(\d+)\.(\d+))?(?:\.v2)?$")
LOCAL_HOST = socket.gethostname()


def tb_name_facts(name):
    """-> (time_s, host, pid) from an event file's name; None for what it does not say."""
    m = _TB_NAME.search(name)
    if not m:
        return None, None, None
    return int(m.group(1)), m.group(2), int(m.group(3)) if m.group(3) else None


def container_hostname(job_id, attempt):
    """The hostname a container attempt runs under: the event files it writes say it."""
    return f"gp-{int(job_id)}-{int(attempt)}"


class Writers:
    """The evidence of which files one attempt's processes wrote (above): its process
    tree, the files they hold open for writing, its container's hostname, its lifetime
    and folders. `neighbours()` (set by the runner) -> the Writers of this node's other
    attempts that may matter: running, or ended since this one started."""

    def __init__(self, att):
        self.att = att
        self.start_s = att.received_at / 1000.0      # before it, none of its processes ran
        self.ended_s = None
        self.hostname = container_hostname(att.job_id, att.attempt) if att.container else None
        self.pids = {}            # pid -> create_time of every process of the tree seen
        self.sid = None           # the job's session (the shim starts it with setsid)
        self.open = set()         # real paths its processes held open for writing
        self.sampled = 0.0        # monotonic time of the last sample
        self.neighbours = lambda: []
        roots = {att.resolve(r) for r in (att.working_dir, att.tb_dir, att.watch_dir)}
        self.roots = tuple(sorted(_real(r) for r in roots if r))

    def sharers(self, real):
        """Job ids of the neighbours whose folders hold `real` (for the warnings)."""
        return sorted({n.att.job_id for n in self.neighbours()
                       if n is not self and n.covers(real)})

    def covers(self, real):
        return any(real == r or real.startswith(r.rstrip("/") + "/") for r in self.roots)

    def alive_during(self, first_s, last_s, slack_s):
        end = self.ended_s if self.ended_s is not None else float("inf")
        return self.start_s - slack_s <= last_s and first_s <= end + slack_s

    def sample(self, force=False, if_shared=False):
        """Refresh the tree and its open files (at most every WRITERS_FRESH_S); with
        if_shared, only while a neighbour shares a folder (the runner's loop: evidence
        gathered while the processes live, for the files decided later)."""
        now = time.monotonic()
        if self.ended_s is not None or (not force and now - self.sampled < WRITERS_FRESH_S):
            return
        if if_shared and not self.shared():
            self.sampled = now
            return
        self.sampled = now
        info = self.att.pid() or {}
        pid = info.get("pid")
        if not pid or self.att.container or self.att.slurm_id is not None:
            return            # a Slurm or container job's processes are not ours to see
        self.sid = pid
        # the command's own pid is known from its pid file even once it has exited (a
        # short job can end before any sample): a name that says it is evidence
        self.pids.setdefault(pid, info.get("create_time"))
        for p, ct in list(self.pids.items()):
            if not proc_alive(p, ct):
                continue
            try:
                for c in psutil.Process(p).children(recursive=True):
                    self.pids[c.pid] = c.create_time()
            except psutil.NoSuchProcess:
                continue
            self.open |= _written_files(p, self.roots)

    def shared(self):
        """Whether a neighbour's folders overlap this attempt's (then samples matter)."""
        return any(n is not self and any(n.covers(r) or self.covers(r) for r in n.roots)
                   for n in self.neighbours())

    def owner(self, path, mtime_s, name_facts=(None, None, None)):
        """-> OWN, OTHER or UNKNOWN for the file at `path` last written at `mtime_s`."""
        real = _real(path)
        born_s, host, pid = name_facts
        first_s = min(born_s, mtime_s) if born_s is not None else mtime_s
        # a name's time is whole seconds; an mtime is the kernel's coarse clock
        slack_s = WRITERS_SLACK_S if born_s is not None else MTIME_SLACK_S
        if mtime_s < self.start_s - MTIME_SLACK_S or (
                born_s is not None and born_s + WRITERS_SLACK_S < self.start_s):
            return OTHER          # it was there before this attempt started
        others = [n for n in self.neighbours() if n is not self]
        sharing = [n for n in others
                   if n.covers(real) and n.alive_during(first_s, mtime_s, slack_s)]
        if host is not None:
            if self.hostname is not None and host == self.hostname:
                return OWN
            if any(n.hostname == host for n in others):
                return OTHER
        if not sharing:
            return OWN            # nobody else could have written it
        self.sample()
        for n in sharing:
            n.sample()
        if real in self.open:
            return OWN
        if any(real in n.open for n in sharing):
            return OTHER
        if host == LOCAL_HOST and pid is not None:
            if pid in self.pids or (self.sid is not None
                                    and _session_of(pid) == self.sid):
                return OWN
            if any(pid in n.pids for n in sharing):
                return OTHER
        return UNKNOWN


def _real(path):
    try:
        return os.path.realpath(path)
    except (OSError, ValueError):
        return os.path.abspath(path)


def _session_of(pid):
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _written_files(pid, roots):
    """Real paths under `roots` that process `pid` holds open for writing (Linux /proc;
    elsewhere, or for a process of another user, nothing)."""
    out = set()
    base = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(base)
    except OSError:
        return out
    for fd in fds[:WRITERS_MAX_FDS]:
        try:
            target = os.readlink(f"{base}/{fd}")
        except OSError:
            continue
        if not target.startswith("/") or not any(
                target == r or target.startswith(r.rstrip("/") + "/") for r in roots):
            continue
        try:
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = next((int(line.split()[1], 8) for line in f
                              if line.startswith("flags:")), 0)
        except (OSError, ValueError, IndexError):
            continue
        if flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR):
            out.add(target)
    return out


def content_fingerprint(path, size):
    """A cheap fingerprint of a checkpoint file's bytes: its size and its first and last
    64 KiB (a rewrite of a checkpoint changes both ends: header and tensors); for a
    checkpoint directory, None (its signature says what it holds)."""
    import hashlib
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    try:
        with open(path, "rb") as f:
            h.update(f.read(65536))
            if size > 131072:
                f.seek(size - 65536)
            h.update(f.read(65536))
    except OSError:
        return None
    return h.hexdigest()


class TensorBoardHook:
    """Tails the attempt's TensorBoard event files (TBTailer) into `metrics` records."""

    def __init__(self, att):
        self.att = att
        self.offsets = {}
        self.tailer = None
        self.warned = False
        self.refused = 0       # points left out (see _fit)
        self.unattributed = set()   # event files said to be skipped (one event each)

    def poll(self, emit, final=False):
        """-> True when a poll returned a full batch (more is waiting)."""
        att = self.att
        root = att.resolve(att.tb_dir or att.working_dir)
        if not root or not os.path.isdir(root):
            return False
        if self.tailer is None:
            why = walk_root_refused(root)
            if why:
                if not self.warned:
                    self.warned = True
                    log.warning("job %s attempt %s: not tailing TensorBoard files under %s: "
                                "%s; give the job a tb_dir of its own", att.job_id,
                                att.attempt, root, why)
                return False
            self.tailer = TBTailer(root, att.received_at / 1000.0, dict(self.offsets),
                                   owner=att.writers.owner)
        # After the exit: look for files written since the last walk.
        points = self._fit(self.tailer.poll(rescan=final))
        self._say_unattributed(emit, final)
        n = TB_RECORD_POINTS
        for i in range(0, len(points), n):
            chunk = [[k, int(s), float(v), int(ts)] for k, s, v, ts in points[i:i + n]]
            last = i + n >= len(points)
            # offsets ride on the last chunk only: a crash in between re-reads the poll,
            # and the server's (run, key, step) upsert absorbs the repeat
            emit("metrics", {"run_id": att.run_id, "source": "tb", "points": chunk},
                 {"key": att.key, "tb": dict(self.tailer.offsets)} if last else None,
                 len(chunk) * 40)
        self.offsets = dict(self.tailer.offsets)
        return len(points) >= self.tailer.max_points

    def _say_unattributed(self, emit, final):
        """One warning event per event file left unread because nobody knows whose it is
        (Writers): at the attempt's end, or once it has waited TB_UNDECIDED_S."""
        att, now = self.att, time.monotonic()
        for rel, since in sorted(self.tailer.undecided.items()):
            if rel in self.unattributed or not (final or now - since >= TB_UNDECIDED_S):
                continue
            self.unattributed.add(rel)
            path = os.path.join(self.tailer.root, rel)
            jobs = att.writers.sharers(_real(path))
            emit("event", {
                "type": "FILE_NOT_ATTRIBUTED", "severity": "warning", "run_id": att.run_id,
                "job_id": att.job_id,
                "message": f"{path} was not read for run {att.run_id}: "
                           f"job{'s' if len(jobs) != 1 else ''} "
                           f"{', '.join(map(str, jobs)) or '(ended)'} ran in the same "
                           "folder and nothing shows which process wrote it; give each job "
                           "a TensorBoard folder of its own (--tb-dir tb/{job})",
                "data": {"path": path, "folder": self.tailer.root, "jobs": jobs}},
                None, 0)

    def _fit(self, points):
        """The points the server takes; one it would refuse (a tag over 512 characters,
        a negative step) is counted and left out here, never the rest of its record."""
        bad = [p for p in points if not p[0] or len(p[0]) > TB_MAX_KEY_CHARS or p[1] < 0]
        if not bad:
            return points
        self.refused += len(bad)
        log.warning("job %s attempt %s: %d TensorBoard points not sent (%d so far): a tag "
                    "over %d characters or a negative step, e.g. %r at step %s; the other "
                    "points are sent", self.att.job_id, self.att.attempt, len(bad),
                    self.refused, TB_MAX_KEY_CHARS, bad[0][0][:60], bad[0][1])
        bad_ids = set(map(id, bad))
        return [p for p in points if id(p) not in bad_ids]


def walk_root_refused(root, agent_home=None):
    """Why a directory the agent would walk for a job (TensorBoard files, checkpoints) is
    refused as its root, or None: never a whole filesystem, a home directory or the
    agent's own home, so one job's settings cannot make the agent walk everything."""
    try:
        real = os.path.realpath(root)
    except (OSError, ValueError):
        return "it cannot be resolved"
    if real == "/":
        return "walking a whole filesystem is refused"
    if real == os.path.realpath(os.path.expanduser("~")):
        return "walking a whole home directory is refused"
    home = agent_home or AGENT_HOME or os.environ.get("GPUCTL_HOME")
    if home and real == os.path.realpath(home):
        return "walking the agent's home is refused"
    return None


# -- checkpoints ---------------------------------------------------------------------------
#
# A watch dir is scanned every CKPT_INTERVAL_S (or less often: a scan never takes more than
# 1 % of the time between scans). An entry is a checkpoint when its name says so (below);
# it is registered once its signature (size + mtime; for a directory: file count, total
# size and newest mtime of what is inside) is the same on two scans in a row, or on the
# final scan after the job's process is gone (nothing writes it any more).

_CKPT_HF_DIR = re.compile(r"^checkpoint-(\d+)$")
_CKPT_FORMATS = {"safetensors": "safetensors", "ckpt": "lightning", "pth": "pt", "pt": "pt",
                 "keras": "keras", "h5": "keras"}


def checkpoint_format(name, is_dir):
    """-> the format of a checkpoint named `name`, or None when it is not one (names
    ending in .tmp, .partial, .lock, ... have another last extension)."""
    if name.startswith("."):
        return None
    if is_dir:
        return "hf" if _CKPT_HF_DIR.match(name) else None
    return _CKPT_FORMATS.get(name.rpartition(".")[2])


def checkpoint_step(name):
    """-> (step, epoch) parsed from a checkpoint's name; None where the name does not say.

    `epoch=3-step=1200.ckpt` (Lightning), `checkpoint-500` (Hugging Face), `model_step1500.pt`,
    `ckpt-1500.pt`, `epoch_3.pt`. Numbers that belong to something else (`val_loss=0.12`)
    are not a step.
    """
    stem, _dot, ext = name.rpartition(".")
    if ext not in _CKPT_FORMATS:
        stem = name
    m = _CKPT_HF_DIR.match(stem)
    if m:
        return int(m.group(1)), None
    s = re.search(r"(?:global_step|step|iter|it)[=_-]?(\d+)(?![\d.])", stem, re.I)
    e = re.search(r"epoch[=_-]?(\d+)(?![\d.])", stem, re.I)
    step = int(s.group(1)) if s else None
    epoch = float(e.group(1)) if e else None
    if step is None and epoch is None and "=" not in stem:
        m = re.search(r"[-_](\d+)$", stem)       # ckpt-1500, model_0003
        step = int(m.group(1)) if m else None
    return step, epoch


class CheckpointHook:
    """The debounced checkpoint watcher of one attempt."""

    def __init__(self, att, interval_s=CKPT_INTERVAL_S):
        self.att = att
        self.interval_s = interval_s
        self.done = {}        # path -> fingerprint registered
        self.seen = {}        # path -> (signature, format, size) at the last scan
        self.next_scan = 0.0
        self.skipped = None   # why the watch dir is not scanned (logged once per reason)
        self.truncated = False
        self.shared = None    # the event said the folder is shared (its path), once

    def load(self, done):
        self.done = dict(done)

    def poll(self, emit, final=False):
        att = self.att
        if not att.watch_dir:
            return
        now = time.monotonic()
        if not final and now < self.next_scan:
            return
        root = self._root()
        if root is None:
            return
        began = time.process_time()
        found = self.scan(root)
        took = time.process_time() - began
        # at most 1 % of a core, whatever the tree
        self.next_scan = time.monotonic() + max(self.interval_s, 100 * took)
        unknown = []
        for path in sorted(found):
            sig, fmt, size, mtime_ns = found[path]
            stable = self.seen.get(path, (None,))[0] == sig
            if (stable or final) and self.done.get(path) != sig:
                # decided once per version of the file: a rewrite is looked at again
                self.done[path] = sig
                who = att.writers.owner(path, mtime_ns / 1e9)
                if who != OWN:
                    if who == UNKNOWN:
                        unknown.append(path)
                    continue
                step, epoch = checkpoint_step(os.path.basename(path))
                emit("checkpoint", {
                    "run_id": att.run_id, "path": path, "step": step, "epoch": epoch,
                    "step_source": "name" if step is not None else "latest",
                    "size_bytes": size, "fingerprint": sig, "format": fmt,
                    "mtime_ns": mtime_ns,
                    "content": sig if fmt == "hf" else content_fingerprint(path, size)},
                    {"key": att.key, "ckpt": dict(self.done)}, 0)
        self.seen = found
        if unknown and self.shared is None:
            self._say_shared(emit, root, unknown)

    def _say_shared(self, emit, root, unknown):
        """One warning event: checkpoints under a folder another running job watches too
        were not registered, since nothing shows which job wrote them."""
        att = self.att
        self.shared = root
        jobs = att.writers.sharers(_real(unknown[0]))
        emit("event", {
            "type": "CHECKPOINT_FOLDER_SHARED", "severity": "warning", "run_id": att.run_id,
            "job_id": att.job_id,
            "message": f"{len(unknown)} checkpoint{'s' if len(unknown) != 1 else ''} under "
                       f"{root} (e.g. {os.path.basename(unknown[0])}) not registered for "
                       f"run {att.run_id}: job{'s' if len(jobs) != 1 else ''} "
                       f"{', '.join(map(str, jobs)) or '(ended)'} watch the same folder "
                       "and nothing shows which job wrote them; give each job a folder of "
                       "its own (--watch checkpoints/{run} and the same in its command)",
            "data": {"folder": root, "files": unknown[:20], "jobs": jobs}}, None, 0)

    def _root(self):
        att = self.att
        root = att.resolve(att.watch_dir)
        why = None
        if root is None:
            why = "the job has no working dir to resolve it against"
        else:
            try:
                real = os.path.realpath(root, strict=True)
            except OSError as e:
                real = None
                why = ("it is a symlink loop" if e.errno == errno.ELOOP
                       else "it does not exist (yet)")
            if real is not None:
                if not os.path.isdir(real):
                    why = "it is not a directory"
                elif walk_root_refused(real):
                    why = walk_root_refused(real)
        if why != self.skipped:
            if why:
                log.warning("job %s attempt %s: not watching %r for checkpoints: %s",
                            att.job_id, att.attempt, att.watch_dir, why)
            self.skipped = why
        return None if why else root

    def scan(self, root):
        """-> {absolute path: (signature, format, size, mtime_ns)} of the checkpoints under root,
        bounded in depth and entries."""
        found, budget = {}, [CKPT_MAX_ENTRIES]
        formats = _CKPT_FORMATS
        stack = [(root, 0)]
        while stack and budget[0] > 0:
            d, depth = stack.pop()
            try:
                it = os.scandir(d)
            except OSError:
                continue
            with it:
                for e in it:
                    budget[0] -= 1
                    if budget[0] < 0:
                        if not self.truncated:
                            log.warning("job %s attempt %s: more than %d entries under %s; "
                                        "checkpoint scans stop there", self.att.job_id,
                                        self.att.attempt, CKPT_MAX_ENTRIES, root)
                            self.truncated = True
                        break
                    name = e.name
                    try:
                        is_dir = e.is_dir(follow_symlinks=False)
                        if not is_dir:
                            fmt = formats.get(name.rpartition(".")[2])
                            if fmt and name[0] != "." and e.is_file(follow_symlinks=False):
                                st = e.stat(follow_symlinks=False)
                                found[e.path] = (f"{st.st_size}-{st.st_mtime_ns}", fmt,
                                                 st.st_size, st.st_mtime_ns)
                            continue
                        fmt = checkpoint_format(name, True)
                        if fmt == "hf":
                            sig, size, newest = self._dir_signature(e.path)
                            found[e.path] = (sig, fmt, size, newest)
                        else:
                            # HF writes tmp-checkpoint-N/ and renames it when complete
                            if depth < CKPT_MAX_DEPTH and not e.name.startswith(".") \
                                    and e.name not in _TB_SKIP_DIRS \
                                    and not e.name.startswith("tmp-checkpoint-"):
                                stack.append((e.path, depth + 1))
                    except OSError:
                        continue
        return found

    def _dir_signature(self, path):
        """(count-size-newest mtime, total size, newest mtime) of the files in a checkpoint
        directory."""
        count = size = newest = 0
        stack, budget = [path], CKPT_DIR_MAX_ENTRIES
        while stack and budget > 0:
            try:
                it = os.scandir(stack.pop())
            except OSError:
                continue
            with it:
                for e in it:
                    budget -= 1
                    if budget < 0:
                        break
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            st = e.stat(follow_symlinks=False)
                            count += 1
                            size += st.st_size
                            newest = max(newest, st.st_mtime_ns)
                    except OSError:
                        continue
        return f"dir:{count}-{size}-{newest}", size, newest


# ---------------------------------------------------------------------------------------
# runner: start, watch, cancel and re-adopt job attempts
# ---------------------------------------------------------------------------------------
#
# One thread, the runner's, owns every Attempt and does all of the file work (launching,
# tailing, TensorBoard parsing, checkpoint scans). Other threads hand it commands through
# a queue and read a small published view (`Runner.view`) under a lock that is only ever
# held to swap a dict: the connection thread never waits for a file or a parse.


class AttemptDirs:
    """agent/jobs/<job>/<attempt>/ on disk: which attempts this host knows, which have
    their final record out, and removing the files of old ones."""

    def __init__(self, jobs_dir):
        self.root = jobs_dir
        make_private_dirs(jobs_dir)

    def path(self, job_id, attempt):
        return os.path.join(self.root, str(int(job_id)), str(int(attempt)))

    def known(self):
        out = []
        for job in os.listdir(self.root):
            jdir = os.path.join(self.root, job)
            if not job.isdigit() or not os.path.isdir(jdir):
                continue
            for att in os.listdir(jdir):
                if att.isdigit() and os.path.isdir(os.path.join(jdir, att)):
                    out.append((int(job), int(att)))
        return sorted(out)

    def reported(self, job_id, attempt):
        return os.path.exists(os.path.join(self.path(job_id, attempt), "reported"))

    def remove_old(self, retention_days, skip=(), now=None):
        """Delete the files of attempts reported more than `retention_days` ago; the
        directory stays with its `reported` record so a repeated start is still refused."""
        if not retention_days or retention_days <= 0:
            return 0
        cutoff = (now or time.time()) - retention_days * 86400
        removed = 0
        for job_id, attempt in self.known():
            path = self.path(job_id, attempt)
            if f"{job_id}/{attempt}" in skip:
                continue
            try:
                if os.stat(os.path.join(path, "reported")).st_mtime > cutoff:
                    continue
                names = [n for n in os.listdir(path) if n != "reported"]
            except OSError:
                continue
            for name in names:
                p = os.path.join(path, name)
                try:
                    if os.path.isdir(p) and not os.path.islink(p):
                        shutil.rmtree(p)
                    else:
                        os.unlink(p)
                except OSError as e:
                    log.warning("retention: cannot remove %s: %s", p, e)
            if names:
                removed += 1
                log.info("retention: removed the files of job %s attempt %s", job_id, attempt)
        return removed


JOB_RECORD_FIELDS = ("job_id", "attempt", "state", "pid", "exit_code", "signal",
                     "failure_kind", "message")


class Reporter:
    """The records an attempt puts in the outbox, and the cap on how many of its log and
    metric bytes may wait there unacked (the server may be away; the job's own files keep
    the rest)."""

    def __init__(self, outbox, backlog_max_bytes):
        self.outbox = outbox
        self.backlog_max_bytes = backlog_max_bytes
        self.held_back = False            # an attempt waits for acks (its backlog is full)

    def emitter(self, att):
        def emit(kind, fields, state, nbytes):
            seq = self.outbox.append(kind, fields, att=state)
            if nbytes:
                att.inflight.append((seq, nbytes))
        return emit

    def room(self, att):
        """Bytes this attempt may still read into the spool."""
        room = self.backlog_max_bytes - att.backlog(self.outbox.acked)
        if room <= 0:
            self.held_back = True
        return min(LOG_READ_BYTES, max(room, 0))

    @staticmethod
    def job_record(att, state, exit_info=None, kind=None, message=None):
        """A `job` record (docs/protocol.md): RUNNING, or EXITED with how it ended."""
        exit_info = exit_info or {}
        return {"job_id": att.job_id, "attempt": att.attempt, "state": state,
                "pid": (att.pid() or {}).get("pid"), "exit_code": exit_info.get("exit_code"),
                "signal": exit_info.get("signal"), "failure_kind": kind, "message": message}

    def running(self, att):
        rec = self.job_record(att, "RUNNING")
        if att.slurm_id is not None:
            rec["slurm_job_id"] = att.slurm_id
        if att.resumed_from is not None:
            rec["resumed_from"] = att.resumed_from
        self.outbox.append("job", rec, att={"key": att.key, "running": True},
                           hold_s=RUNNING_HOLD_S)
        att.running_reported = True
        if not att.scrubbed:
            scrub_start_record(att.file("spec.json"))
            att.scrubbed = True

    def queued_in_slurm(self, att, reason):
        """Slurm holds the job PENDING (and why): the server shows it queued in Slurm."""
        self.outbox.append("job", dict(self.job_record(att, "PENDING", message=reason),
                                       slurm_job_id=att.slurm_id))

    def final(self, att, kind, message, exit_info):
        rec = self.job_record(att, "EXITED", exit_info, kind, message)
        self.outbox.append("job", dict(rec), att={"key": att.key, "final": True,
                                                  "record": rec})
        # Not fsynced: the EXITED record is what counts. When a power cut takes the marker
        # and leaves the record, adopt() writes the marker again from the record's `final`
        # state; when it leaves the marker and takes the record (not yet sent: records go
        # out once fsynced), sync lists the attempt as ended and the server ends it LOST,
        # to be retried.
        write_json_atomic(att.file("reported"), rec, sync=False)
        att.writers.ended_s = time.time()
        # the marker now says how it ended (adopt reads it): state.json need not carry this
        # attempt, so its size stays that of the attempts still running
        self.outbox.forget(att.key)
        att.final = True
        return rec

    def again(self, path):
        """A start or cancel for an attempt that has ended: say how it ended once more."""
        rec = read_json(os.path.join(path, "reported"))
        if rec:
            fields = {k: rec[k] for k in JOB_RECORD_FIELDS if k in rec}
            self.outbox.append("job", fields)


# How attempts run, by kind (the interface: the launcher section). In order: the first a
# runner has that takes a start runs it; a runner has each whose for_runner() gives one.
LAUNCHERS = {"slurm": SlurmLauncher, "docker": DockerLauncher, "process": ProcessLauncher}


class Runner(Worker):
    name = "gpuplane-agent-runner"
    interval = RUNNER_ERROR_WAIT_S      # tick() says when it is due; this only after a failure

    def __init__(self, agent_dir, outbox, kill_grace_s=KILL_GRACE_S, server_url=None,
                 hook_interval_s=HOOK_INTERVAL_S, secrets=(),
                 backlog_max_bytes=BACKLOG_MAX_BYTES, retention_days=DEFAULT_RETENTION_DAYS,
                 ckpt_interval_s=CKPT_INTERVAL_S, docker=None, slurm=None, run_as=None):
        super().__init__()
        self.run_as = run_as               # (name, uid, gid, home, setpriv) or None
        self.docker = docker or Docker(socket.gethostname())
        self.jobs_dir = os.path.join(agent_dir, "jobs")
        self.dirs = AttemptDirs(self.jobs_dir)
        self.outbox = outbox
        self.reporter = Reporter(outbox, backlog_max_bytes)
        self.server_url = server_url
        self.hook_interval_s = hook_interval_s
        self.ckpt_interval_s = ckpt_interval_s
        self.secrets = tuple(s for s in secrets if s)
        self.inherited_env = inherited_environment(self.secrets)   # read once: it is fixed
        self.retention_days = retention_days
        self.slurm = slurm                 # a Slurm: every start is an sbatch (--runner slurm)
        self.kill_grace_s_setting = kill_grace_s
        # the launchers this agent has, in the table's order (the first that takes a
        # start runs it)
        self.launchers = {}
        for kind, cls in LAUNCHERS.items():
            launcher = cls.for_runner(self)
            if launcher is not None:
                self.launchers[kind] = launcher
        self._commands = collections.deque()
        self.lock = threading.Lock()       # guards only `view`: held to read or swap it
        self.view = {}                     # key -> facts of an attempt not finally reported
        self.active = {}                   # key -> Attempt (the runner thread's own)
        self._writers = []                 # Writers of the attempts that may matter (below)
        self._next_retention = 0.0
        self._in_commands = False
        self._look_all = False
        outbox.ack_listeners.append(self._on_ack)
        self.adopt()

    @property
    def kill_grace_s(self):
        return self.kill_grace_s_setting

    @property
    def launcher(self):
        """The agent's own launcher: the last of the table it has (the shim's, or Slurm's)."""
        return list(self.launchers.values())[-1]

    def launcher_for(self, start):
        """The launcher that runs this start: the first of the table that takes it."""
        return next(l for l in self.launchers.values() if l.takes(start))

    def launcher_of(self, att):
        """The launcher that ran an attempt (spec.json's record of it), else the agent's."""
        return self.launchers.get(att.launcher_kind) or self.launcher

    # -- start-up ------------------------------------------------------------------------

    def adopt(self):
        """Re-adopt every attempt whose final state was never put in the outbox."""
        for job_id, attempt in self.known():
            key = f"{job_id}/{attempt}"
            path = self.dirs.path(job_id, attempt)
            st = self.outbox.attempt_state(key)
            if os.path.exists(os.path.join(path, "reported")):
                self.outbox.forget(key)
                continue
            if st.get("final"):
                # the final record made it into the outbox; only the marker is missing
                write_json_atomic(os.path.join(path, "reported"), st.get("record", {}),
                                  private=True)
                continue
            att = self._new_attempt(job_id, attempt, path)
            att.load_state(st)
            att.launcher = self.launcher_of(att)
            att.launcher.adopt(att)
            self.active[key] = att
            log.info("re-adopting job %s attempt %s (log offset %d, line %d)",
                     job_id, attempt, att.log.offset, att.log.line_no)
        self._publish()
        for launcher in self.launchers.values():
            launcher.clean(self.active)        # leftovers of attempts no longer here

    def known(self):
        return self.dirs.known()

    def remove_old_attempts(self, now=None):
        return self.dirs.remove_old(self.retention_days, skip=set(self.active), now=now)

    def _rereport(self, key, path):
        att = self.active.get(key)
        if att is not None:
            if att.running_reported and att.pid():
                self.reporter.running(att)
            return
        self.reporter.again(path)
        log.info("start for known attempt %s: re-reported its state", key)

    def _new_attempt(self, job_id, attempt, path, spec=None):
        att = Attempt(job_id, attempt, path, spec)
        att.ckpt.interval_s = self.ckpt_interval_s
        att.writers.neighbours = self._writers_near
        self._writers.append(att.writers)
        att.next_hook = time.monotonic() + min(FIRST_HOOK_S, self.hook_interval_s)
        return att

    # -- commands (any thread) -------------------------------------------------------------

    def submit(self, msg, wait=False):
        """Queue a start or cancel from the server; the runner thread acts on it at once.
        wait=True returns once it has (for tests and tools, never the connection)."""
        done = threading.Event() if wait else None
        self._commands.append((msg, done))
        self._wake.set()
        if done is not None:
            done.wait(60)

    def handle_start(self, msg, wait=False):
        self.submit(dict(msg, type="start"), wait)

    def handle_cancel(self, msg, wait=False):
        self.submit(dict(msg, type="cancel"), wait)

    def stop(self, timeout=10.0):
        super().stop(timeout)
        for launcher in self.launchers.values():
            launcher.close()        # after the join: no launch is under way

    # -- the loop (runner thread) ----------------------------------------------------------

    def begin(self):
        for launcher in self.launchers.values():
            try:
                launcher.warm()
            except OSError as e:    # the first launch tries again
                log.error("cannot start the %s launcher: %s", launcher.kind, e)
        return 0.0

    def tick(self):
        """Commands, then every attempt that is due. -> seconds until something is due."""
        self._run_commands()
        now = time.monotonic()
        due = now + IDLE_WAKE_S
        for launcher in self.launchers.values():
            launcher.poll(now)
            due = min(due, launcher.due(now))
        look_all, self._look_all = self._look_all, False
        for key, att in list(self.active.items()):
            if not (look_all or att.poked or now >= att.due):
                due = min(due, att.due)     # nothing new of it: each look reads its files
                continue
            att.poked = False
            try:
                due = min(due, self._look(att))
            except Exception:
                log.exception("job %s attempt %s: watch failed", att.job_id, att.attempt)
                att.due = now + RUNNER_ERROR_WAIT_S
                due = min(due, att.due)
            if att.final:
                self.active.pop(key, None)
            self._run_commands()        # a start never waits behind another job's backlog
        self._publish()
        if now >= self._next_retention:
            self._next_retention = now + RETENTION_CHECK_S
            self.remove_old_attempts()
        return max(0.0, due - time.monotonic())

    def _run_commands(self):
        if self._in_commands:        # a start's own first look drains; no nesting
            return
        self._in_commands = True
        try:
            self._run_command_queue()
        finally:
            self._in_commands = False

    def _run_command_queue(self):
        ran = False
        while self._commands:
            msg, done = self._commands.popleft()
            ran = True
            try:
                if msg.get("type") == "cancel":
                    self._cancel(msg)
                elif msg.get("type") == "delete_checkpoints":
                    self._delete_checkpoints(msg)
                else:
                    self._start(msg)
            except Exception:
                log.exception("%s for job %s attempt %s failed", msg.get("type"),
                              msg.get("job_id"), msg.get("attempt"))
            finally:
                if done is not None:
                    done.set()
        if ran:
            self._publish()

    def _publish(self):
        view = {}
        for key, att in self.active.items():
            if att.final:
                continue
            info = att.pid_info or {}
            view[key] = {"job_id": att.job_id, "attempt": att.attempt, "run_id": att.run_id,
                         "pid": info.get("pid"), "create_time": info.get("create_time"),
                         "slurm_job_id": att.slurm_id,
                         "gpus": list(att.gpus), "working_dir": att.working_dir}
        with self.lock:
            self.view = view

    def _start(self, msg):
        job_id, attempt = int(msg["job_id"]), int(msg["attempt"])
        key = f"{job_id}/{attempt}"
        jdir = os.path.join(self.jobs_dir, str(job_id))
        path = os.path.join(jdir, str(attempt))
        make_private_dirs(jdir)
        try:
            os.mkdir(path, 0o700)       # the once-ever guard for (job_id, attempt)
        except FileExistsError:
            self._rereport(key, path)
            return
        msg = {k: v for k, v in msg.items() if k != "type"}
        msg["type"] = "start"
        if not msg.get("server_url"):
            msg["server_url"] = self.server_url
        env = job_environment(msg, self.inherited_env)
        spec = {"start": msg, "received_at": now_ms()}
        resume = pick_resume(msg.get("resume"))
        if resume is not None:
            env.update(resume_environment(resume))
            spec["resumed_from"] = resume["checkpoint_id"]
        launcher = self.launcher_for(msg)
        spec["launcher"] = launcher.kind
        try:
            for need in msg.get("require_paths") or []:
                if not os.path.exists(need):
                    raise ValueError(f"{need} does not exist on this host (deleted or moved?); "
                                     "nothing to run against")
            spec["exec"], more = launcher.exec_spec(msg, env, path)
            spec.update(more)
        except ValueError as e:
            spec["exec"] = None
            write_json_atomic(os.path.join(path, "spec.json"), spec, private=True)
            open(os.path.join(path, "log"), "ab", opener=_private_opener).close()
            write_exit(path, failure_kind="DISPATCH_FAILED", message=str(e))
            log.warning("job %s attempt %s not started: %s", job_id, attempt, e)
            packed = None
        else:
            packed = launcher.pack(spec["exec"])
            if packed is not None:
                # The shim gets the exec record in its message: spec.json goes without
                # secrets from the start (nothing to scrub once it runs), and without an
                # fsync: after a power cut nothing of the attempt runs, and one whose
                # spec.json is gone or torn ends LOST, to be retried.
                write_json_atomic(os.path.join(path, "spec.json"),
                                  without_secrets(spec) or spec, private=True, sync=False)
            else:
                # sbatch or the shim read the exec record from here (and a Slurm job
                # outlives a power cut of this host): kept whole until it runs
                write_json_atomic(os.path.join(path, "spec.json"), spec, private=True)
        att = self._new_attempt(job_id, attempt, path, spec)
        att.launcher = launcher
        att.scrubbed = packed is not None
        self.active[key] = att
        if spec["exec"] is not None:
            launcher.launch(att, spec["exec"], packed)
        self._look(att)
        if att.final:
            del self.active[key]

    def _delete_checkpoints(self, msg):
        """Checkpoint retention (docs/checkpoints.md): delete the files the server names,
        each only if it lies inside the job's working dir once every symlink on the way is
        resolved, and is not itself a symlink; report each as a `checkpoint_deleted`
        record (deleted with the bytes freed, or kept and why)."""
        working_dir = msg.get("working_dir")
        for f in msg.get("files") or []:
            deleted, freed, why = False, 0, None
            try:
                deleted, freed, why = delete_checkpoint_file(f["path"], working_dir)
            except OSError as e:
                why = f"cannot delete: {e.strerror or e}"
            self.outbox.append("checkpoint_deleted", {
                "run_id": f.get("run_id"), "checkpoint_id": f.get("checkpoint_id"),
                "path": f.get("path"), "deleted": deleted, "bytes_freed": freed,
                "reason": why})
            log.info("checkpoint %s %s%s", f.get("path"), "deleted" if deleted else "kept",
                     f": {why}" if why else "")

    def _cancel(self, msg):
        key = f"{int(msg['job_id'])}/{int(msg['attempt'])}"
        att = self.active.get(key)
        if att is None:
            path = self.dirs.path(msg["job_id"], msg["attempt"])
            if os.path.isdir(path):
                self._rereport(key, path)
            return
        if not os.path.exists(att.file("cancel")):
            record = {"requested_at": now_ms()}
            warn = msg.get("warn")      # a preemption: [signal, seconds] before the stop
            if isinstance(warn, list) and len(warn) == 2 and warn[1]:
                record.update(warn=warn, stop_at=record["requested_at"] + int(warn[1] * 1000))
            write_json_atomic(att.file("cancel"), record, private=True)
            log.info("cancelling job %s attempt %s%s", att.job_id, att.attempt,
                     f" (SIG{warn[0]} first, the stop {warn[1]} s later)"
                     if record.get("warn") else "")
        self._look(att)
        if att.final:
            del self.active[key]

    def _look(self, att):
        att.due = self._tick_attempt(att)
        return att.due

    def _tick_attempt(self, att):
        """Look at one attempt; -> monotonic time it wants looking at again."""
        now = time.monotonic()
        if att.draining or att.final:   # a cancel arriving while its backlog drains
            return now + RECHECK_S
        emit = self.reporter.emitter(att)
        if att.pid() and not att.running_reported:
            self.reporter.running(att)
        room = self.reporter.room(att)
        got_lines = False
        if att.pid():            # until the pid, lines wait: RUNNING comes before the first
            for _ in range(4):
                if not (room > 0 and att.log.poll(emit, False, room)):
                    break
                got_lines = True
                room = self.reporter.room(att)
        # hooks once the command runs: a Slurm job may wait in Slurm's queue for hours,
        # and a walk of its working dir for TensorBoard files is wasted until it starts
        if not att.final:
            att.writers.sample(if_shared=True)
        if now >= att.next_hook and room > 0 and att.run_id is not None and att.pid():
            att.next_hook = now + self.hook_interval_s
            self._hooks(att, emit)
        limit_due = self._time_limit(att) if att.time_limit_s else None
        cancel = read_json(att.file("cancel"))
        if cancel is not None and cancel.get("stop_at"):
            wait_s = self._warn_before_stop(att, cancel)
            if wait_s:
                return now + wait_s     # the job saves after its warning; the stop follows
        if cancel is not None and not att.launcher.enforce_cancel(att, cancel):
            return now + RECHECK_S      # inside the grace period with survivors
        exit_info = read_json(att.file("exit"))
        if exit_info is None:
            if att.launcher.alive(att) or att.command_alive():
                due = self._next_look(att, now, got_lines)
                return due if limit_due is None else min(due, limit_due)
            exit_info = read_json(att.file("exit"))   # the shim may have just finished
            if exit_info is None:
                exit_info = exit_record(failure_kind="LOST",
                                        message="the job's shim vanished without an exit "
                                                "status (host reboot or killed)")
        if att.pid(ended=True) and not att.running_reported:
            self.reporter.running(att)     # a fast job: say it ran before its lines
        att.draining = True
        try:
            drained = self._drain(att, emit)
        finally:
            att.draining = False
        if not drained:
            return now + BACKLOG_WAIT_S   # the server has a backlog to ack first
        self._finish(att, exit_info, cancel)
        return now + IDLE_WAKE_S

    def _warn_before_stop(self, att, cancel):
        """A stop with a warning (a preemption's, docs/scheduling.md): the signal once, to a
        job that handles it (or asked for it with --signal), then the stop at `stop_at`.
        A job that does not handle it is stopped at once: waiting would only cost time.
        -> seconds to wait before the stop, or 0 (stop now)."""
        left = (cancel["stop_at"] - now_ms()) / 1000
        if left <= 0 or att.final:
            return 0
        if "term_at" not in cancel:
            name = cancel["warn"][0]
            if not (att.time_signal_asked or catches(att, name)):
                cancel["stop_at"] = now_ms()
                write_json_atomic(att.file("cancel"), cancel, private=True)
                return 0
            log.info("job %s attempt %s: SIG%s, its stop in %.0f s", att.job_id, att.attempt,
                     name, left)
            mark_stop_sent(att, cancel)     # an exit from here on obeyed the stop
            att.launcher.signal(att, name)
        return max(0.05, min(left, RECHECK_S * 10))

    def _time_limit(self, att):
        """The job's time limit (docs/scheduling.md), where its launcher leaves it to the
        runner: the warning signal `lead` seconds before, then at the limit a stop as a
        cancel (SIGTERM, SIGKILL after the grace) that ends it TIMEOUT. -> the monotonic
        time of the next of them, or None (nothing left to do, or not running yet)."""
        if att.launcher.limits_time or att.final:
            return None
        if att.started_wall is None:
            if not att.pid():
                return None
            try:        # the shim writes `pid` as it spawns: when the command started
                att.started_wall = os.stat(att.file("pid")).st_mtime
            except OSError:
                return None
        ran = time.time() - att.started_wall
        name, lead = (att.time_signal or ["USR1", 0])[:2]
        warn_at = att.time_limit_s - (lead or 0)
        if not att.warned and lead and warn_at <= ran < att.time_limit_s:
            att.warned = True
            if att.time_signal_asked or catches(att, name):
                log.info("job %s attempt %s: SIG%s, %ss before its time limit", att.job_id,
                         att.attempt, name, lead)
                att.launcher.signal(att, name)
            else:       # its default action would end it: the warning would be the stop
                log.info("job %s attempt %s: no SIG%s before its time limit: no process of "
                         "it handles that signal (--signal sends it anyway)", att.job_id,
                         att.attempt, name)
        if ran >= att.time_limit_s:
            if not os.path.exists(att.file("cancel")):
                log.info("job %s attempt %s: its time limit (%ss) is reached; stopping it",
                         att.job_id, att.attempt, att.time_limit_s)
                write_json_atomic(att.file("cancel"), {"requested_at": now_ms(),
                                                       "timeout": att.time_limit_s},
                                  private=True)
            return None
        left = (warn_at if not att.warned and lead else att.time_limit_s) - ran
        return time.monotonic() + max(0.05, left)

    def _writers_near(self):
        """The Writers of every attempt that may have written a file a running one finds:
        the running ones, and those that ended after the oldest running one started."""
        running = [a.writers.start_s for a in self.active.values() if not a.final]
        oldest = min(running, default=float("inf")) - WRITERS_SLACK_S
        self._writers = [w for w in self._writers
                         if w.ended_s is None or w.ended_s >= oldest]
        return self._writers

    def _on_ack(self):
        if self.reporter.held_back:
            self.reporter.held_back = False
            self.wake()

    def wake(self):
        """Look at every attempt at once (an ack freed backlog room, Slurm answered)."""
        self._look_all = True
        self._wake.set()

    def poke(self, att):
        """Look at this attempt at once (its waiter saw the shim's line, or its EOF); the
        others keep their time."""
        att.poked = True
        self._wake.set()

    def _next_look(self, att, now, busy):
        # Reading: back off while the log is quiet. Liveness: our own shims wake us; an
        # adopted one (from before a restart) is polled.
        att.poll_s = LOG_POLL_MIN_S if busy else min(LOG_POLL_MAX_S, att.poll_s * 2)
        due = now + att.poll_s
        if not att.watched:
            due = min(due, now + ADOPTED_CHECK_S)
        if att.run_id is not None and (att.tb_dir or att.working_dir or att.watch_dir):
            due = min(due, max(att.next_hook, now + LOG_POLL_MIN_S))
        return due

    def _drain(self, att, emit):
        """Everything left of an ended attempt: the whole log, every TensorBoard point, the
        final checkpoint scan; commands for other jobs run in between. -> False while the
        backlog cap holds it back (the final record must come after all of it)."""
        while True:
            room = self.reporter.room(att)
            if room <= 0:
                return False
            if att.log.poll(emit, True, room):
                self._run_commands()
                continue
            break
        if att.run_id is not None:
            while self.reporter.room(att) > 0:
                try:
                    more = att.tb.poll(emit, final=True)
                except Exception:
                    log.exception("job %s attempt %s: TensorBoard tailing failed",
                                  att.job_id, att.attempt)
                    more = False
                self._run_commands()
                if not more:
                    break
            else:
                return False
            try:
                att.ckpt.poll(emit, final=True)
            except Exception:
                log.exception("job %s attempt %s: checkpoint scan failed", att.job_id,
                              att.attempt)
        return True

    def _hooks(self, att, emit):
        try:
            att.tb.poll(emit)
        except Exception:
            log.exception("job %s attempt %s: TensorBoard tailing failed", att.job_id,
                          att.attempt)
        try:
            att.ckpt.poll(emit)
        except Exception:
            log.exception("job %s attempt %s: checkpoint scan failed", att.job_id,
                          att.attempt)

    def _finish(self, att, exit_info, cancel):
        exit_info = att.launcher.classify(att, exit_info)
        if exit_info.get("failure_kind") == "LOST":
            kind, message = "LOST", exit_info["message"]
        else:
            kind, message = classify_exit(exit_info, att.file("log"), cancel)
        rec = self.reporter.final(att, kind, message, exit_info)
        log.info("job %s attempt %s exited: code %s signal %s failure %s", att.job_id,
                 att.attempt, rec["exit_code"], rec["signal"], kind)

    # -- views for the other threads (no file work, one short lock) --------------------------

    def _snapshot(self):
        with self.lock:
            return list(self.view.values())

    def running(self):
        """[(facts, pid)] of attempts whose command is alive now."""
        return [(v, v["pid"]) for v in self._snapshot()
                if v["pid"] and proc_alive(v["pid"], v["create_time"])]

    def sync_message(self):
        # Listed as running: every known attempt without its `reported` marker, which is
        # written after the EXITED record is in the outbox (so one that ended a moment ago
        # may still be listed; one known and not listed has its EXITED in the outbox).
        known = self.dirs.known()
        pids = {(v["job_id"], v["attempt"]): v["pid"] for v in self._snapshot()}
        running = [{"job_id": j, "attempt": a, "pid": pids.get((j, a))} for j, a in known
                   if not self.dirs.reported(j, a)]
        return {"type": "sync", "running": running, "known": [[j, a] for j, a in known]}

    def busy_gpus(self):
        return {g for v in self._snapshot() for g in v["gpus"]}


# ---------------------------------------------------------------------------------------
# the shim: its own session, outlives the agent
# ---------------------------------------------------------------------------------------

# The shim is one process per agent (`shim_server_command`, see ProcessLauncher) that starts and
# waits for every job; one attempt can also run alone as `python -I -S -c SHIM_SOURCE DIR`
# (`shim_command`, or `agent.py _shim DIR`). Neither imports this file: SHIM_SOURCE is the
# source of the functions below (inspect.getsource), which are also this module's own, so
# there is one copy of them, linted and tested like the rest. The shim starts with an
# environment of its own (shim_environment), so a job cannot read the agent's through
# /proc/PID/environ; the job's environment and command come with its exec record.
def _shim_write(path, text, mode=0o600, sync=True):
    # Atomic: a reader sees the old file or the new one. `sync`: fsynced before the rename,
    # so it survives a power cut too (an agent or shim that crashes loses nothing written:
    # the page cache stays). An fsync costs ~10 ms on a loaded VM; files whose loss in a
    # power cut changes nothing (see their callers) are written without one.
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, text.encode("utf-8"))
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


_btime: list = []  # the boot time, read once (the shim's own copy: SHIM_PRELUDE)


def _shim_ctime(pid):
    # psutil's create_time on Linux (boot time + start ticks), without importing psutil
    try:
        if not _btime:
            with open("/proc/stat") as f:
                _btime.append(next(int(line.split()[1]) for line in f
                                   if line.startswith("btime")))
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        try:
            ticks = int(os.read(fd, 4096).rsplit(b")", 1)[1].split()[19])
        finally:
            os.close(fd)
        return _btime[0] + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        try:
            import psutil
            return psutil.Process(pid).create_time()
        except Exception:
            return None


def without_secrets(spec):
    """-> spec (an attempt's spec.json) without a secret: no ingest token, no env value;
    None when it holds none. The job has them; nothing reads them from spec.json once
    the shim has started it, so a job of the agent's user reading other attempts' files
    finds no token and no env value there."""
    start = spec.get("start") or {}
    if "ingest_token" not in start and not (spec.get("exec") or {}).get("env"):
        return None
    start = {k: v for k, v in start.items() if k != "ingest_token"}
    if isinstance(start.get("env"), dict):
        start["env"] = {k: "<redacted>" for k in start["env"]}
    spec = dict(spec, start=start)
    if isinstance(spec.get("exec"), dict):
        spec["exec"] = {k: v for k, v in spec["exec"].items() if k != "env"}
    return spec


def scrub_start_record(path):
    """Rewrite spec.json without_secrets() once its job runs (for the attempts that did
    not go without them from the start: Runner._start)."""
    spec = read_json(path)
    if not isinstance(spec, dict):
        return
    spec = without_secrets(spec)
    if spec is None:
        return
    try:     # not fsynced: a power cut may bring the secrets back, not lose the record
        write_json_atomic(path, spec, private=True, sync=False)
    except OSError as e:
        log.warning("cannot rewrite %s without its secrets: %s", path, e)


def _shim_start(path, packed, shim_pid):
    # Start the attempt in `path`: read its exec record (marshal, or spec.json), spawn its
    # command, write `pid`. -> the command's pid; else `exit` says why it did not start:
    # False (DISPATCH_FAILED, with a sentence) or None (cancelled before start).
    log_fd = os.open(os.path.join(path, "log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        def fail(msg):
            os.write(log_fd, f"gpuplane: {msg}\n".encode("utf-8", "backslashreplace"))
            write_exit(path, failure_kind="DISPATCH_FAILED", message=msg)
            return False

        try:
            if packed:
                ex = marshal.loads(packed)
            else:
                with open(os.path.join(path, "spec.json")) as f:
                    ex = json.load(f)["exec"]
            argv, exe, cwd, env = ex["argv"], ex["executable"], ex["cwd"], ex["env"]
        except (OSError, ValueError, EOFError, KeyError, TypeError) as e:
            return fail(f"the agent's start record for this job is unreadable: {e}")
        if os.path.exists(os.path.join(path, "cancel")):
            return write_exit(path, message="cancelled before start")
        try:
            os.chdir(cwd)
            # posix_spawn, not subprocess: the same fork + exec without its imports; its
            # own session (the agent kills the job's group), stdin from /dev/null, output
            # to the log, and the signal dispositions a new program expects
            pid = os.posix_spawn(exe, argv, env, setsid=True, file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, log_fd, 1),
                (os.POSIX_SPAWN_DUP2, log_fd, 2)],
                setsigdef=(signal.SIGHUP, signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ,
                           signal.SIGCHLD))
        except OSError as e:
            return fail(f"cannot execute {argv[0]!r}: {e.strerror or e}")
        except (ValueError, TypeError) as e:     # a NUL byte in argv or env, and the like
            return fail(f"cannot execute {str(argv[0])[:200]!r}: {e}; "
                        "fix the job's command or env")
        finally:
            os.chdir("/")           # holds no job's directory
    finally:
        os.close(log_fd)
    # The job runs whatever happens here: it is waited for, and `exit` written. `pid` is not
    # fsynced: after a power cut no process of it is left to find, and the agent (which
    # waits for this reply) never waits on the disk to start a job.
    try:
        _shim_write(os.path.join(path, "pid"), json.dumps({
            "pid": pid, "create_time": _shim_ctime(pid), "shim_pid": shim_pid,
            "shim_create_time": _shim_ctime(shim_pid)}), 0o600, False)
    except OSError as e:
        sys.stderr.write(f"gpuplane shim: {path}/pid not written: {e}\n")
    return pid


def exit_record(**fields):
    """An attempt's `exit` file: its exit status, when it ended, and why it failed where
    it did (failure_kind, message). Built only here: the shim writes it, and the agent
    for an attempt that never ran or whose shim vanished."""
    return {"exit_code": None, "signal": None, "ended_at": now_ms(), **fields}


def write_exit(path, **fields):
    """Write the attempt dir's `exit` file (exit_record(**fields)), atomically. Not
    fsynced: the EXITED record (fsynced in the outbox before it is sent, milliseconds
    later) is what keeps the exit status; a power cut before that ends the attempt LOST,
    as one a moment earlier while it ran would, and the slot's turnover never waits on
    the disk."""
    _shim_write(os.path.join(path, "exit"), json.dumps(exit_record(**fields)), 0o600, False)


def _shim_status(status):
    rc = os.waitstatus_to_exitcode(status)
    return {"exit_code": rc if rc >= 0 else None, "signal": -rc if rc < 0 else None}


def _shim_quiet():
    # the agent may restart or its terminal may close; the shim must not notice (the job
    # gets the default dispositions back: it runs in a session of its own)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def shim_main(path):
    # One attempt alone (`agent.py _shim DIR`): start it, wait for it, write `exit`.
    _shim_quiet()
    pid = _shim_start(path, None, os.getpid())
    if not pid:
        return 1 if pid is False else 0
    write_exit(path, **_shim_status(os.waitpid(pid, 0)[1]))
    return 0


def shim_server():
    # The agent's shim: one process that starts the agent's jobs and waits for them, in a
    # session of its own, so they outlive the agent. Requests come on fd 0 (a
    # SOCK_SEQPACKET socket): an attempt dir, a NUL and its exec record (marshal; empty:
    # read spec.json), with the write end of a pipe that it keeps for the job: a line once
    # the command runs, closed once `exit` is written. The reply: "pid N", or "ended" (the
    # attempt's `exit` says why nothing runs). EOF: the agent is gone or stopping; no new
    # jobs, and the shim ends once the ones it has ended.
    import select, socket, traceback
    _shim_quiet()
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda _sig, _frame: None)   # wakes the select
    sock = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    me = os.getpid()
    jobs = {}                       # pid -> (attempt dir, the agent's pipe)

    def reply(text):
        # an agent gone since its request takes no answer: its jobs still run to their end
        nonlocal sock
        try:
            sock.send(text)
        except OSError:
            sock.close()
            sock = None
    while sock is not None or jobs:
        ready = select.select([wake_r] + ([sock] if sock is not None else []), [], [])[0]
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        while jobs:                 # reap every job that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            path, pipe = jobs.pop(pid, (None, None))
            if path is None:
                continue
            try:
                write_exit(path, **_shim_status(status))
            except OSError:
                traceback.print_exc()
            os.close(pipe)          # the agent's waiter sees EOF: look at `exit`
        if sock is None or sock not in ready:
            continue
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 17, 1)
        except ConnectionError:
            msg, fds = b"", []
        for fd in fds:
            # no job may inherit another's pipe (or its own: the agent would see its EOF
            # only once every process the job left behind has gone too); recv_fds takes
            # no MSG_CMSG_CLOEXEC on Python 3.11
            os.set_inheritable(fd, False)
        if not msg or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            if not msg:
                sock.close()
                sock = None
            else:
                reply(b"refused: a request needs one pipe")
            continue
        path, _, packed = msg.partition(b"\0")
        path = os.fsdecode(path)
        try:
            pid = _shim_start(path, packed, me)
        except Exception as e:
            traceback.print_exc()
            try:
                write_exit(path, failure_kind="DISPATCH_FAILED",
                           message=f"the job's shim could not start it: {e}")
            except OSError:
                pass
            pid = None
        if not pid:
            os.close(fds[0])
            reply(b"ended")
            continue
        jobs[pid] = (path, fds[0])
        try:
            os.write(fds[0], b"started\n")
        except OSError:         # the agent is gone: no reason to stop
            pass
        reply(b"pid %d" % pid)
    return 0


# The functions above are the shim's whole program, in this order; each is also an
# ordinary function of this module (the agent writes `exit` files with them too).
SHIM_FUNCTIONS = (_shim_write, _shim_ctime, now_ms, exit_record, write_exit, _shim_start,
                  _shim_status, _shim_quiet, shim_main, shim_server)
# What the functions need besides themselves: the stdlib modules at the top of this file
# and _btime (inside shim_server and _shim_ctime: select, socket, traceback, psutil).
SHIM_PRELUDE = """\
import json, marshal, os, signal, sys, time

_btime = []
"""
try:
    SHIM_SOURCE = SHIM_PRELUDE + "".join(
        "\n\n" + inspect.getsource(f) for f in SHIM_FUNCTIONS)
except OSError as e:        # no file to read the functions from: `python - < agent.py`
    raise ImportError(f"the agent needs its own source file to start its shim ({e}); "
                      "run it as `python agent.py` (copy the file, not its text)") from None


def shim_command():
    """argv that runs one shim alone; the attempt dir is appended.
    -I -S: no site packages, no PYTHON* variables: the shim needs only the stdlib."""
    return [sys.executable, "-I", "-S", "-c",
            SHIM_SOURCE + "\nsys.exit(shim_main(sys.argv[1]))"]


def shim_server_command():
    """argv of the agent's shim (ProcessLauncher); its socket is its stdin."""
    return [sys.executable, "-I", "-S", "-c", SHIM_SOURCE + "\nsys.exit(shim_server())"]


# ---------------------------------------------------------------------------------------
# TensorBoard tailing: TBTailer (see docs/tensorboard.md)
# ---------------------------------------------------------------------------------------
# Reads the TFRecord framing itself so CRCs are checked in C (google-crc32c) instead of
# tensorboard's pure-Python loop; decodes with tensorboard's own protos.

# tensorboard's protos and a C CRC32C are imported on first use, so the agent of a host
# whose jobs write no TensorBoard files stays light.
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

    def __init__(self, root_dir, started_after_ts=None, offsets=None, *, rescan_s=TB_RESCAN_S,
                 max_points=TB_MAX_POINTS, owner=None):
        _tb_load()
        self.root = os.path.abspath(root_dir)
        self.started_after_ts = started_after_ts
        # owner(path, mtime_s, name facts) -> OWN, OTHER or UNKNOWN (Writers.owner): a file
        # is read only when it is OWN; an OTHER is never looked at again, an UNKNOWN at
        # each walk (evidence may come: its writer seen holding it open)
        self.owner = owner
        self.foreign = set()       # rels of files another process wrote
        self.undecided = {}        # rel -> monotonic time it was first left undecided
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
        """Walk the tree for event files, bounded: TB_MAX_DEPTH levels, TB_MAX_ENTRIES
        entries a walk (a job's huge tree must not stall the other jobs of its node)."""
        stack, budget = [(self.root, 0)], TB_MAX_ENTRIES
        while stack:
            d, depth = stack.pop()
            try:
                it = os.scandir(d)
            except OSError:
                continue
            with it:
                for e in it:
                    budget -= 1
                    if budget < 0:
                        self._warn_once("", "entries", "more than %d entries under %s; the "
                                        "walk for TensorBoard files stops there (give the job "
                                        "a tb_dir of its own)", TB_MAX_ENTRIES, self.root)
                        return
                    try:
                        if e.is_dir(follow_symlinks=False):
                            if not e.name.startswith(".") and e.name not in _TB_SKIP_DIRS \
                                    and depth < TB_MAX_DEPTH:
                                stack.append((e.path, depth + 1))
                        elif "tfevents" in e.name and e.is_file():
                            self._consider(e)
                    except OSError:
                        continue

    def _consider(self, entry):
        rel = os.path.relpath(entry.path, self.root).replace(os.sep, "/")
        if rel in self._files or rel in self.foreign:
            return
        if rel in self._resume:
            offset = self._resume.pop(rel)   # read for this attempt before a restart
        else:
            mtime = entry.stat().st_mtime
            if self.started_after_ts is not None and mtime < self.started_after_ts:
                return   # from an earlier launch; looked at again if it is ever written to
            if self.owner is not None:
                who = self.owner(entry.path, mtime, tb_name_facts(entry.name))
                if who == OTHER:
                    self.foreign.add(rel)
                    self.undecided.pop(rel, None)
                    return
                if who == UNKNOWN:
                    self.undecided.setdefault(rel, time.monotonic())
                    return
                self.undecided.pop(rel, None)
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
    def __init__(self, fake_gpus=0, node=None, nvml=True):
        self.fake = int(fake_gpus)
        self.node = node or socket.gethostname()
        self.nvml = None
        self.handles = []
        if self.fake or not nvml:
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
            return [{"index": i, "name": f"Fake GPU {i}", "memory_total_mb": FAKE_GPU_MEM_MB,
                     "uuid": f"FAKE-{self.node}-{i}", "fake": True}
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
                            "mem_used_mb": int(FAKE_GPU_MEM_MB *
                                               (random.uniform(0.55, 0.8) if held else 0.012)),
                            "mem_total_mb": FAKE_GPU_MEM_MB,
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

    def __init__(self, outbox, runner, probe, home, interval=DEFAULT_STATS_INTERVAL_S):
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
            if att["run_id"] is None:
                continue
            points = []
            cpu, rss = self._tree_usage(pid, seen)
            points.append(["sys/cpu_percent", step, cpu, ts])
            points.append(["sys/rss_mb", step, rss, ts])
            try:     # a full disk kills checkpoints: watch the job's own filesystem
                free = shutil.disk_usage(att["working_dir"]).free / 2**20
                points.append(["sys/disk_free_mb", step, round(free, 1), ts])
            except (OSError, TypeError):
                pass
            for g in att["gpus"]:
                s = by_index.get(g)
                if not s:
                    continue
                for k in ("util", "mem_used_mb", "temp_c", "power_w"):
                    if s.get(k) is not None:
                        points.append([f"sys/gpu{g}/{k}", step, float(s[k]), ts])
            self.outbox.append("metrics", {"ts": ts, "run_id": att["run_id"],
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


class _Session:
    """What the three threads of one connection share; `lock` guards the send window."""

    def __init__(self, cursor):
        self.lock = threading.Lock()
        self.sent_upto = cursor
        self.inflight = None          # highest seq of the batch awaiting its ack
        self.deadline = 0.0
        self.restart = None           # a reason to start a new epoch
        self.last_heard = time.monotonic()
        self.answers_heartbeats = False
        self.ended = threading.Event()
        self.error = None

    def end(self):
        self.ended.set()


class Connection(Worker):
    """A tick is one session (hello, welcome, then batches until it ends); the wait
    between ticks is the reconnect backoff. Within a session the sender waits on `_ready`
    (the outbox grew, an ack or resend came, or stop), so appends never cut the backoff
    short."""
    name = "gpuplane-agent-connection"

    def __init__(self, config, outbox, runner, probe, ack_timeout_s=ACK_TIMEOUT_S):
        super().__init__()
        self.config, self.outbox, self.runner, self.probe = config, outbox, runner, probe
        self.url = ws_url(config.server)
        self.heartbeat_s = config.heartbeat_s
        self.ack_timeout_s = ack_timeout_s
        self._ws = None
        self.connected = threading.Event()   # set while a session is welcomed
        self.synced = threading.Event()      # set once sync went out on this session
        self._ready = threading.Event()      # the outbox grew, an ack came, or stop
        self._send_lock = threading.Lock()
        self._delay = RECONNECT_MIN_S
        outbox.listeners.append(self._ready.set)

    def begin(self):
        return 0.0

    def tick(self):
        """One session. -> the backoff before the next."""
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
        if time.monotonic() - began > RECONNECT_RESET_S:
            self._delay = RECONNECT_MIN_S
        wait = self._delay * random.uniform(0.5, 1.0) + random.uniform(0, 0.25)
        self._delay = min(self._delay * 2, RECONNECT_MAX_S)
        return wait

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
            try:       # a dead path sends nothing back: wake the reader ourselves
                ws.sock.shutdown(socket.SHUT_RDWR)
            except (OSError, AttributeError):
                pass
            ws.event.set()

    def _send(self, obj):
        data = obj if isinstance(obj, str) else json.dumps(obj)
        with self._send_lock:     # the sender and the heartbeat thread share the socket
            ws = self._ws
            if ws is None:
                raise ConnectionError("connection closed")
            ws.send(data)

    def _receive(self, timeout):
        ws = self._ws
        if ws is None:
            return None
        raw = ws.receive(timeout=timeout)
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
        hello = {"type": "hello", "node": self.config.name, "epoch": self.outbox.epoch,
                 "version": VERSION, "hostname": socket.gethostname(),
                 "cpu_slots": self.config.cpu_slots, "fake": self.probe.fake > 0,
                 "gpus": self.probe.facts()}
        if self.runner.slurm is not None:
            # slots are the jobs it may hold in Slurm; Slurm places them (docs/slurm.md)
            slurm = self.runner.slurm
            hello.update(runner="slurm", cpu_slots=slurm.max_jobs, gpus=[],
                         slurm=dict(slurm.offers(), max_jobs=slurm.max_jobs))
        self._send(hello)
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
            why = self.outbox.accept_cursor(cursor)
            if why:
                # the server's cursor does not fit what we hold: renumber and say hello again
                self.outbox.restart_epoch(why)
                return
        log.info("connected to %s as %s (cursor %d, %d to send)", self.url,
                 self.config.name, cursor, self.outbox.last_seq - cursor)
        self.connected.set()
        sess = _Session(cursor)
        # Three threads a session: this one sends batches when the outbox or an ack wakes
        # it; a reader applies what the server says; a heartbeat thread keeps time. None of
        # them waits on another's work, so a busy outbox never delays a heartbeat.
        threads = [threading.Thread(target=self._reader, args=(sess,), daemon=True,
                                    name=self.name + "-reader"),
                   threading.Thread(target=self._heartbeats, args=(sess,), daemon=True,
                                    name=self.name + "-heartbeat")]
        for t in threads:
            t.start()
        try:
            self._sender(sess)
        finally:
            sess.end()
            self._close()
            for t in threads:
                t.join(5)
        if sess.error is not None:
            raise sess.error

    def _sender(self, sess):
        backlog = self.outbox.last_seq
        while True:
            self._ready.clear()
            if self._stop.is_set() or sess.ended.is_set():
                return
            now = time.monotonic()
            with sess.lock:
                if sess.restart:
                    self.outbox.restart_epoch(sess.restart)
                    return
                inflight, sent_upto = sess.inflight, sess.sent_upto
            if inflight is None:
                if not self.synced.is_set():
                    self._maybe_sync(backlog)
                items = self.outbox.pending_after(sent_upto)
                hold = self.outbox.hold(items) if items else 0.0
                if items and not hold:
                    with sess.lock:
                        if sess.sent_upto != sent_upto:     # a resend came in meanwhile
                            continue
                        sess.inflight = sess.sent_upto = items[-1][0]
                        sess.deadline = now + self.ack_timeout_s
                    self._send(self.outbox.batch_message(items))
                    continue
                timeout = hold or None      # an append wakes it before, to send them along
            elif now > sess.deadline:
                log.warning("no ack for seq %d within %.0f s; reconnecting", inflight,
                            self.ack_timeout_s)
                return
            else:
                timeout = sess.deadline - now
            self._ready.wait(timeout)

    def _reader(self, sess):
        try:
            while not sess.ended.is_set():
                msg = self._receive(None)
                if msg is None:
                    if self._ws is None or not self._ws.connected:
                        return
                    continue
                sess.last_heard = time.monotonic()
                kind = msg.get("type")
                if kind == "heartbeat":
                    sess.answers_heartbeats = True
                elif kind == "ack":
                    seq = int(msg.get("seq", 0))
                    self.outbox.ack(seq)
                    with sess.lock:
                        if sess.inflight is not None and seq >= sess.inflight:
                            sess.inflight = None
                    self._ready.set()
                elif kind == "resend":
                    start = int(msg.get("from", 1))
                    with sess.lock:
                        if start - 1 < self.outbox.acked:
                            sess.restart = (f"server asked to resend from {start}, "
                                            f"below acked {self.outbox.acked}")
                        else:
                            sess.sent_upto, sess.inflight = start - 1, None
                    self._ready.set()
                elif kind == "start":
                    self.runner.handle_start(msg)
                elif kind == "cancel":
                    self.runner.handle_cancel(msg)
                elif kind == "delete_checkpoints":
                    self.runner.submit(dict(msg), False)
                elif kind == "welcome":
                    pass
                else:
                    log.debug("ignoring server message of type %r", kind)
        except Exception as e:
            if not sess.ended.is_set():
                sess.error = e
        finally:
            sess.ended.set()
            self._ready.set()

    def _heartbeats(self, sess):
        # A server that answers heartbeats is expected to keep answering: silence for
        # three of them means the path is dead (no FIN or RST ever comes), so reconnect.
        try:
            while not sess.ended.is_set():
                now = time.monotonic()
                if sess.answers_heartbeats and now - sess.last_heard > HEARTBEAT_MISSES * self.heartbeat_s:
                    log.warning("nothing from the server for %.0f s; reconnecting",
                                now - sess.last_heard)
                    return
                self._send({"type": "heartbeat", "ts": now_ms()})
                sess.ended.wait(self.heartbeat_s)
        except Exception as e:
            if not sess.ended.is_set():
                sess.error = e
        finally:
            sess.ended.set()
            self._ready.set()

    def _maybe_sync(self, backlog):
        # Wait for the backlog of this connection and every job record to be acked; newer
        # log/metric records need not hold it up. Snapshot first, then check: an attempt
        # that ended in between is still listed as running (harmless), never missing with
        # its EXITED unacked.
        if self.outbox.acked < max(backlog, self.outbox.last_job_seq):
            return
        msg = self.runner.sync_message()
        if self.outbox.acked >= max(backlog, self.outbox.last_job_seq):
            self._send(msg)
            self.synced.set()
            log.info("sync sent: %d running, %d known", len(msg["running"]),
                     len(msg["known"]))

    def stopping(self):
        self._ready.set()           # the sender's wait
        self._close()               # the reader's


# ---------------------------------------------------------------------------------------
# agent + main
# ---------------------------------------------------------------------------------------

class Agent:
    def __init__(self, config, kill_grace_s=KILL_GRACE_S):
        self.config = config
        make_private_dirs(config.agent_dir)
        self.outbox = Outbox(config.agent_dir)
        http = config.server
        if http.startswith(("ws://", "wss://")):
            http = "http" + http[2:]
        docker = Docker(config.name, binary=config.docker, extra_args=config.docker_args,
                        default_image=config.default_image)
        slurm = None
        if config.runner == "slurm":
            slurm = Slurm(config.name, partition=config.slurm_partition,
                          account=config.slurm_account, qos=config.slurm_qos,
                          time_limit=config.slurm_time_limit, sbatch_args=config.sbatch_args,
                          max_jobs=config.slurm_max_jobs)
        self.runner = Runner(config.agent_dir, self.outbox, kill_grace_s=kill_grace_s,
                             server_url=http.rstrip("/"), secrets=(config.token,),
                             backlog_max_bytes=int(config.backlog_mb * 2**20),
                             retention_days=config.job_retention_days, docker=docker,
                             slurm=slurm, run_as=config.run_as)
        # A Slurm agent's GPUs are the cluster's: the login node's own are not slots, and
        # a job's GPU metrics come from the job (docs/slurm.md)
        self.probe = GpuProbe(0 if slurm else config.fake_gpus, config.name,
                              nvml=slurm is None)
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


def _not_dumpable():
    """Linux: other processes of this user (the jobs among them) cannot read this one's
    memory or /proc/PID/environ, where the agent's token may sit."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(4, 0, 0, 0, 0)          # PR_SET_DUMPABLE, 0
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------------------
# backup of an agent host: `gpuplane-agent backup FILE` (docs/operations.md)
# ---------------------------------------------------------------------------------------

class _Prefix:
    """The first `size` bytes of a file that may still grow (a log being written)."""

    def __init__(self, f, size):
        self.f, self.left = f, size

    def read(self, n=-1):
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.f.read(n)
        self.left -= len(data)
        return data


def backup_agent(home, out_path):
    """Archive an agent home (agent.toml, the outbox spool and state, every job's files)
    into a gzipped tar, consistently while jobs run: logs are append-only, so each is
    taken up to its size when it is opened; every other state file is replaced whole
    (atomic rename), so an open one is one version. The spool is read before state.json:
    a compaction in between leaves a newer snapshot over an older spool, which folds to
    the same state. -> (files, bytes)."""
    import tarfile
    home = os.path.abspath(home)
    agent_dir = os.path.join(home, "agent")
    if not os.path.isdir(agent_dir):
        raise ConfigError(f"no agent state in {home} (no agent/ directory); pass the "
                          "agent's --home")
    order = [os.path.join(home, "agent.toml"), os.path.join(agent_dir, "spool"),
             os.path.join(agent_dir, "state.json"), agent_dir]
    seen, files, total, skipped = set(), 0, 0, 0
    tmp = f"{out_path}.partial"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for top in order:
            walk = [(top, [], [])] if os.path.isfile(top) else os.walk(top)
            for root, dirs, names in walk:
                dirs.sort()
                paths = [root] if os.path.isfile(root) else \
                    [os.path.join(root, n) for n in sorted(names)]
                for path in paths:
                    if path in seen or path.endswith((".partial", ".tmp")) or \
                            ".tmp" in os.path.basename(path):
                        continue
                    seen.add(path)
                    # A job writes into its attempt dir: a symlink there must not pull
                    # another file (~/.ssh/id_rsa) into the archive, nor a FIFO block the
                    # backup for ever. Only regular files, opened without following links.
                    try:
                        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                    except OSError:
                        skipped += 1      # a symlink (ELOOP), gone, or unreadable
                        continue
                    f = os.fdopen(fd, "rb")
                    with f:
                        st = os.fstat(f.fileno())
                        if not stat.S_ISREG(st.st_mode):
                            skipped += 1  # a FIFO, socket or device
                            continue
                        info = tarfile.TarInfo(os.path.relpath(path, home))
                        info.size, info.mtime, info.mode = st.st_size, st.st_mtime, 0o600
                        tar.addfile(info, _Prefix(f, st.st_size))
                    files += 1
                    total += st.st_size
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(tmp, out_path)
    if skipped:
        print(f"gpuplane-agent: backup: left out {skipped} entries that are not regular "
              "files (symlinks, FIFOs, sockets)", file=sys.stderr)
    return files, total


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_shim"]:
        if len(argv) != 2:
            print("usage: agent.py _shim DIR", file=sys.stderr)
            return 2
        return shim_main(argv[1])
    if argv[:1] == ["backup"]:
        return _backup_main(argv[1:])
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

    # The handler only sets a flag; the wakeup fd ends the select below without polling.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _not_dumpable()
    global AGENT_HOME
    AGENT_HOME = config.home        # never walked for a job (walk_root_refused)
    agent = Agent(config)
    log.info("agent %s starting; home %s; server %s", config.name, config.home,
             config.server)
    agent.start()
    import select
    while not stopping:
        try:
            select.select([wake_r], [], [])
            os.read(wake_r, 512)
        except InterruptedError:
            pass
    log.info("stopping (signal %d); running jobs keep running", stopping[0])
    agent.stop()
    return 0


def _backup_main(argv):
    p = argparse.ArgumentParser(
        prog="gpuplane-agent backup",
        description="Archive this host's agent state (agent.toml, outbox spool and state, "
                    "every job's log and files) while jobs run. Restore: stop the agent, "
                    "`tar -xzf FILE -C HOME`, start it.")
    p.add_argument("file", metavar="FILE", help="the archive to write (.tar.gz)")
    p.add_argument("--home", help="agent home (default: $GPUCTL_HOME or ~/.gpuctl)")
    args = p.parse_args(argv)
    home = os.path.abspath(os.path.expanduser(args.home or default_home()))
    try:
        files, total = backup_agent(home, args.file)
    except (ConfigError, OSError) as e:
        print(f"gpuplane-agent: backup failed: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.file}: {files} files, {total / 1e6:.1f} MB from {home}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
