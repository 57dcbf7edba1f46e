"""The scheduler's pass over a long queue, beside the pass that reads the whole queue.

    .venv/bin/python bench/scheduler.py [--queued 200 1000 5000] [--passes 200]

A real SQLite file with one node of 4 GPUs, all busy, and N queued 1-GPU jobs, each
already told why it waits (the steady state of a drain: every job end or submit wakes the
scheduler, and nothing but the freed slot changes). Timed, in the same process:
- the pass as the scheduler runs it: the nodes look as at the last pass, so the queue is
  read without the jobs that wait only for a slot and have their reason;
- the same pass reading the whole queue, as every pass did before (the scheduler's
  memory of the nodes cleared before each pass).
Prints the median of `--passes` passes of each and the ratio. Then the same pass over N
jobs that are held, or that run after a running job ("after"), beside the pass as it read
them before 2026-12-03 (previous_queue: every held job at every pass, each page found by
walking the queue from its head, and one read of states for each job that runs after
others). Then the pass that follows a job's end (one GPU freed, so one job is placed): as
the scheduler runs it, reading the queue a page at a time (scheduler.QUEUE_PAGE) with the
room left after the first page, beside the same pass reading the queue in one page, as it
did before (2026-12-02).
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
from gpuplane.db import jobs, loads  # noqa: E402
from gpuplane.scheduler import Scheduler  # noqa: E402


class Agents:
    def start(self, job, token):
        pass

    def cancel(self, node, job_id, attempt):
        pass


def world(home, queued, agents=None, kind="plain"):
    """4 jobs placed on the node's 4 GPUs and `queued` more told why they wait: plain
    (a slot), held, or after one of the running jobs ("after")."""
    db = Database(home / "gpuctl.db")
    lc = Lifecycle(db, agents=agents or Agents())
    sched = Scheduler(db, lc, ServerConfig(home=str(home), node_grace_s=5))
    lc.node_up({"node": "n1", "epoch": "e", "gpus": [{"index": i} for i in range(4)]})
    lc.node_synced("n1")
    spec = {"name": "x", "command": [sys.executable, "-c", "pass"], "working_dir": "/w",
            "gpus": 1, "cpu_only": False, "priority": 0, "max_attempts": 1, "env": {},
            "project": "default", "experiment": ""}
    first = [lc.submit(dict(spec))["id"] for _ in range(4)]
    extra = {"plain": {}, "held": {"held": True}, "after": {"depends_on": first[:1]}}[kind]
    for _ in range(queued):
        lc.submit(dict(spec, **extra))
    sched.tick()                # 4 placed, the rest told why they wait
    return db, sched, lc


def previous_page(db, room, after, limit):
    """jobs.placement_queue as it was before 2026-12-03: every held job read at every
    pass, and each page found by walking the queue from its head past `after`."""
    sql = ("SELECT id, gpus, cpu_only, held, depends_on, depends_any, pending_reason, "
           "priority, queued_at, time_limit_s FROM jobs WHERE state = 'QUEUED'"
           " AND (held != 0 OR depends_on IS NULL OR depends_on != '[]'"
           " OR pending_reason IS NULL OR (cpu_only != 0 AND ?)"
           " OR (cpu_only = 0 AND gpus <= ?))")
    args = (int(bool(room[1])), int(room[0]))
    if after is not None:
        p, q, i = after
        sql += (" AND (priority < ? OR (priority = ? AND (queued_at > ?"
                " OR (queued_at = ? AND id > ?))))")
        args += (p, p, q, q, i)
    return db.query(sql + " ORDER BY priority DESC, queued_at, id LIMIT ?", args + (limit,))


def previous_queue(sched, room):
    """Scheduler._queue as it was before 2026-12-03: pages of previous_page, each job's
    list of what it runs after decoded, and their states read, job by job."""
    after = None
    while True:
        page = previous_page(sched.db, room(), after, scheduler.QUEUE_PAGE)
        for row in page:
            waits_for = loads(row["depends_on"], [])
            yield row, waits_for, jobs.states(sched.db, waits_for) if waits_for else {}
        if len(page) < scheduler.QUEUE_PAGE:
            return
        after = (page[-1]["priority"], page[-1]["queued_at"], page[-1]["id"])


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
    print(f"one pass, 4 GPUs busy, with N jobs that are held or run after another job, "
          f"median of {args.passes}; beside the pass as it read them before 2026-12-03")
    for kind in ("held", "after"):
        for n in args.queued:
            with tempfile.TemporaryDirectory(prefix="gpuplane-bench-") as home:
                db, sched, _lc = world(pathlib.Path(home), n, kind=kind)
                now = timed(sched.tick, args.passes)
                sched._queue = lambda room: previous_queue(sched, room)
                before = timed(sched.tick, args.passes)
                db.close()
            print(f"  {n:5d} {kind + ':':6s} {now * 1000:6.2f} ms; as before "
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
