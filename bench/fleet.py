"""A fleet against one server: simulated agents with jobs running and telemetry flowing, SSE
log followers, and clients that never finish their request headers, while /api/v1/status
is timed (docs/security.md, "Thread budget"; docs/benchmarks.md has the figures).

    .venv/bin/python bench/fleet.py                       # 32 agents x 8 GPUs, 100 followers,
                                                          # 200 slow clients, 30 s of load
    .venv/bin/python bench/fleet.py --agents 4 --gpus 2 --followers 8 --slow 20 --seconds 10

The agents speak docs/protocol.md (hello, sync, RUNNING, log/metrics/node_stats batches,
heartbeats) from threads of this process, each with a token bound to its node; the jobs
never end. Printed: /status p50/p99/max, whether any node was ever seen disconnected or any
job lost its attempt, how many followers were admitted and how many got 503, the server
worker's RSS and CPU, and how long its threads and file descriptors took to come back to
the baseline after the load stopped. Baseline beside it: the same load without the slow
clients and followers (--baseline).
"""
import argparse
import json
import os
import pathlib
import selectors
import socket
import sys
import tempfile
import threading
import time
import uuid

import requests
from simple_websocket import Client, ConnectionClosed

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def now_ms():
    return int(time.time() * 1000)


class SimAgent(threading.Thread):
    """One node: hello with `gpus` fake GPUs, sync, RUNNING for every start, then every
    second a batch of log lines and metrics per job and node stats; a heartbeat per
    `heartbeat_s`."""

    def __init__(self, url, token, name, gpus, heartbeat_s=5.0, lines_per_s=2):
        super().__init__(name=f"sim-{name}", daemon=True)
        self.url, self.token, self.node, self.gpus = url, token, name, gpus
        self.heartbeat_s, self.lines_per_s = heartbeat_s, lines_per_s
        self.epoch, self.seq = uuid.uuid4().hex, 0
        self.jobs = {}                 # (job_id, attempt) -> {"run_id", "line"}
        self.stop_event = threading.Event()
        self.errors = []
        self.batches = 0
        self.connected = threading.Event()

    def run(self):
        try:
            self._session()
        except Exception as e:          # reported, the bench fails on it
            if not self.stop_event.is_set():
                self.errors.append(repr(e))

    def _session(self):
        ws = Client.connect(self.url.replace("http://", "ws://") + "/api/v1/agent/ws",
                            headers={"Authorization": f"Bearer {self.token}"})
        self.ws = ws
        gpus = [{"index": i, "name": "fake", "memory_total_mb": 80_000, "fake": True,
                 "uuid": f"GPU-{self.node}-{i}"} for i in range(self.gpus)]
        self._send({"type": "hello", "node": self.node, "epoch": self.epoch, "gpus": gpus,
                    "cpu_slots": 0, "fake": True, "hostname": self.node, "version": "sim"})
        pending = []                   # records not yet sent
        in_flight = None
        next_beat = next_tick = time.monotonic()
        while not self.stop_event.is_set():
            try:
                raw = ws.receive(timeout=0.2)
            except ConnectionClosed:
                if not self.stop_event.is_set():
                    self.errors.append(f"{self.node}: closed by the server")
                return
            if raw is not None:
                msg = json.loads(raw)
                kind = msg["type"]
                if kind == "welcome":
                    self.seq = msg["cursor"]
                    self._send({"type": "sync", "running": [], "known": []})
                    self.connected.set()
                elif kind == "start":
                    key = (msg["job_id"], msg["attempt"])
                    if key not in self.jobs:
                        self.jobs[key] = {"run_id": msg["run_id"], "line": 0}
                        pending.append({"kind": "job", "job_id": key[0], "attempt": key[1],
                                        "state": "RUNNING", "pid": 1000 + len(self.jobs)})
                elif kind == "ack":
                    in_flight = None
                    self.batches += 1
                elif kind == "resend":
                    self.errors.append(f"{self.node}: resend from {msg['from']}")
                    return
            now = time.monotonic()
            if now >= next_beat:
                self._send({"type": "heartbeat", "ts": now_ms()})
                next_beat = now + self.heartbeat_s
            if now >= next_tick:
                next_tick = now + 1.0
                pending.extend(self._telemetry())
            if in_flight is None and pending:
                records, pending = pending[:500], pending[500:]
                for r in records:
                    self.seq += 1
                    r["seq"], r["ts"] = self.seq, now_ms()
                in_flight = records
                self._send({"type": "batch", "epoch": self.epoch, "records": records})

    def _telemetry(self):
        out = []
        for (job_id, attempt), j in self.jobs.items():
            lines = []
            for _ in range(self.lines_per_s):
                j["line"] += 1
                lines.append([j["line"], now_ms(), f"step {j['line']} loss {1 / j['line']:.5f}"])
            out.append({"kind": "log", "job_id": job_id, "attempt": attempt, "lines": lines})
            out.append({"kind": "metrics", "run_id": j["run_id"], "source": "tb",
                        "points": [[k, j["line"], 1.0 / j["line"], now_ms()]
                                   for k in ("loss", "lr", "acc", "grad_norm")]})
        out.append({"kind": "node_stats",
                    "gpus": [{"index": i, "util": 90, "mem_used_mb": 1000, "mem_total_mb": 80_000,
                              "temp_c": 60, "power_w": 300, "fake": True}
                             for i in range(self.gpus)],
                    "host": {"cpu": 50, "mem_used_mb": 1000, "mem_total_mb": 64_000,
                             "disk_free_mb": 100_000}})
        return out

    def _send(self, msg):
        self.ws.send(json.dumps(msg))

    def stop(self):
        self.stop_event.set()
        try:
            self.ws.close()
        except Exception:
            pass


