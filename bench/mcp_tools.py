"""MCP tool latency over stdio, and the semantic tools on a long run.

A run with 1 000 000 points of train/loss, val/loss at 50 checkpoint steps and 50
checkpoints is written through the storage functions and rolled up; a real gunicorn server
serves it; `gpuplane-mcp` runs over stdio, driven by the mcp package's client. Timed:
- an observe tool (get_run, get_metric_summary) through MCP, beside the same REST call
  made directly (the cost MCP adds);
- diagnose_run and get_best_checkpoint through MCP, beside the naive way: judging the
  curve from all of its raw points (loaded with SQL, no HTTP) in the same run.
Medians and p95.

    .venv/bin/python bench/mcp_tools.py [--points 1000000] [--calls 50]
"""
import argparse
import asyncio
import math
import pathlib
import random
import statistics
import sys
import tempfile
import time

import requests

BENCH = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from gpuplane import rollup, semantic  # noqa: E402
from gpuplane.db import Database, checkpoints, metrics, runs  # noqa: E402
from harness import ROOT, free_port, start_server, stop_server  # noqa: E402


CHECKPOINTS = 50


def fill(db, n):
    with db.tx() as c:
        run_id = runs.create(c, source="sdk", state="SUCCEEDED", name="long",
                             config={"lr": 0.01})
    rnd = random.Random(1)
    ts = int(time.time() * 1000)
    every = n // CHECKPOINTS
    for start in range(0, n, 10_000):
        pts = [[0, s, 0.3 + 2.0 / (1 + s / 10_000) + rnd.gauss(0, 0.02), ts]
               for s in range(start, min(n, start + 10_000))]
        with db.tx() as c:
            metrics.ingest(c, run_id, ["train/loss"], pts)
    with db.tx() as c:
        val = [[0, s, 0.4 + 2.0 / (1 + s / 10_000) + 0.1 * (s / n) ** 2 + rnd.gauss(0, 0.005), ts]
               for s in range(every, n + 1, every)]
        metrics.ingest(c, run_id, ["val/loss"], val)
        for s in range(every, n + 1, every):
            checkpoints.register(c, run_id, f"/ckpt/step-{s}.pt", step=s, size_bytes=1 << 20,
                                 ts=ts)
    rollup.roll_up(db)
    return run_id


def naive_diagnose(path, run_id):
    """The curve judged from every raw point (what a tool without rollups would do): read
    them all with SQL, then the same rules (which judge a long curve as bucket means)."""
    import sqlite3
    conn = sqlite3.connect(path)
    t0 = time.perf_counter()
    keys = []
    for key_id, key in conn.execute("SELECT id, key FROM metric_keys WHERE run_id = ?",
                                    (run_id,)):
        pts = conn.execute("SELECT step, value FROM points WHERE key_id = ? ORDER BY step",
                           (key_id,)).fetchall()
        keys.append({"key": key, "direction": semantic.direction(key), "points": pts,
                     "count": len(pts), "latest": {"step": pts[-1][0], "value": pts[-1][1]}})
    semantic.diagnose_run({"id": run_id, "state": "SUCCEEDED"}, keys)
    conn.close()
    return time.perf_counter() - t0


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def drive(url, token, run_id, calls):
    from mcp import Client, StdioServerParameters
    params = StdioServerParameters(
        command=sys.executable, args=[str(ROOT / "mcp_server.py")], cwd=str(ROOT),
        env={"GPUCTL_SERVER": url, "GPUCTL_TOKEN": token, "PYTHONPATH": str(ROOT)})
    out = {}
    async with Client(params) as client:
        for name, args, n in [("get_run", {"run_id": run_id}, calls),
                              ("get_metric_summary", {"run_id": run_id}, calls),
                              ("diagnose_run", {"run_id": run_id}, max(10, calls // 2)),
                              ("get_best_checkpoint", {"run_id": run_id, "key": "val/loss"},
                               max(10, calls // 2))]:
            await client.call_tool(name, args)          # warm up
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                r = await client.call_tool(name, args)
                times.append(time.perf_counter() - t0)
                assert not r.is_error, r.content
            out[name] = (times, r.structured_content)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=1_000_000)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuplane-bench-") as tmp:
        home = pathlib.Path(tmp) / "home"
        db = Database(home / "server" / "gpuctl.db")
        t0 = time.perf_counter()
        run_id = fill(db, args.points)
        db.close()
        print(f"run {run_id}: {args.points:,} points, {CHECKPOINTS} checkpoints, written and "
              f"rolled up in {time.perf_counter() - t0:.1f} s", flush=True)
        proc, url, token = start_server(home, free_port(), 8)
        try:
            s = requests.Session()
            s.headers["Authorization"] = f"Bearer {token}"
            direct = {}
            for name, path in [("get_run", f"runs/{run_id}"),
                               ("get_metric_summary", f"runs/{run_id}/metrics"),
                               ("diagnose_run", f"runs/{run_id}/diagnosis")]:
                s.get(f"{url}/api/v1/{path}", timeout=60).raise_for_status()
                times = []
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    s.get(f"{url}/api/v1/{path}", timeout=60).raise_for_status()
                    times.append(time.perf_counter() - t0)
                direct[name] = times
            via_mcp = asyncio.run(drive(url, token, run_id, args.calls))
        finally:
            stop_server(proc)
        naive = [naive_diagnose(home / "server" / "gpuctl.db", run_id) for _ in range(3)]
    ms = 1000
    print(f"\nover stdio (gpuplane-mcp, the mcp client), {args.calls} calls each after a "
          "warm-up; p50 / p95:")
    for name, (times, result) in via_mcp.items():
        line = (f"  {name:20s} MCP  p50 {statistics.median(times) * ms:6.1f} ms  "
                f"p95 {pct(times, 95) * ms:6.1f} ms")
        if name in direct:
            d = direct[name]
            line += (f"   | REST direct p50 {statistics.median(d) * ms:6.1f} ms  "
                     f"(MCP adds {(statistics.median(times) - statistics.median(d)) * ms:.1f} ms)")
        print(line)
    d_times, diag = via_mcp["diagnose_run"]
    b_times, best = via_mcp["get_best_checkpoint"]
    print(f"\ndiagnose_run verdict: {diag['verdict']} ({diag['summary']})")
    print(f"get_best_checkpoint: {best['reason']}")
    print(f"\nbaseline, diagnose from all {args.points:,} raw points (SQL + the same rules, "
          f"no HTTP): p50 {statistics.median(naive) * ms:.0f} ms over {len(naive)} runs")
    print(f"ratio (p50): diagnose_run over MCP is "
          f"{statistics.median(naive) / statistics.median(d_times):.1f}x faster")
    goals = [("observe (get_run) p50 < 30 ms", statistics.median(via_mcp["get_run"][0]) < 0.030),
             ("diagnose_run p50 < 200 ms", statistics.median(d_times) < 0.200),
             ("get_best_checkpoint p50 < 200 ms", statistics.median(b_times) < 0.200)]
    for text, met in goals:
        print(f"goal {text}: {'met' if met else 'NOT met'}")
    if not math.isfinite(statistics.median(d_times)):
        sys.exit(1)


if __name__ == "__main__":
    main()
