"""Metric ingest throughput: SDK-like client processes -> real gunicorn server -> SQLite.

Starts `gpuplane.server.serve` (one gthread worker, as in production) on a free port in a
temp home, registers one run per client, and has several client PROCESSES post batches
(of the SDK's size, 5000 points; --batch) in the compact wire format as fast as they
can. Reports the points stored per second (rows counted in the database afterwards)
beside the ceiling: a bare `executemany` of the same rows into the same `points` schema
on a temp file, in the same run. Medians over --trials.

    .venv/bin/python bench/ingest.py [--clients 3] [--seconds 5] [--trials 3] [--batch N]

With --compare-events a second server runs beside the first with the event engine off
(`[events] enabled = false`); every trial measures both, in alternating order, and the
table adds the ratio with / without the detector (goal >= 0.9).
"""
import argparse
import json
import multiprocessing as mp
import os
import pathlib
import sqlite3
import statistics
import sys
import tempfile
import time

import requests

from gpuctl.sender import BATCH_MAX as SDK_BATCH
from harness import free_port, start_server, stop_server
KEYS = ["train/loss", "train/acc", "train/lr", "train/grad_norm"]


def client(url, token, run_id, start_at, seconds, step0, result, fmt, batch):
    """One SDK-like process: build each batch, serialise it, POST it, repeat."""
    from gpuplane.metricwire import BINARY_TYPE, encode_binary
    session = requests.Session()
    session.headers.update({"Authorization": f"Bearer {token}",
                            "Content-Type": BINARY_TYPE if fmt == "binary"
                            else "application/json"})
    per_key = batch // len(KEYS)
    step = step0
    sent = 0
    while time.time() < start_at:
        time.sleep(0.001)
    end = start_at + seconds
    while time.time() < end:
        ts = int(time.time() * 1000)
        points = [[k, s, 1.0 / (1 + s) + k, ts]
                  for s in range(step, step + per_key) for k in range(len(KEYS))]
        if fmt == "binary":
            body = encode_binary(KEYS, points)
        else:
            body = json.dumps({"keys": KEYS, "points": points})
        r = session.post(f"{url}/api/v1/runs/{run_id}/metrics", data=body, timeout=60)
        if r.status_code != 200:
            result.put(("error", r.status_code, r.text[:300]))
            return
        sent += r.json()["accepted"]
        step += per_key
    result.put(("ok", sent, time.time() - start_at))


def worker_pid(master):
    """The gunicorn worker: the master's only child."""
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == master:
                return int(entry.name)
    return None


def cpu_seconds(pid):
    """User + system CPU time of a process (all its threads)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid, comm):
    """CPU time of the process's threads named `comm` (the server names its Workers'
    OS threads, e.g. gpuplane-rollup)."""
    total = 0.0
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() != comm:
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def ingest_trial(url, token, db_path, clients, seconds, worker, fmt, batch):
    runs = []
    for i in range(clients):
        r = requests.post(f"{url}/api/v1/runs", json={"name": f"bench-{i}", "source": "sdk"},
                          headers={"Authorization": f"Bearer {token}"}, timeout=30)
        r.raise_for_status()
        runs.append(r.json()["id"])
    before = count_points(db_path)
    cpu0 = cpu_seconds(worker)
    rollup0 = thread_cpu_seconds(worker, "gpuplane-rollup")
    result = mp.Queue()
    start_at = time.time() + 1.0
    procs = [mp.Process(target=client,
                        args=(url, token, run_id, start_at, seconds, 0, result, fmt, batch))
             for run_id in runs]
    for p in procs:
        p.start()
    outs = [result.get(timeout=seconds + 120) for _ in procs]
    # The server's CPU per point counts the rollup's catch-up after the clients stop:
    # work the rollup puts off is not work saved.
    rolled_up(db_path)
    cpu = cpu_seconds(worker) - cpu0
    rollup_cpu = thread_cpu_seconds(worker, "gpuplane-rollup") - rollup0
    for p in procs:
        p.join(30)
    errors = [o for o in outs if o[0] == "error"]
    if errors:
        sys.exit(f"a client got an error: {errors[0]}")
    elapsed = max(o[2] for o in outs)
    stored = count_points(db_path) - before
    sent = sum(o[1] for o in outs)
    # a trial starved of every CPU tick (load far above the cores) measured no server CPU
    per_cpu = stored / cpu if cpu else float("nan")
    return stored / elapsed, stored, sent, per_cpu, rollup_cpu / cpu if cpu else 0.0


def rolled_up(db_path, timeout=300):
    """Wait until the rollup thread has no dirty range left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conn = sqlite3.connect(db_path, timeout=60)
        try:
            if not conn.execute("SELECT count(*) FROM metric_dirty").fetchone()[0]:
                return
        finally:
            conn.close()
        time.sleep(0.2)
    sys.exit("the rollup did not catch up")


def count_points(db_path):
    conn = sqlite3.connect(db_path, timeout=60)
    try:
        return conn.execute("SELECT count(*) FROM points").fetchone()[0]
    finally:
        conn.close()