class Follower(threading.Thread):
    def __init__(self, url, token, job_id):
        super().__init__(daemon=True)
        self.url = f"{url}/api/v1/jobs/{job_id}/logs/stream?tail=0"
        self.token = token
        self.status = None
        self.lines = 0
        self.stop_event = threading.Event()
        self.resp = None

    def run(self):
        try:
            self.resp = requests.get(self.url, headers={"Authorization": f"Bearer {self.token}"},
                                     stream=True, timeout=(10, 60))
            self.status = self.resp.status_code
            if self.status != 200:
                self.resp.close()
                return
            for raw in self.resp.iter_lines(decode_unicode=True):
                if raw.startswith("data: "):
                    self.lines += 1
                if self.stop_event.is_set():
                    break
        except (requests.RequestException, AttributeError, ValueError):
            pass            # closed under us at stop

    def stop(self):
        self.stop_event.set()
        if self.resp is not None:
            self.resp.close()


class SlowClients(threading.Thread):
    """`n` connections that send part of their request headers and never the rest; one the
    server drops is replaced at once, so `n` are pending throughout."""

    def __init__(self, host, port, n):
        super().__init__(daemon=True)
        self.addr, self.n = (host, port), n
        self.sel = selectors.DefaultSelector()
        self.stop_event = threading.Event()
        self.dropped = 0

    def _open(self):
        s = socket.create_connection(self.addr, timeout=5)
        s.sendall(b"GET /api/v1/status HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        s.setblocking(False)
        self.sel.register(s, selectors.EVENT_READ)

    def run(self):
        for _ in range(self.n):
            self._open()
        while not self.stop_event.is_set():
            for key, _ in self.sel.select(timeout=0.2):
                s = key.fileobj
                try:
                    data = s.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    self.sel.unregister(s)
                    s.close()
                    self.dropped += 1
                    if not self.stop_event.is_set():
                        self._open()
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()

    def stop(self):
        self.stop_event.set()


def worker_pid(server_pid):
    import psutil
    kids = psutil.Process(server_pid).children()
    return kids[0].pid if kids else server_pid


def proc_sample(pid):
    """Threads, descriptors (those of the SQLite database, its -wal and -shm apart, in
    `db_fds`: a fixed pool of connections, gpuplane/db/__init__.py), RSS, CPU."""
    import psutil
    p = psutil.Process(pid)
    db_fds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").endswith((".db", ".db-wal", ".db-shm")):
                db_fds += 1
        except OSError:
            pass
    with p.oneshot():
        t = p.cpu_times()
        fds = p.num_fds()
        return {"threads": p.num_threads(), "fds": fds - db_fds, "db_fds": db_fds,
                "rss_mb": p.memory_info().rss / 2**20, "cpu_s": t.user + t.system}


def _poll_status(url, token, stop, out):
    """GET /api/v1/status every 50 ms until stop; sends (latencies, errors, nodes seen
    not connected) back through `out`."""
    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {token}"
    lat, errors, not_connected = [], [], []
    while not stop.is_set():
        t = time.monotonic()
        try:
            r = s.get(url + "/api/v1/status", timeout=30)
            ok = r.status_code == 200
            body = r.json() if ok else {}
        except requests.RequestException as e:
            ok, body = False, {}
            errors.append(repr(e))
        lat.append(time.monotonic() - t)
        if not ok:
            errors.append("status not 200")
        down = [n["name"] for n in body.get("nodes", []) if n["state"] != "connected"]
        if down:
            not_connected.append(down)
        stop.wait(0.05)
    out.send((lat, errors, not_connected))


def run_fleet(url, token, pid, agents=32, gpus=8, followers=100, slow=200, seconds=30.0,
              heartbeat_s=5.0, settle_s=10.0, log=print):
    """Run the load against a started server; returns the figures as a dict."""
    api = requests.Session()
    api.headers["Authorization"] = f"Bearer {token}"
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    api.get(url + "/api/v1/status", timeout=10).raise_for_status()
    base = proc_sample(pid)

    sims = []
    for i in range(agents):
        name = f"sim-{i:03d}"
        tok = api.post(url + "/api/v1/tokens", json={"name": name, "scope": "agent",
                                                     "node": name}, timeout=30).json()["token"]
        sims.append(SimAgent(url, tok, name, gpus, heartbeat_s=heartbeat_s))
    for s in sims:
        s.start()
    for s in sims:
        if not s.connected.wait(60):
            raise SystemExit(f"{s.node} did not connect: {s.errors}")
    job_ids = [api.post(url + "/api/v1/jobs", json={"command": ["train"], "working_dir": "/w",
                                                    "gpus": 1, "name": f"j{i}"},
                        timeout=30).json()["id"] for i in range(agents * gpus)]

    def all_running():
        r = api.get(url + "/api/v1/status", timeout=30).json()
        return sum(j["state"] == "RUNNING" for j in r["running"]) == len(job_ids)
    deadline = time.monotonic() + 120
    while not all_running():
        if time.monotonic() > deadline:
            raise SystemExit("the jobs did not all start within 120 s")
        time.sleep(0.5)
    log(f"{agents} agents x {gpus} GPUs connected, {len(job_ids)} jobs running")

    slow_clients = SlowClients(host, int(port), slow)
    fols = [Follower(url, token, job_ids[i % len(job_ids)]) for i in range(followers)]
    stop = threading.Event()
    peak = {"rss_mb": base["rss_mb"], "threads": base["threads"], "fds": base["fds"],
            "db_fds": base["db_fds"]}

    # The poller runs in a process of its own: in this one a hundred load threads share
    # the GIL, and their turns would be counted as the server's latency.
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    poll_stop = ctx.Event()
    reader, writer = ctx.Pipe(duplex=False)
    poller = ctx.Process(target=_poll_status, args=(url, token, poll_stop, writer), daemon=True)

    def sample():
        while not stop.is_set():
            cur = proc_sample(pid)
            for k in peak:
                peak[k] = max(peak[k], cur[k])
            stop.wait(0.5)

    cpu0, t0 = proc_sample(pid)["cpu_s"], time.monotonic()
    threads = [threading.Thread(target=sample, daemon=True)]
    for t in threads:
        t.start()
    poller.start()
    slow_clients.start()
    for f in fols:
        f.start()
    stop.wait(seconds)
    cpu1, t1 = proc_sample(pid)["cpu_s"], time.monotonic()
    stop.set()
    poll_stop.set()
    lat, errors, not_connected = reader.recv()
    poller.join(30)
    for t in threads:
        t.join(30)
    jobs_after = api.get(url + "/api/v1/jobs?limit=10000", timeout=30).json()["jobs"]
    lost = [j["id"] for j in jobs_after if j["attempt"] != 1 or j["state"] != "RUNNING"]

    # The load stops: followers hang up, slow clients go, agents disconnect.
    for f in fols:
        f.stop()
    slow_clients.stop()
    for s in sims:
        s.stop()
    stopped = time.monotonic()
    after, settled = None, None
    while time.monotonic() - stopped < settle_s + 20:
        after = proc_sample(pid)
        if (after["threads"] <= base["threads"] and after["fds"] <= base["fds"]
                and after["db_fds"] <= base["db_fds"]):
            settled = time.monotonic() - stopped
            break
        time.sleep(0.25)
    lat.sort()
    pct = (lambda q: round(lat[min(len(lat) - 1, int(len(lat) * q))] * 1000, 1)) if lat else None
    return {
        "agents": agents, "gpus": gpus, "jobs": len(job_ids), "followers": followers,
        "followers_admitted": sum(f.status == 200 for f in fols),
        "followers_503": sum(f.status == 503 for f in fols),
        "follower_lines": sum(f.lines for f in fols),
        "slow_clients": slow, "slow_dropped_by_server": slow_clients.dropped,
        "seconds": seconds, "status_requests": len(lat), "status_errors": len(errors),
        "status_p50_ms": pct(0.5) if lat else None, "status_p99_ms": pct(0.99) if lat else None,
        "status_max_ms": round(lat[-1] * 1000, 1) if lat else None,
        "nodes_seen_not_connected": len(not_connected), "jobs_lost": len(lost),
        "agent_errors": sum(len(s.errors) for s in sims),
        "agent_batches": sum(s.batches for s in sims),
        "worker_cpu_pct": round(100 * (cpu1 - cpu0) / (t1 - t0), 1),
        "rss_base_mb": round(base["rss_mb"], 1), "rss_peak_mb": round(peak["rss_mb"], 1),
        "threads_base": base["threads"], "threads_peak": peak["threads"],
        "threads_after": after["threads"], "fds_base": base["fds"], "fds_peak": peak["fds"],
        "fds_after": after["fds"], "db_fds_base": base["db_fds"], "db_fds_peak": peak["db_fds"],
        "db_fds_after": after["db_fds"],
        "back_to_baseline_s": round(settled, 1) if settled is not None else None,
    }


def main():
    from harness import free_port, start_server, stop_server
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=32)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--followers", type=int, default=100)
    ap.add_argument("--slow", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--baseline", action="store_true",
                    help="also run the agents alone (no followers, no slow clients)")
    args = ap.parse_args()
    runs = [("fleet", args.followers, args.slow)]
    if args.baseline:
        runs.insert(0, ("baseline (agents only)", 0, 0))
    results = {}
    for label, followers, slow in runs:
        home = pathlib.Path(tempfile.mkdtemp(prefix="gpuplane-fleet-"))
        port = free_port()
        # server.toml defaults for the thread budget: threads 112, agent_threads 32
        proc, url, token = start_server(home, port, threads=112)
        try:
            r = run_fleet(url, token, worker_pid(proc.pid), args.agents, args.gpus,
                          followers, slow, args.seconds)
        finally:
            stop_server(proc)
        results[label] = r
        print(f"{label}: " + " ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    fleet = results["fleet"]
    if args.baseline:
        b = results["baseline (agents only)"]
        if b["status_p99_ms"]:
            print(f"status p99 ratio fleet/baseline: {fleet['status_p99_ms'] / b['status_p99_ms']:.2f}")
    ok = (fleet["status_p99_ms"] is not None and fleet["status_p99_ms"] < 200
          and not fleet["nodes_seen_not_connected"] and not fleet["jobs_lost"]
          and fleet["back_to_baseline_s"] is not None and fleet["back_to_baseline_s"] <= 10)
    print("PASS" if ok else "FAIL: p99 >= 200 ms, a node lost, or not back to baseline in 10 s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
