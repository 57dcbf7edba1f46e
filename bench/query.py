"""Downsampled series query latency on a long run, over REST from a real server.

A run with 1 000 000 points on one key is written through the ingest function, the
rollup catches up, then a real gunicorn server answers ~50 series queries
(`GET /api/v1/runs/ID/metrics/KEY?max_points=1000&from_step=&to_step=`) over varying
ranges. Reported beside the naive way, a GROUP BY over the raw table for the same ranges
and bucket count, timed in the same run. Medians and p95.

    .venv/bin/python bench/query.py [--points 1000000] [--requests 50]
"""
import argparse
import pathlib
import random
import sqlite3
import statistics
import sys
import tempfile
import time

import requests

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from gpuplane import rollup  # noqa: E402
from gpuplane.db import Database, metrics, runs  # noqa: E402
from harness import free_port, start_server, stop_server  # noqa: E402

KEY = "train/loss"


def fill(db, n):
    with db.tx() as c:
        run_id = runs.create(c, source="sdk", state="RUNNING", name="long")
    rnd = random.Random(1)
    ts = int(time.time() * 1000)
    t0 = time.perf_counter()
    for start in range(0, n, 10_000):
        pts = [[0, s, 2.0 / (1 + s / 10_000) + rnd.random() * 0.05, ts]
               for s in range(start, min(n, start + 10_000))]
        with db.tx() as c:
            metrics.ingest(c, run_id, [KEY], pts)
    t_ingest = time.perf_counter() - t0
    t0 = time.perf_counter()
    rollup.roll_up(db)
    return run_id, t_ingest, time.perf_counter() - t0


def ranges(n, count):
    rnd = random.Random(7)
    out = [(None, None)] * 10
    while len(out) < count:
        a = rnd.randrange(0, n)
        b = rnd.randrange(a, n)
        if b - a > 20_000:
            out.append((a, b))
    return out


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=1_000_000)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--max-points", type=int, default=1000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuplane-bench-") as tmp:
        home = pathlib.Path(tmp) / "home"
        db = Database(home / "server" / "gpuctl.db")
        run_id, t_ingest, t_roll = fill(db, args.points)
        key_id = metrics.key_id(db, run_id, KEY)
        db.close()
        print(f"{args.points:,} points: ingest {t_ingest:.1f} s "
              f"({args.points / t_ingest:,.0f}/s in-process), rollup catch-up {t_roll:.1f} s",
              flush=True)
        proc, url, token = start_server(home, free_port(), 8)
        qs = ranges(args.points, args.requests)
        rest, sizes = [], []
        try:
            s = requests.Session()
            s.headers["Authorization"] = f"Bearer {token}"
            for a, b in qs[:3]:       # warm up the connection and the page cache
                s.get(f"{url}/api/v1/runs/{run_id}/metrics/{KEY}", timeout=60)
            for a, b in qs:
                params = {"max_points": args.max_points, "from_step": a, "to_step": b}
                t0 = time.perf_counter()
                r = s.get(f"{url}/api/v1/runs/{run_id}/metrics/{KEY}", params=params,
                          timeout=60)
                rest.append(time.perf_counter() - t0)
                r.raise_for_status()
                sizes.append(len(r.json()["points"]))
            t0 = time.perf_counter()
            r = s.get(f"{url}/api/v1/runs/{run_id}/metrics", timeout=60)
            t_summary = time.perf_counter() - t0
            r.raise_for_status()
        finally:
            stop_server(proc)
        conn = sqlite3.connect(home / "server" / "gpuctl.db")
        naive = []
        for a, b in qs:
            a = 0 if a is None else a
            b = args.points - 1 if b is None else b
            w = max(1, -(-(b - a + 1) // args.max_points))
            t0 = time.perf_counter()
            conn.execute("SELECT min(step), min(value), max(value), avg(value), count(*)"
                         " FROM points WHERE key_id = ? AND step BETWEEN ? AND ?"
                         " GROUP BY step / ?", (key_id, a, b, w)).fetchall()
            naive.append(time.perf_counter() - t0)
        conn.close()
    ms = 1000
    print(f"\nseries query, {len(qs)} requests over varying ranges, max_points="
          f"{args.max_points} (answers had {min(sizes)}-{max(sizes)} points):")
    print(f"  REST, rollups         p50 {statistics.median(rest) * ms:7.1f} ms"
          f"   p95 {pct(rest, 95) * ms:7.1f} ms")
    print(f"  naive GROUP BY (SQL)  p50 {statistics.median(naive) * ms:7.1f} ms"
          f"   p95 {pct(naive, 95) * ms:7.1f} ms   (raw table, no HTTP, same run)")
    print(f"  ratio (p50)           {statistics.median(naive) / statistics.median(rest):7.1f} x"
          f" faster   (goal: p50 < 50 ms)")
    print(f"  run summary (GET /runs/ID/metrics): {t_summary * ms:.1f} ms")


if __name__ == "__main__":
    main()
