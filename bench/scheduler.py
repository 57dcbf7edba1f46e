"""The scheduler's pass over a long queue, beside the pass that reads the whole queue.

    .venv/bin/python bench/scheduler.py [--queued 200 1000 5000] [--passes 200]

A real SQLite file with one node of 4 GPUs, all busy, and N queued 1-GPU jobs, each
already told why it waits (the steady state of a drain: every job end or submit wakes the
scheduler, and nothing but the freed slot changes). Timed, in the same process:
- the pass as the scheduler runs it: the nodes look as at the last pass, so the queue is
  read without the jobs that wait only for a slot and have their reason;
- the same pass reading the whole queue, as every pass did before (the scheduler's
  memory of the nodes cleared before each pass).
Prints the median of `--passes` passes of each and the ratio. Then the pass that follows a
job's end (one GPU freed, so one job is placed): as the scheduler runs it, reading the
queue a page at a time (scheduler.QUEUE_PAGE) with the room left after the first page,
beside the same pass reading the queue in one page, as it did before (2026-12-02).
"""
import argparse
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuplane.config import ServerConfig  # noqa: E402
from gpuplane.db import Database  # noqa: E402
from gpuplane.lifecycle import Lifecycle  # noqa: E402
from gpuplane import scheduler  # noqa: E402
from gpuplane.db import jobs  # noqa: E402
from gpuplane.scheduler import Scheduler  # noqa: E402


class Agents:
    def start(self, job, token):
        pass

    def cancel(self, node, job_id, attempt):
        pass


def world(home, queued, agents=None):
    db = Database(home / "gpuctl.db")
    lc = Lifecycle(db, agents=agents or Agents())
    sched = Scheduler(db, lc, ServerConfig(home=str(home), node_grace_s=5))
    lc.node_up({"node": "n1", "epoch": "e", "gpus": [{"index": i} for i in range(4)]})
    lc.node_synced("n1")
    spec = {"name": "x", "command": [sys.executable, "-c", "pass"], "working_dir": "/w",
            "gpus": 1, "cpu_only": False, "priority": 0, "max_attempts": 1, "env": {},
            "project": "default", "experiment": ""}
    for _ in range(queued + 4):
        lc.submit(dict(spec))
    sched.tick()                # 4 placed, the rest told why they wait
    return db, sched, lc


class Started(Agents):
    def __init__(self):
        self.jobs = []

    def start(self, job, token):
        self.jobs.append(job)


def freed_slot_passes(home, queued, passes, page):
    """Median of `passes` passes that each follow one job's end, reading the queue `page`
    jobs at a time."""
    agents = Started()
    db, sched, lc = world(home, queued, agents)
    scheduler.QUEUE_PAGE, saved = page, scheduler.QUEUE_PAGE
    try:
        out = []
        for _ in range(passes):
            job = agents.jobs.pop(0)
            lc.started(job["id"], job["attempt"])
            lc.finished(job["id"], job["attempt"], exit_code=0)
            t0 = time.perf_counter()
            sched.tick()
            out.append(time.perf_counter() - t0)
        assert [jobs.get(db, j["id"])["state"] for j in agents.jobs] == ["DISPATCHED"] * 4
    finally:
        scheduler.QUEUE_PAGE = saved
        db.close()
    return statistics.median(out)


def timed(fn, passes):
    out = []
    for _ in range(passes):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queued", type=int, nargs="+", default=[200, 1000, 5000])
    ap.add_argument("--passes", type=int, default=200)
    args = ap.parse_args()
    print(f"one scheduler pass (tick), median of {args.passes}, 4 GPUs busy")
    for n in args.queued:
        with tempfile.TemporaryDirectory(prefix="gpuplane-bench-") as home:
            db, sched, _lc = world(pathlib.Path(home), n)

            def whole():
                sched._nodes_seen = None
                sched.tick()
            now, before = timed(sched.tick, args.passes), timed(whole, args.passes)
            db.close()
        print(f"  {n:5d} queued: {now * 1000:6.2f} ms; reading the whole queue "
              f"{before * 1000:6.2f} ms: {before / now:.1f}x")
    print(f"one pass after a job's end (a GPU freed: one job placed), median of {args.passes}")
    for n in args.queued:
        runs = min(args.passes, n)
        with tempfile.TemporaryDirectory(prefix="gpuplane-bench-") as home:
            now = freed_slot_passes(pathlib.Path(home), n, runs, scheduler.QUEUE_PAGE)
        with tempfile.TemporaryDirectory(prefix="gpuplane-bench-") as home:
            before = freed_slot_passes(pathlib.Path(home), n, runs, 10 ** 9)
        print(f"  {n:5d} queued: {now * 1000:6.2f} ms, reading a page of "
              f"{scheduler.QUEUE_PAGE}; the queue in one read {before * 1000:6.2f} ms: "
              f"{before / now:.1f}x")


if __name__ == "__main__":
    main()
