"""The sender thread's two rules that decide what the training loop pays: the queue→spool
step keeps points, checkpoints and flushes in the order they were logged (in bulk when it
can, one by one around a control item), and the sender gives the interpreter back while
it works through a backlog, unless someone is waiting on it."""

import json

import pytest

from gpuctl import sender
from sdkutil import spool_points


@pytest.fixture
def stopped(sdk):
    """A local run whose sender thread is stopped, so the test drives it by hand."""
    sdk.init()
    r = sdk._run
    r.sender.stop(join_s=5)
    assert not r.sender.is_alive()
    r.sender._stop_flag = False
    return r


def _records(r):
    with open(r.spool.path) as f:
        lines = [json.loads(line) for line in f][1:]  # after the header
    out = []
    for ln in lines:
        if ln["t"] == "metrics":
            keys = ln["body"]["keys"]
            points = spool_points(ln["body"])
            out.append(("metrics", [(keys[k], step) for k, step, _, _ in points]))
        else:
            out.append((ln["t"], ln["body"]))
    return out


def _point(r, key, step, seq=None):
    r.points.append((next(r.seq) if seq is None else seq, key, step, 1.0, 1e9))


def test_points_around_a_checkpoint_stay_on_their_side(stopped):
    r = stopped
    for i in range(3):
        _point(r, "a", i)
    r.control.append((next(r.seq), "checkpoint", json.dumps({"path": "c1"})))
    for i in range(3, 5):
        _point(r, "a", i)
    r.control.append((next(r.seq), "event", json.dumps({"name": "e"})))
    assert r.sender.drain() is True
    assert _records(r) == [("metrics", [("a", 0), ("a", 1), ("a", 2)]),
                           ("checkpoint", {"path": "c1"}),
                           ("metrics", [("a", 3), ("a", 4)]),
                           ("event", {"name": "e"})]
    assert r.dropped == 0
    assert r.sender.drain() is False  # nothing left


def test_a_point_queued_behind_a_later_one_is_not_counted_lost(stopped):
    # two logging threads: one took its seq before the checkpoint's but appended after a
    # point logged after the checkpoint
    r = stopped
    early = next(r.seq)
    r.control.append((next(r.seq), "checkpoint", json.dumps({"path": "c"})))
    _point(r, "late", 1)
    _point(r, "early", 0, seq=early)
    r.sender.drain()
    assert _records(r) == [("checkpoint", {"path": "c"}),
                           ("metrics", [("late", 1), ("early", 0)])]
    assert r.dropped == 0 and r.sender.pending_drops() == 0


def test_drops_in_a_full_queue_are_counted_exactly(stopped):
    r = stopped
    for i in range(10_000 + 1234):  # the queue holds 10 000: the oldest 1234 go
        _point(r, "x", i)
    assert r.sender.pending_drops() == 1234
    while r.sender.drain(limit=sender.BATCH_MAX):
        pass
    assert r.dropped == 1234 and r.sender.pending_drops() == 0
    steps = [s for _, pts in _records(r) for _, s in pts]
    assert steps == list(range(1234, 11_234))


def test_a_limited_drain_moves_one_batch(stopped, monkeypatch):
    monkeypatch.setattr(sender, "BATCH_MAX", 100)
    r = stopped
    for i in range(250):
        _point(r, "x", i)
    assert r.sender.drain(limit=100) is True
    assert len(r.points) == 150
    r.sender.drain()  # unlimited: the rest, in records of at most BATCH_MAX
    assert [len(pts) for _, pts in _records(r)] == [100, 100, 50]


class _Clock:
    def __init__(self, monkeypatch):
        self.cpu, self.wall = 0.0, 100.0
        monkeypatch.setattr(sender.time, "thread_time", lambda: self.cpu)
        monkeypatch.setattr(sender.time, "monotonic", lambda: self.wall)


def _waits(r, monkeypatch):
    asked = []

    def wait(t=None):
        assert not r.wake.is_set()  # a stale wake-up would end the pause at once
        asked.append(t)
    monkeypatch.setattr(r.wake, "wait", wait)
    return asked


def test_the_sender_sleeps_until_its_share_of_the_interpreter_is_spent(stopped, monkeypatch):
    r = stopped
    clock = _Clock(monkeypatch)
    asked = _waits(r, monkeypatch)
    r.wake.set()         # e.g. left by a checkpoint queued and already moved
    start = r.sender._clocks()
    clock.cpu += 0.004   # a batch took 4 ms of this thread's CPU
    clock.wall += 0.006  # over 6 ms of wall time (the rest waiting for the GIL)
    r.sender._pace(start)
    assert asked == [pytest.approx(0.004 / sender.SHARE - 0.006)]
    # a batch that mostly waited (a slow server) already gave the interpreter back
    start = r.sender._clocks()
    clock.cpu += 0.001
    clock.wall += 0.5
    r.sender._pace(start)
    assert len(asked) == 1


@pytest.mark.parametrize("waiting", ["flush", "checkpoint", "stop"])
def test_nobody_waits_for_a_paced_sender(stopped, monkeypatch, waiting):
    r = stopped
    clock = _Clock(monkeypatch)
    asked = _waits(r, monkeypatch)
    if waiting == "stop":
        r.sender._stop_flag = True
    else:
        r.control.append((next(r.seq), waiting, "{}"))
    start = r.sender._clocks()
    clock.cpu += 0.004
    clock.wall += 0.004
    r.sender._pace(start)
    assert asked == []


def test_a_backlog_is_moved_in_paced_batches(stopped, monkeypatch):
    monkeypatch.setattr(sender, "BATCH_MAX", 100)
    r = stopped
    clock = _Clock(monkeypatch)
    asked = _waits(r, monkeypatch)
    for i in range(350):
        _point(r, "x", i)
    monkeypatch.setattr(r.sender, "_write_metrics",
                        lambda batch, write=r.sender._write_metrics: (
                            setattr(clock, "cpu", clock.cpu + 0.001), write(batch)))
    r.sender._move()
    assert [len(pts) for _, pts in _records(r)] == [100, 100, 100, 50]
    assert len(asked) == 4 and all(t == pytest.approx(0.001 / sender.SHARE) for t in asked)
