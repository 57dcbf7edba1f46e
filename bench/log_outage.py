"""Agent memory and disk while the server is away, and every log line once when it returns.

    .venv/bin/python bench/log_outage.py [--mb 1024] [--line 100]

A real agent (`python agent.py`) against a small stand-in server (tests/fake_server.py,
which checks each log line as it arrives instead of keeping it). The server starts a
job that waits for a gate; the server then goes away (it drops the connection and refuses
the agent's token, so every reconnect fails) and the job writes `--mb` MB of numbered
lines and exits. The agent's RSS is sampled every 0.2 s through the outage and the
drain; its spool size too. Then the server comes back and the run ends when the job's
EXITED record arrives: every line must have arrived exactly once, in order. The temp
home is removed at the end. The baseline printed beside the agent's peak is its RSS when
idle and connected, before the job.
"""
import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import psutil

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fake_server import FakeServer  # noqa: E402


class CountingServer(FakeServer):
    """Applies batches like FakeServer, but checks log lines instead of storing them."""

    def __init__(self, line_bytes):
        super().__init__(heartbeat_s=2.0)
        self.line_bytes = line_bytes
        self.next_line = 1
        self.bad = []
        self.exited = None

    def _handle(self, msg):
        if msg["type"] != "batch" or not self.ack:
            return super()._handle(msg)
        with self.lock:
            new = [r for r in msg["records"] if r["seq"] > self.cursor]
            if new and new[0]["seq"] != self.cursor + 1:
                return {"type": "resend", "from": self.cursor + 1}
            for r in new:
                if r["kind"] == "log":
                    for no, _ts, text in r["lines"]:
                        want = line_text(no, self.line_bytes)
                        if no != self.next_line or text != want:
                            if len(self.bad) < 5:
                                self.bad.append((no, self.next_line, text[:40]))
                        self.next_line = no + 1
                elif r["kind"] == "job":
                    self.applied.append(r)
                    if r["state"] == "EXITED":
                        self.exited = r
            if new:
                self.cursor = new[-1]["seq"]
            return {"type": "ack", "seq": self.cursor}


def line_text(no, width):
    head = f"{no:010d} "
    return head + "x" * (width - len(head) - 1)


JOB = """
import os, sys, time
gate, n, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
while not os.path.exists(gate):
    time.sleep(0.05)
pad = "x" * (width - 12)
out = sys.stdout
buf = []
for no in range(1, n + 1):
    buf.append(f"{no:010d} {pad}\\n")
    if len(buf) == 10000:
        out.write("".join(buf)); buf.clear()
out.write("".join(buf))
out.flush()
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=1024)
    ap.add_argument("--line", type=int, default=100, help="bytes a line, newline included")
    args = ap.parse_args()
    n_lines = int(args.mb * 2**20 // args.line)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="gpuplane-outage-"))
    server = CountingServer(args.line)
    agent = None
    try:
        home, work = tmp / "home", tmp / "work"
        work.mkdir(parents=True)
        (work / "job.py").write_text(JOB)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
        env["GPUCTL_TOKEN"] = server.token
        agent = subprocess.Popen(
            [sys.executable, str(ROOT / "agent.py"), "--server", server.url, "--name", "outage",
             "--home", str(home), "--fake-gpus", "1"], cwd=ROOT, env=env,
            stdout=open(tmp / "agent.log", "ab"), stderr=subprocess.STDOUT,
            start_new_session=True)
        server.wait_for(lambda: server.syncs, 60, "agent connected")
        proc = psutil.Process(agent.pid)
        base_rss = proc.memory_info().rss
        gate = work / "gate"
        server.send({"type": "start", "job_id": 1, "attempt": 1, "run_id": 1,
                     "command": [sys.executable, "job.py", str(gate), str(n_lines),
                                 str(args.line)],
                     "working_dir": str(work), "env": {}, "gpus": [], "cpu_only": True,
                     "tb_dir": None, "watch_dir": None, "server_url": server.url,
                     "ingest_token": "gpi_x"})
        server.wait_for(lambda: server.records("job"), 60, "RUNNING")
        # the server goes away
        real_token, server.token = server.token, "refused-during-the-outage"
        server.drop()
        peak = {"outage": 0, "drain": 0, "spool": 0}
        phase = ["outage"]
        spool = home / "agent" / "spool" / "outbox.jsonl"
        stop = threading.Event()

        def sample():
            while not stop.wait(0.2):
                try:
                    rss = proc.memory_info().rss
                    peak[phase[0]] = max(peak[phase[0]], rss)
                    peak["spool"] = max(peak["spool"], spool.stat().st_size)
                except (psutil.Error, OSError):
                    pass
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.monotonic()
        gate.touch()
        exit_file = home / "agent" / "jobs" / "1" / "1" / "exit"
        server.wait_for(exit_file.exists, 3600, "the job to finish writing")
        write_s = time.monotonic() - t0
        log_size = (home / "agent" / "jobs" / "1" / "1" / "log").stat().st_size
        time.sleep(2)         # the agent reads what its cap allows, then waits
        phase[0] = "drain"
        server.token = real_token            # the server is back
        t1 = time.monotonic()
        server.wait_for(lambda: server.exited, 7200, "EXITED after the drain")
        drain_s = time.monotonic() - t1
        stop.set()
        sampler.join()
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(30)
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    mb = lambda b: f"{b / 2**20:.1f} MB"
    ok = not server.bad and server.next_line == n_lines + 1
    print(f"log of {mb(log_size)} ({n_lines} lines of {args.line} bytes) written in "
          f"{write_s:.1f} s while the server was away; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"  agent RSS: idle {mb(base_rss)}, peak during the outage {mb(peak['outage'])}, "
          f"peak during the drain {mb(peak['drain'])}")
    print(f"  spool file peak: {mb(peak['spool'])} (the rest waited in the job's own log)")
    print(f"  drain after the server came back: {drain_s:.1f} s "
          f"({log_size / 2**20 / drain_s:.1f} MB/s)")
    print(f"  every line once, in order: {'yes' if ok else 'NO'} "
          f"(last line {server.next_line - 1} of {n_lines}; first problems {server.bad})")
    print(json.dumps({"exited": server.exited and server.exited["failure_kind"]}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
