"""Stop on events: how soon a diverging job ends after its LOSS_DIVERGED, and how many of
its steps that saves, beside the same job left to run (no stop_on), in the same run.

The job is a real process logging through the SDK (gpuctl): a loss that falls for 100
steps, then climbs (a learning rate too high), over --steps steps of --step-delay each; it
writes the step it is at to a file, so the steps it really ran are counted even when it
is killed. One real server and agent; the arms alternate (stop, run-on, stop, ...):

- stop: `stop_on = ["LOSS_DIVERGED"]`; measured: the seconds from the event (its ts, when
  the engine filed it) to the job's end (ended_at, when the lifecycle had the agent's
  report), and the share of the steps it did not run
- run-on: no stop_on (the baseline): every step runs; its LOSS_DIVERGED is filed all the
  same

    python bench/stop_on.py                  # 5 rounds (about 3 minutes)
    python bench/stop_on.py --rounds 3 --steps 2000
"""
import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile

import requests

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from bench import harness  # noqa: E402
from bench.harness import free_port, start_agent, start_server, stop_agent, stop_server  # noqa: E402,E501

JOB = """\
import os, sys, time
from gpuctl import run
steps, delay = int(sys.argv[1]), float(sys.argv[2])
at = open("at-" + os.environ["GPUCTL_JOB_ID"], "w")
for step in range(1, steps + 1):
    loss = 2.0 / (1 + step / 20) if step <= 100 else 0.33 * (1.01 ** (step - 100))
    run.log({"train/loss": loss}, step=step)
    at.seek(0); at.write(f"{step:8d}"); at.flush()
    time.sleep(delay)
"""


def one(s, url, work, arm, args):
    body = {"command": [sys.executable, "job.py", str(args.steps), str(args.step_delay)],
            "working_dir": str(work), "cpu_only": True, "name": f"diverge-{arm}"}
    if arm == "stop":
        body["stop_on"] = ["LOSS_DIVERGED"]
    r = s.post(url + "/api/v1/jobs", json=body, timeout=30)
    r.raise_for_status()
    job_id = r.json()["id"]
    job = harness.wait(lambda: (j := s.get(f"{url}/api/v1/jobs/{job_id}", timeout=30).json())
                       ["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") and j,
                       args.steps * args.step_delay * 3 + 60, f"job {job_id}", every=0.1)
    evs = s.get(f"{url}/api/v1/events?job={job_id}&type=LOSS_DIVERGED&limit=5",
                timeout=30).json()["events"]
    ran = int((work / f"at-{job_id}").read_text().strip() or 0)
    return {"arm": arm, "job": job_id, "state": job["state"], "end": job.get("end"),
            "ran": ran, "event_step": evs[0]["step"] if evs else None,
            "after_event_s": (job["ended_at"] - evs[0]["ts"]) / 1000 if evs else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--step-delay", type=float, default=0.005)
    args = ap.parse_args()
    home = pathlib.Path(tempfile.mkdtemp(prefix="gpuplane-bench-stop-on-"))
    work = home / "work"
    work.mkdir(parents=True)
    (work / "job.py").write_text(JOB)
    server, url, token = start_server(home / "server", free_port())
    agent = start_agent(url, token, "bench", home / "agent", "--fake-gpus", 0,
                        "--cpu-slots", 2)
    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {token}"
    rows = []
    try:
        harness.wait(lambda: (n := s.get(url + "/api/v1/nodes", timeout=2).json()["nodes"])
                     and n[0]["state"] == "connected" and n[0]["synced"], 60, "agent")
        print(f"load before: {os.getloadavg()[0]:.2f}; {args.steps} steps of "
              f"{args.step_delay * 1000:g} ms, the loss climbs from step 100", flush=True)
        for rnd in range(args.rounds):
            for arm in ("stop", "run-on"):
                r = one(s, url, work, arm, args)
                rows.append(r)
                print(f"round {rnd} {arm:6s} job {r['job']:3d} {r['state']:9s} ran "
                      f"{r['ran']:5d} of {args.steps} steps  LOSS_DIVERGED at step "
                      f"{r['event_step']}  end - event {r['after_event_s']:.2f} s  "
                      f"({r['end']})  load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        stop_agent(agent)
        stop_server(server)
        shutil.rmtree(home, ignore_errors=True)
    stop = [r for r in rows if r["arm"] == "stop"]
    base = [r for r in rows if r["arm"] == "run-on"]
    lat = [r["after_event_s"] for r in stop]
    saved = [1 - r["ran"] / b["ran"] for r, b in zip(stop, base)]
    print(f"\nstop:   ended {min(lat):.2f}-{max(lat):.2f} s after LOSS_DIVERGED (median "
          f"{statistics.median(lat):.2f} s; goal <= 2 s); steps saved "
          f"{100 * min(saved):.1f}-{100 * max(saved):.1f} % of the run-on arm's (goal >= 90 %)")
    print(f"run-on: ran {min(b['ran'] for b in base)}-{max(b['ran'] for b in base)} steps, "
          f"{statistics.median(b['after_event_s'] for b in base):.1f} s past its event "
          "(the baseline)")
    print("stop / run-on steps: " + ", ".join(f"{r['ran'] / b['ran']:.3f}x"
                                              for r, b in zip(stop, base)))
    past = [r["ran"] - r["event_step"] for r in stop]
    print(f"steps run past the event's step: stop {min(past)}-{max(past)}, run-on "
          f"{min(b['ran'] - b['event_step'] for b in base)}-"
          f"{max(b['ran'] - b['event_step'] for b in base)} (where the rule fires is the "
          "rule's: docs/events.md)")


if __name__ == "__main__":
    main()
