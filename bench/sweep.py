"""A sweep of real training on 4 fake GPUs, with and without early stopping.

Each trial is examples/cpu/train.py (logistic regression in plain Python, real gradient
steps on fixed synthetic data; val/loss at the end of each epoch) with its own learning
rate, drawn log-uniform with a fixed seed, so every arm runs the same 16 trials. One real
server and one agent with 4 fake GPUs; arms run one after the other in the same process,
alternated (none, asha, median, none, asha, median, ...):

- none: every trial runs all its steps (the baseline)
- asha: rungs at 50 · 3^k steps (val/loss is logged every 50), keep the top 1/3
- median: after 100 steps, stop a trial worse than the median of 3 others at that step

For each arm: trial-steps spent (the sum over trials of the last train/loss step each
reached), wall time from create to the sweep's end, and the best trial by val/loss (its
number and learning rate): the same as the baseline's, or not.

    python bench/sweep.py                   # 16 trials, 2 rounds (about 4 minutes)
    python bench/sweep.py --rounds 1 --arms none,asha
"""
import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import requests

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from bench import harness  # noqa: E402
from bench.harness import (ROOT, free_port, start_agent, start_server, stop_agent,  # noqa: E402
                           stop_server)

RULES = {
    "none": None,
    "asha": {"rule": "asha", "min_steps": 50, "eta": 3},
    "median": {"rule": "median", "warmup_steps": 100, "min_trials": 3},
}


def wait(cond, timeout=900, what="condition", every=0.2):
    return harness.wait(cond, timeout, what, every)


def run_arm(s, url, work, arm, args, tag):
    spec = {
        "name": f"{arm}-{tag}", "experiment": f"bench-{arm}-{tag}", "working_dir": str(work),
        "command": (f"{sys.executable} train.py --epochs {args.epochs} --steps-per-epoch 50 "
                    f"--step-delay {args.step_delay} --lr {{lr}} --logdir tb-{arm}-{tag}-{{trial}}"
                    f" --checkpoint-dir ckpt-{arm}-{tag}-{{trial}}"),
        "parameters": {"lr": {"type": "log_uniform", "low": 0.002, "high": 2.0}},
        "trials": args.trials, "seed": args.seed, "parallel": 4, "gpus": 1,
        "metric": "val/loss", "direction": "min",
    }
    if RULES[arm]:
        spec["early_stopping"] = RULES[arm]
    t0 = time.monotonic()
    r = s.post(url + "/api/v1/sweeps", json=spec, timeout=30)
    r.raise_for_status()
    sweep_id = r.json()["id"]
    view = wait(lambda: (v := s.get(f"{url}/api/v1/sweeps/{sweep_id}", timeout=30).json())
                ["state"] != "RUNNING" and v, what=f"sweep {sweep_id}")
    wall = time.monotonic() - t0
    steps, stopped, mislabelled = 0, 0, 0
    full = args.epochs * 50
    for t in view["trials_detail"]:
        keys = s.get(f"{url}/api/v1/runs/{t['run_id']}/metrics", timeout=30).json()["keys"]
        last = {k["key"]: k["last_step"] for k in keys}
        steps += last.get("train/loss") or 0
        stopped += t["state"] == "EARLY_STOPPED"
        # a trial that ran to its end and exited 0 on its own, labelled stopped anyway
        job = s.get(f"{url}/api/v1/jobs/{t['job_id']}", timeout=30).json()
        mislabelled += (t["state"] == "EARLY_STOPPED" and job.get("exit_code") == 0
                        and (last.get("train/loss") or 0) >= full)
    best = view["best"]
    return {"arm": arm, "state": view["state"], "wall": wall, "steps": steps,
            "stopped": stopped, "mislabelled": mislabelled, "best_trial": best and best["trial"],
            "best_lr": best and best["params"]["lr"], "best_value": best and best["value"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--step-delay", type=float, default=0.03,
                    help="0 makes each trial end before a decision can reach it: the "
                         "check that no trial that ended first is labelled stopped")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--arms", default="none,asha,median")
    ap.add_argument("--keep", help="keep the server's home here")
    args = ap.parse_args()
    arms = args.arms.split(",")
    home = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="gpuplane-bench-sweep-"))
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "examples" / "cpu" / "train.py", work / "train.py")
    server, url, token = start_server(home / "server", free_port())
    agent = start_agent(url, token, "bench", home / "agent", "--fake-gpus", 4)
    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {token}"
    results = []
    try:
        wait(lambda: (n := s.get(url + "/api/v1/nodes", timeout=2).json()["nodes"])
             and n[0]["state"] == "connected" and n[0]["synced"], 60, what="agent")
        print(f"load before: {os.getloadavg()[0]:.2f}; {args.trials} trials x "
              f"{args.epochs * 50} steps, 4 fake GPUs, parallel 4", flush=True)
        for rnd in range(args.rounds):
            for arm in arms:
                res = run_arm(s, url, work, arm, args, f"r{rnd}")
                res["round"] = rnd
                results.append(res)
                print(f"round {rnd} {arm:6s} {res['state']:5s} wall {res['wall']:6.1f} s  "
                      f"trial-steps {res['steps']:5d}  stopped {res['stopped']:2d} "
                      f"(ended first yet stopped: {res['mislabelled']})  best trial "
                      f"{res['best_trial']} (lr {res['best_lr']}, val/loss "
                      f"{res['best_value']:.4f})  load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        stop_agent(agent)
        stop_server(server)
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
    base = [r for r in results if r["arm"] == "none"]
    if not base:
        return
    print("\narm     trial-steps (x baseline, saved)   wall (x baseline)   same best trial")
    for arm in arms:
        rows = [r for r in results if r["arm"] == arm]
        for r in rows:
            b = next(x for x in base if x["round"] == r["round"])
            print(f"{arm:6s}  {r['steps']:5d} ({r['steps'] / b['steps']:.2f}x, "
                  f"{100 * (1 - r['steps'] / b['steps']):4.1f} % saved)   "
                  f"{r['wall']:6.1f} s ({r['wall'] / b['wall']:.2f}x)   "
                  f"{'yes' if r['best_trial'] == b['best_trial'] else 'NO'}"
                  f" (trial {r['best_trial']} vs {b['best_trial']})")
        if arm != "none" and rows:
            saved = [1 - r["steps"] / next(x for x in base if x["round"] == r["round"])["steps"]
                     for r in rows]
            print(f"{arm:6s}  median saved {100 * statistics.median(saved):.1f} %")


if __name__ == "__main__":
    main()