def ceiling(tmpdir, seconds, batch):
    """Bare executemany of the same rows into the same table, same batch size, WAL."""
    path = pathlib.Path(tmpdir) / f"ceiling-{time.monotonic_ns()}.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("CREATE TABLE points (key_id INTEGER NOT NULL, step INTEGER NOT NULL,"
                 " value REAL, ts INTEGER NOT NULL, PRIMARY KEY (key_id, step)) WITHOUT ROWID")
    per_key = batch // len(KEYS)
    step, n = 0, 0
    t0 = time.perf_counter()
    c0 = time.process_time()
    while time.perf_counter() - t0 < seconds:
        ts = int(time.time() * 1000)
        rows = [(k + 1, s, 1.0 / (1 + s) + k, ts)
                for s in range(step, step + per_key) for k in range(len(KEYS))]
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT OR REPLACE INTO points VALUES (?,?,?,?)", rows)
        conn.execute("COMMIT")
        step += per_key
        n += len(rows)
    rate = n / (time.perf_counter() - t0)
    per_cpu = n / (time.process_time() - c0)
    conn.close()
    return rate, per_cpu


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--format", choices=("json", "binary", "both"), default="both",
                    help="wire format of the batches (docs/api.md)")
    ap.add_argument("--compare-events", action="store_true",
                    help="also measure a server with the event engine off, same trials")
    ap.add_argument("--batch", type=int, default=SDK_BATCH,
                    help="points per POST and rows per ceiling transaction "
                         "(default: the SDK's, %(default)s)")
    args = ap.parse_args()
    formats = ("json", "binary") if args.format == "both" else (args.format,)
    mp.set_start_method("spawn")
    med = statistics.median
    with tempfile.TemporaryDirectory(prefix="gpuplane-bench-") as tmp:
        home = pathlib.Path(tmp) / "home"
        proc, url, token = start_server(home, free_port(), args.threads)
        db_path = home / "server" / "gpuctl.db"
        worker = worker_pid(proc.pid)
        off = None
        if args.compare_events:
            home_off = pathlib.Path(tmp) / "home-no-events"
            off = start_server(home_off, free_port(), args.threads,
                               extra="[events]\nenabled = false\n")
            off_db, off_worker = home_off / "server" / "gpuctl.db", worker_pid(off[0].pid)
            no_events = {f: [] for f in formats}
        results = {f: ([], [], []) for f in formats}
        ceilings, cpu_ceilings = [], []
        try:
            for t in range(args.trials):
                ceil, ceil_cpu = ceiling(tmp, min(args.seconds, 3), args.batch)
                ceilings.append(ceil)
                cpu_ceilings.append(ceil_cpu)
                line = f"trial {t + 1}: ceiling {ceil:>9,.0f} rows/s"
                for fmt in formats:
                    if off and t % 2:       # alternate which server goes first
                        off_res = ingest_trial(off[1], off[2], off_db, args.clients,
                                               args.seconds, off_worker, fmt, args.batch)
                    rate, stored, sent, per_cpu, rollup_share = ingest_trial(
                        url, token, db_path, args.clients, args.seconds, worker, fmt,
                        args.batch)
                    if off and not t % 2:
                        off_res = ingest_trial(off[1], off[2], off_db, args.clients,
                                               args.seconds, off_worker, fmt, args.batch)
                    results[fmt][0].append(rate)
                    results[fmt][1].append(per_cpu)
                    results[fmt][2].append(rollup_share)
                    line += (f"  {fmt} {rate:>9,.0f} points/s = {rate / ceil:.2f} x "
                             f"({per_cpu:,.0f}/server CPU-s, rollup {rollup_share:.0%} of "
                             "the server's CPU)")
                    if off:
                        no_events[fmt].append(off_res)
                        line += (f" [events off {off_res[0]:,.0f} ({off_res[3]:,.0f}/CPU-s), "
                                 f"ratio {rate / off_res[0]:.2f} wall, "
                                 f"{per_cpu / off_res[3]:.2f} CPU]")
                print(line, flush=True)
        finally:
            stop_server(proc)
            if off:
                stop_server(off[0])
        ceil, ceil_cpu = med(ceilings), med(cpu_ceilings)
        print(f"\ningest over REST ({args.clients} client processes, batches of {args.batch}, "
              f"1 gunicorn gthread worker), median of {args.trials}, {os.cpu_count()} cores:")
        print("                        wall clock           per CPU-second of the writer"
              " (server: with the rollup's catch-up)")
        print(f"  raw executemany    {ceil:>10,.0f} rows/s     {ceil_cpu:>10,.0f}"
              "   (same schema, same run)")
        for fmt in formats:
            rate, per_cpu = med(results[fmt][0]), med(results[fmt][1])
            print(f"  REST, {fmt:<6}       {rate:>10,.0f} points/s   {per_cpu:>10,.0f}"
                  f"   ratio {rate / ceil:.2f} x wall, {per_cpu / ceil_cpu:.2f} x CPU; "
                  f"the rollup thread took {med(results[fmt][2]):.0%} of the server's CPU")
        print("  (goal: >= 0.75 x the raw ceiling in the same run, rollup thread running)")
        if off:
            print("\nwith the event engine vs without it (a second server, same trials):")
            for fmt in formats:
                wall = [a / b[0] for a, b in zip(results[fmt][0], no_events[fmt])]
                cpu = [a / b[3] for a, b in zip(results[fmt][1], no_events[fmt])]
                print(f"  REST, {fmt:<6}  with {med(results[fmt][0]):>10,.0f}  without "
                      f"{med([b[0] for b in no_events[fmt]]):>10,.0f} points/s;  ratio wall "
                      f"{med(wall):.2f} ({min(wall):.2f}-{max(wall):.2f}), per server "
                      f"CPU-second {med(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f}); goal >= 0.9")


if __name__ == "__main__":
    main()
