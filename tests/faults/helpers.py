"""Shared pieces of the fault suite: the workload job, read-only looks into the server's
SQLite file, a TCP proxy that can cut the network, and the FAULTS report line."""
import contextlib
import json
import os
import pathlib
import select
import socket
import sqlite3
import sys
import textwrap
import threading
import time

from procs import wait_for  # noqa: F401  (the suite imports it from here)

PY = sys.executable
ROOT = pathlib.Path(__file__).resolve().parents[2]
SDK_DIR = ROOT / "sdk"


def long_mode(config=None):
    if os.environ.get("FAULTS_LONG", "") not in ("", "0"):
        return True
    return bool(config is not None and config.getoption("--faults-long", default=False))


def report(name, **counts):
    """Print the one-line summary and append it to $FAULTS_REPORT as a JSON line."""
    line = " ".join(f"{k}={v}" for k, v in counts.items())
    print(f"\nFAULTS {name}: {line}", flush=True)
    path = os.environ.get("FAULTS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, "ts": int(time.time()), **counts}) + "\n")


# -- the server's database, read-only ------------------------------------------------------

def db_path(server):
    return server.home / "server" / "gpuctl.db"


@contextlib.contextmanager
def ro(server):
    conn = sqlite3.connect(f"file:{db_path(server)}?mode=ro", uri=True, timeout=30)
    try:
        yield conn
    finally:
        conn.close()


def integrity(server):
    with ro(server) as c:
        return c.execute("PRAGMA integrity_check").fetchone()[0]


def snapshot(server):
    """Row counts of what clients can change."""
    with ro(server) as c:
        return {t: c.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                for t in ("jobs", "runs", "points", "metric_keys", "logs", "tokens",
                          "checkpoints")}


def log_rows(server, job_id):
    """[(attempt, line_no, text)] in the order the server stored them."""
    with ro(server) as c:
        return c.execute("SELECT attempt, line_no, text FROM logs WHERE job_id = ? ORDER BY id",
                         (job_id,)).fetchall()


def point_rows(server, run_ids):
    """[(key, step, value)] of the runs' raw points."""
    run_ids = list(run_ids)
    q = ",".join("?" * len(run_ids))
    with ro(server) as c:
        return c.execute(f"SELECT k.key, p.step, p.value FROM points p JOIN metric_keys k"
                         f" ON k.id = p.key_id WHERE k.run_id IN ({q})", run_ids).fetchall()


def node_cursor(server, name):
    with ro(server) as c:
        row = c.execute("SELECT epoch, cursor FROM nodes WHERE name = ?", (name,)).fetchone()
    return row


def check_lines(rows, expected_n, attempt=1):
    """Counts for a job that printed `line 0` .. `line N-1`: (stored, lost, doubled,
    out_of_order). A line stored twice under two line numbers counts as doubled."""
    texts = [t for a, _no, t in rows if a == attempt and t.startswith("line ")]
    nums = [int(t.split()[1]) for t in texts]
    stored = len(nums)
    doubled = stored - len(set(nums))
    lost = len(set(range(expected_n)) - set(nums))
    out_of_order = sum(1 for a, b in zip(nums, nums[1:]) if b <= a)
    line_nos = [no for a, no, t in rows if a == attempt]
    gaps = line_nos != list(range(1, len(line_nos) + 1))
    return stored, lost, doubled, out_of_order, gaps


def point_value(k, step):
    return step + k / 8          # exact in binary floating point


def check_points(rows, keys, steps):
    """(stored, lost, doubled, wrong_value) for the workload's series k0..k{keys-1}."""
    rows = [r for r in rows if r[0][:1] == "k" and r[0][1:].isdigit()]   # not sys/*
    seen = {}
    wrong = 0
    for key, step, value in rows:
        seen[(key, step)] = seen.get((key, step), 0) + 1
        k = int(key[1:])
        if value != point_value(k, step):
            wrong += 1
    want = {(f"k{k}", s) for k in range(keys) for s in range(steps)}
    stored = len(rows)
    doubled = sum(n - 1 for n in seen.values())
    lost = len(want - set(seen))
    return stored, lost, doubled, wrong


# -- the workload job -----------------------------------------------------------------------

# Prints `line i` for i < LINES and logs k0..k{KEYS-1} at steps < STEPS through the SDK
# (with the job's own GPUCTL_TOKEN), paced to last about DURATION seconds; records its
# start; at the end waits until the SDK has delivered everything (the server may be down
# right then) and prints the SDK's own summary.
STREAM_JOB = textwrap.dedent("""
    import json, os, pathlib, sys, time
    marks, lines, steps, keys, duration = (pathlib.Path(sys.argv[1]), int(sys.argv[2]),
                                           int(sys.argv[3]), int(sys.argv[4]),
                                           float(sys.argv[5]))
    with open(marks / "starts", "a") as f:
        f.write(f"{os.environ['GPUCTL_JOB_ID']} {os.environ['GPUCTL_RUN_ID']} {os.getpid()}\\n")
    if steps and keys:
        from gpuctl import run
    total = max(lines, steps)
    t0 = time.monotonic()
    for i in range(total):
        if i < lines:
            print(f"line {i}", flush=True)
        if i < steps and keys:
            run.log({f"k{k}": i + k / 8 for k in range(keys)}, step=i)
        delay = t0 + duration * (i + 1) / total - time.monotonic()
        if delay > 0.001:
            time.sleep(delay)
    if steps and keys:
        deadline = time.monotonic() + float(os.environ.get("STREAM_DRAIN_S", "180"))
        while time.monotonic() < deadline:
            run.flush(2.0)
            if run.summary()["queued"] == 0:
                break
            time.sleep(0.2)
        s = run.summary()
        print("SDK " + json.dumps({k: s[k] for k in ("sent", "queued", "dropped", "errors")}),
              flush=True)
        run.finish()
    with open(marks / "ends", "a") as f:
        f.write(f"{os.environ['GPUCTL_JOB_ID']} {os.environ['GPUCTL_RUN_ID']}\\n")
""")


def stream_command(tmp_path, lines, steps=0, keys=0, duration=10.0):
    script = tmp_path / "stream_job.py"
    if not script.exists():
        script.write_text(STREAM_JOB)
    return [PY, str(script), str(tmp_path), str(lines), str(steps), str(keys), str(duration)]


def starts(tmp_path):
    f = tmp_path / "starts"
    return [line.split() for line in f.read_text().splitlines()] if f.exists() else []


def sdk_summary(rows):
    for _a, _no, text in rows:
        if text.startswith("SDK {"):
            return json.loads(text[4:])
    return None


# -- processes ------------------------------------------------------------------------------

def worker_pid(server):
    """The gunicorn worker (the one process that serves)."""
    import psutil
    kids = psutil.Process(server.proc.pid).children()
    return kids[0].pid if kids else None


def fd_kinds(pid):
    """{"socket": n, "db": n (the SQLite file, -wal, -shm), "other": n} of a process."""
    out = {"socket": 0, "db": 0, "other": 0}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kind = ("socket" if target.startswith("socket:") else
                "db" if ".db" in target else "other")
        out[kind] += 1
    return out


def proc_counts(pid):
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = len(os.listdir(f"/proc/{pid}/task"))
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return fds, threads, rss


class AgentTarget:
    """What AgentProc needs of a server, pointing the agent somewhere else (a proxy)."""

    def __init__(self, server, url):
        self._server, self.url = server, url

    @property
    def token(self):
        return self._server.token

    @property
    def api(self):
        return self._server.api


# -- a TCP proxy that can cut the network ---------------------------------------------------

class Proxy:
    """Loopback TCP proxy to 127.0.0.1:target_port.

    cut("blackhole"): nothing is forwarded either way and new connections are accepted but
    not forwarded, as when a cable is pulled: no FIN, no RST; what was sent waits in the
    socket buffers and flows on heal(). cut("reset"): every connection is reset at once and
    new ones are reset on arrival (a restarted NAT box). heal() forwards again.
    """

    def __init__(self, target_port):
        self.target_port = target_port
        self._lsock = socket.socket()
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind(("127.0.0.1", 0))
        self._lsock.listen(64)
        self._lsock.settimeout(0.1)
        self.port = self._lsock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.mode = None                   # None (forwarding), "blackhole", "reset"
        self._healed = threading.Event()
        self._healed.set()
        self._closed = False
        self._lock = threading.Lock()
        self._pairs = []
        self.connections = 0
        threading.Thread(target=self._accept_loop, daemon=True, name="fault-proxy").start()

    def cut(self, mode="blackhole"):
        self.mode = mode
        self._healed.clear()
        if mode == "reset":
            with self._lock:
                pairs, self._pairs = self._pairs, []
            for p in pairs:
                for s in p:
                    _reset(s)

    def heal(self):
        self.mode = None
        self._healed.set()

    def close(self):
        self._closed = True
        self._healed.set()
        self._lsock.close()
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for p in pairs:
            for s in p:
                _reset(s)

    def _accept_loop(self):
        while not self._closed:
            try:
                client, _ = self._lsock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            if self.mode == "reset":
                _reset(client)
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client):
        self._healed.wait()                # a blackholed SYN: answered only after the heal
        if self._closed:
            return _reset(client)
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            upstream.settimeout(None)
        except OSError:
            return _reset(client)
        pair = (client, upstream)
        with self._lock:
            self._pairs.append(pair)
            self.connections += 1
        try:
            self._pump(client, upstream)
        finally:
            with self._lock:
                if pair in self._pairs:
                    self._pairs.remove(pair)
            for s in pair:
                with contextlib.suppress(OSError):
                    s.close()

    def _pump(self, a, b):
        while not self._closed:
            if not self._healed.is_set():
                if self.mode == "reset":
                    return
                self._healed.wait(0.1)
                continue
            try:
                ready, _, _ = select.select([a, b], [], [], 0.1)
            except (OSError, ValueError):
                return
            for s in ready:
                if not self._healed.is_set():
                    break               # cut between select and recv: leave it buffered
                try:
                    data = s.recv(65536)
                    if not data:
                        return
                    (b if s is a else a).sendall(data)
                except OSError:
                    return


def _reset(s):
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    with contextlib.suppress(OSError):
        s.close()
