"""Backfill beside strict priority order (and first-fit), on one trace, in the same run.

A fake fleet of 4 agents x 8 fake GPUs on one real server; the trace is drawn once from a
stated distribution (seeded) and replayed for each arm, scaled to seconds:

- GPUs per job: 1 (55 %), 2 (20 %), 4 (15 %), 8 (10 %) — the shape of the published
  Philly / Helios traces' GPU requests, coarsened;
- run time: log-normal, median 2.5 s, sigma 0.8, capped at 20 s (the real `sleep`);
- time limit: the run time times U(1.2, 2.0), rounded up to a second (as users
  over-ask); a share of jobs (--unlimited, default 10 %) gives none;
- arrivals: Poisson, at a rate that offers about 1.3 x the fleet's GPU-seconds.

Each arm restarts the server with its `scheduling` and submits the trace at its times;
while it runs, the queued jobs are polled every 0.3 s and the first "reserved to start"
time each got is kept. Printed per arm: GPU utilisation (busy GPU-seconds / (32 x the span
from the first submit to the last end)), mean and p90 wait (start - submit), the makespan,
the mean and longest wait of the 8-GPU jobs (what first-fit starves), and how many jobs
started later than their first reservation (+1 s for the pass).

    python bench/backfill.py                          # 150 jobs, 3 arms (~5 minutes)
    python bench/backfill.py --jobs 80 --arms strict,backfill
    python bench/backfill.py --preempt --jobs 1000 --scale 0.2 --arms backfill
"""
import argparse
import math
import os
import pathlib
import random
import shutil
import statistics
import sys
import tempfile
import time

import requests

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from bench import harness  # noqa: E402
from bench.harness import free_port, start_agent, start_server, stop_agent, stop_server  # noqa: E402,E501

NODES, GPUS = 4, 8


def trace(n, seed, unlimited_share, preempt=False, scale=1.0):
    """The jobs, seeded. preempt: 40 % of them preemptible at priority 0, 10 % urgent at
    priority 10, the rest priority 5 (for the randomized run with preemption)."""
    rng = random.Random(seed)
    jobs, t = [], 0.0
    shapes = [(1, 0.55), (2, 0.20), (4, 0.15), (8, 0.10)]
    mean_gpu_s = sum(g * p for g, p in shapes) * 2.5 * math.exp(0.8 ** 2 / 2)
    rate = 1.3 * NODES * GPUS / mean_gpu_s            # jobs per second
    for i in range(n):
        t += rng.expovariate(rate)
        x, acc, gpus = rng.random(), 0.0, 1
        for g, p in shapes:
            acc += p
            if x <= acc:
                gpus = g
                break
        run = min(20.0, rng.lognormvariate(math.log(2.5), 0.8)) * scale
        limit = None if rng.random() < unlimited_share else math.ceil(run * rng.uniform(1.2, 2.0))
        job = {"i": i, "at": t * scale, "gpus": gpus, "run": round(run, 2), "limit": limit}
        if preempt:
            x = rng.random()
            job.update(priority=0, preemptible=True) if x < 0.4 else \
                job.update(priority=10) if x < 0.5 else job.update(priority=5)
        jobs.append(job)
    return jobs


