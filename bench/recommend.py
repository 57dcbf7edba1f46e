"""GET /checkpoints:recommend over a big experiment, through REST, beside a naive baseline.

The experiment (default: 100 runs x 50 checkpoints, 1M points per run over 4 keys, one
evaluated checkpoint per run) is written straight into SQLite (recursive CTEs, seconds per
million points), then a real server (gunicorn) answers the recommendation. The baseline
does the same work the obvious way, in-process on the same file: per checkpoint, one
query for the point at or below its step, one above, one for the value, then a Python sort.

    python bench/recommend.py                      # full size: ~100M points, a few GB
    python bench/recommend.py --runs 10 --points 100000 --requests 10   # a quick look
"""
import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import psutil
import requests

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from bench.harness import free_port, start_server, stop_server  # noqa: E402
from gpuplane.db import Database, dumps, now_ms  # noqa: E402

KEYS = ("train/loss", "train/acc", "val/loss", "lr")
PRIMARY = "val/loss"


def build(home, runs, ckpts, points):
    db = Database(home / "server" / "gpuctl.db")
    steps = points // len(KEYS)
    t0 = time.perf_counter()
    with db.tx() as c:
        ts = now_ms()
        c.execute("INSERT OR IGNORE INTO projects (name, created_at) VALUES ('bench', ?)", (ts,))
        c.execute("INSERT INTO experiments (project, name, created_at) VALUES ('bench', 'big', ?)",
                  (ts,))
        c.execute("INSERT INTO metric_definitions (key, project, experiment, is_primary,"
                  " updated_at) VALUES (?, 'bench', '', 1, ?)", (PRIMARY, ts))
    for r in range(runs):
        with db.tx() as c:
            run_id = c.execute(
                "INSERT INTO runs (source, state, project, experiment, name, config, created_at)"
                " VALUES ('sdk', 'SUCCEEDED', 'bench', 'big', ?, '{}', ?)",
                (f"run-{r}", ts)).lastrowid
            for k in KEYS:
                key_id = c.execute("INSERT INTO metric_keys (run_id, key) VALUES (?, ?)",
                                   (run_id, k)).lastrowid
                # a decreasing curve with noise, a little different per run
                c.execute(
                    "INSERT INTO points (key_id, step, value, ts) WITH RECURSIVE s(x) AS"
                    " (SELECT 0 UNION ALL SELECT x + 1 FROM s WHERE x < ?)"
                    " SELECT ?, x, 1.0 / (1 + x * 0.0001) + ? + (abs(random()) % 1000) / 1e5,"
                    " ? + x FROM s", (steps - 1, key_id, r * 1e-4, ts))
            last = None
            for i in range(ckpts):
                step = (i + 1) * (steps // ckpts) - 1
                last = c.execute(
                    "INSERT INTO checkpoints (run_id, path, step, step_source, size_bytes,"
                    " format, source, created_at, updated_at) VALUES (?,?,?,'given',?,"
                    " 'pt','sdk',?,?)", (run_id, f"/ckpt/run{r}/step{step}.pt", step, 1 << 20,
                                         ts, ts)).lastrowid
            # one evaluated checkpoint per run: an EVALUATE job whose run logged val/loss
            job_id = c.execute(
                "INSERT INTO jobs (name, kind, command, working_dir, state, env, created_at,"
                " queued_at) VALUES ('eval', 'EVALUATE', '[\"true\"]', '/w', 'SUCCEEDED', '{}',"
                " ?, ?)", (ts, ts)).lastrowid
            eval_run = c.execute(
                "INSERT INTO runs (job_id, attempt, source, state, project, experiment, config,"
                " created_at) VALUES (?, 1, 'job', 'SUCCEEDED', 'bench', 'big', '{}', ?)",
                (job_id, ts)).lastrowid
            c.execute("UPDATE jobs SET run_id = ? WHERE id = ?", (eval_run, job_id))
            kid = c.execute("INSERT INTO metric_keys (run_id, key) VALUES (?, ?)",
                            (eval_run, PRIMARY)).lastrowid
            c.execute("INSERT INTO points (key_id, step, value, ts) VALUES (?, 0, ?, ?)",
                      (kid, 0.5 + r * 1e-3, ts))
            c.execute("INSERT INTO evaluations (checkpoint_id, job_id, command, created_at)"
                      " VALUES (?, ?, ?, ?)", (last, job_id, dumps(["true"]), ts))
        print(f"\r  built run {r + 1}/{runs}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    with db.read() as conn:
        conn.execute("ANALYZE")
    db.close()
    return time.perf_counter() - t0


def naive(path):
    """The recommendation the obvious way: three queries per checkpoint, a Python sort."""
    db = Database(path)
    with db.read() as conn:
        cks = conn.execute(
            "SELECT c.id, c.run_id, c.step FROM checkpoints c JOIN runs r ON r.id = c.run_id"
            " WHERE r.project = 'bench' AND r.experiment = 'big'").fetchall()
        evals = {}
        for cid, run_id in conn.execute(
                "SELECT e.checkpoint_id, j.run_id FROM evaluations e JOIN jobs j ON j.id = e.job_id"
                " WHERE j.state = 'SUCCEEDED'"):
            kid = conn.execute("SELECT id FROM metric_keys WHERE run_id = ? AND key = ?",
                               (run_id, PRIMARY)).fetchone()
            if kid:
                evals[cid] = conn.execute("SELECT value FROM points WHERE key_id = ?"
                                          " ORDER BY step DESC LIMIT 1", (kid[0],)).fetchone()[0]
        rows = []
        for cid, run_id, step in cks:
            kid = conn.execute("SELECT id FROM metric_keys WHERE run_id = ? AND key = ?",
                               (run_id, PRIMARY)).fetchone()[0]
            lo = conn.execute("SELECT step FROM points WHERE key_id = ? AND step <= ?"
                              " ORDER BY step DESC LIMIT 1", (kid, step)).fetchone()
            hi = conn.execute("SELECT step FROM points WHERE key_id = ? AND step > ?"
                              " ORDER BY step LIMIT 1", (kid, step)).fetchone()
            at = min([s[0] for s in (lo, hi) if s], key=lambda s: abs(s - step))
            v = conn.execute("SELECT value FROM points WHERE key_id = ? AND step = ?",
                             (kid, at)).fetchone()[0]
            rows.append((0 if cid in evals else 1, evals.get(cid, v), cid))
    rows.sort()
    db.close()
    return rows[0][2]


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--checkpoints", type=int, default=50, help="per run")
    ap.add_argument("--points", type=int, default=1_000_000, help="per run, over 4 keys")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--keep", metavar="DIR", help="build in (or reuse) DIR instead of a temp dir")
    args = ap.parse_args()
    home = pathlib.Path(args.keep) if args.keep else pathlib.Path(tempfile.mkdtemp(
        prefix="gpuplane-bench-recommend-"))
    db_path = home / "server" / "gpuctl.db"
    try:
        if not db_path.exists():
            took = build(home, args.runs, args.checkpoints, args.points)
            print(f"built {args.runs} runs x {args.checkpoints} checkpoints, "
                  f"{args.runs * args.points:,} points in {took:.0f} s "
                  f"({db_path.stat().st_size / 1e9:.1f} GB)")
        proc, url, token = start_server(home, free_port())
        try:
            s = requests.Session()
            s.headers["Authorization"] = f"Bearer {token}"
            q = f"{url}/api/v1/checkpoints:recommend?project=bench&experiment=big"
            first = s.get(q, timeout=120)
            first.raise_for_status()
            answer = first.json()
            # the server's CPU per request (the process tree of gunicorn): unlike wall
            # time, it does not grow with whatever else the machine is running
            tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(True)
            cpu0 = sum(sum(p.cpu_times()[:2]) for p in tree)
            times = []
            for _ in range(args.requests):
                t = time.perf_counter()
                r = s.get(q, timeout=120)
                times.append((time.perf_counter() - t) * 1000)
                r.raise_for_status()
            server_cpu = (sum(sum(p.cpu_times()[:2]) for p in tree) - cpu0) / args.requests
        finally:
            stop_server(proc)
        base = []
        for _ in range(max(3, args.requests // 10)):
            t = time.perf_counter()
            naive_pick = naive(db_path)
            base.append((time.perf_counter() - t) * 1000)
        pick = answer["checkpoint"]["checkpoint_id"]
        assert pick == naive_pick, (pick, naive_pick)
        p50, b50 = statistics.median(times), statistics.median(base)
        print(json.dumps({
            "candidates": answer["candidates"], "evaluated": answer["evaluated"],
            "recommend_rest_ms": {"p50": round(p50, 1), "p90": round(pct(times, 90), 1),
                                  "max": round(max(times), 1)},
            "server_cpu_ms_per_request": round(server_cpu * 1000, 1),
            "naive_in_process_ms": {"p50": round(b50, 1), "max": round(max(base), 1)},
            "load_average": [round(x, 1) for x in os.getloadavg()],
            "cpus": os.cpu_count(),
            "naive_over_rest_p50": round(b50 / p50, 1), "same_pick": True}, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