def run_arm(arm, jobs_, args, home):
    server, url, token = start_server(home / f"server-{arm}", free_port(),
                                      extra=f'scheduling = "{arm}"\npreempt_min_run_s = 0.5\n')
    agents = [start_agent(url, token, f"n{k}", home / f"agent-{arm}-{k}", "--fake-gpus", GPUS,
                          "--cpu-slots", 0) for k in range(NODES)]
    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {token}"
    try:
        harness.wait(lambda: len([n for n in s.get(url + "/api/v1/nodes", timeout=5).json()
                                  ["nodes"] if n["state"] == "connected" and n["synced"]])
                     == NODES, 60, "agents")
        t0 = time.monotonic()
        ids, reserved, pending = {}, {}, list(jobs_)
        deadline = jobs_[-1]["at"] + 600     # past this, what is left is stuck: reported
        while pending or len(ids) < len(jobs_) or _unfinished(s, url):
            now = time.monotonic() - t0
            if now > deadline:
                break
            while pending and pending[0]["at"] <= now:
                j = pending.pop(0)
                body = {"name": f"t{j['i']}", "gpus": j["gpus"], "working_dir": str(home),
                        "command": ["sleep", str(j["run"])], "max_attempts": 1,
                        **{k: j[k] for k in ("priority", "preemptible") if k in j}}
                if j["limit"]:
                    body["time_limit"] = f"{j['limit']}s"
                r = s.post(url + "/api/v1/jobs", json=body, timeout=30)
                r.raise_for_status()
                ids[r.json()["id"]] = j
            for q in s.get(url + "/api/v1/jobs?state=QUEUED&limit=1000", timeout=30).json()["jobs"]:
                if q.get("expected_start") and (q.get("pending_reason") or "").startswith(
                        "reserved to start") and q["id"] not in reserved:
                    reserved[q["id"]] = q["expected_start"]
            time.sleep(0.3)
        done = [s.get(f"{url}/api/v1/jobs/{i}", timeout=30).json() for i in ids]
    finally:
        for a in agents:
            stop_agent(a)
        stop_server(server)
    stuck = [d for d in done if d["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED")]
    done = [d for d in done if d not in stuck]
    first = min(d["created_at"] for d in done)
    last = max(d["ended_at"] for d in done)
    busy = sum(d["gpus"] * (d["ended_at"] - d["started_at"]) for d in done)
    waits = sorted((d["started_at"] - d["created_at"]) / 1000 for d in done)
    late = sum(1 for d in done if d["id"] in reserved and d["started_at"] > reserved[d["id"]] + 1000)
    preempted = sum(1 for d in done if d.get("preempted_by"))
    states = {}
    for d in done:
        k = d["state"] + (f" {d['failure_kind']}" if d.get("failure_kind") else "")
        states[k] = states.get(k, 0) + 1
    big = [(d["started_at"] - d["created_at"]) / 1000 for d in done if d["gpus"] == GPUS]
    return {"arm": arm, "util": busy / (NODES * GPUS * (last - first)),
            "big_wait": statistics.mean(big) if big else 0.0, "big_max": max(big, default=0.0),
            "wait": statistics.mean(waits), "p90": waits[int(0.9 * (len(waits) - 1))],
            "span": (last - first) / 1000, "late": late, "reserved": len(reserved),
            "preempted": preempted, "stuck": len(stuck),
            "states": states}


def _unfinished(s, url):
    got = s.get(url + "/api/v1/jobs?limit=1000", timeout=30).json()["jobs"]
    return any(j["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED") for j in got)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=150)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--unlimited", type=float, default=0.10)
    ap.add_argument("--arms", default="strict,backfill,first-fit")
    ap.add_argument("--preempt", action="store_true",
                    help="the randomized run with preemption: priorities 0 (preemptible), 5 "
                         "and 10; every job must end SUCCEEDED (none lost, no deadlock)")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="times and run times x this (0.2 with --jobs 1000: about 2 minutes)")
    args = ap.parse_args()
    jobs_ = trace(args.jobs, args.seed, args.unlimited, args.preempt, args.scale)
    offered = sum(j["gpus"] * j["run"] for j in jobs_)
    print(f"load before: {os.getloadavg()[0]:.2f}; {len(jobs_)} jobs over "
          f"{jobs_[-1]['at']:.0f} s, {offered:.0f} GPU-seconds offered to {NODES}x{GPUS} GPUs; "
          f"{sum(1 for j in jobs_ if not j['limit'])} without a limit", flush=True)
    home = pathlib.Path(tempfile.mkdtemp(prefix="gpuplane-bench-backfill-"))
    rows = []
    try:
        for arm in args.arms.split(","):
            r = run_arm(arm, jobs_, args, home)
            rows.append(r)
            print(f"{arm:10s} utilisation {100 * r['util']:5.1f} %  mean wait {r['wait']:6.2f} s"
                  f"  p90 {r['p90']:6.2f} s  {GPUS}-GPU jobs' wait mean {r['big_wait']:5.2f} s "
                  f"max {r['big_max']:5.2f} s  span {r['span']:6.1f} s  started after their "
                  f"reservation: {r['late']} of {r['reserved']}  preempted {r['preempted']}  "
                  f"never ended (deadlock or lost): {r['stuck']}  "
                  f"ends {r['states']}  "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    base = next((r for r in rows if r["arm"] == "strict"), None)
    if base:
        for r in rows:
            if r is not base:
                print(f"{r['arm']} / strict: utilisation {r['util'] / base['util']:.2f}x, "
                      f"mean wait {r['wait'] / base['wait']:.2f}x, span "
                      f"{r['span'] / base['span']:.2f}x")


if __name__ == "__main__":
    main()
