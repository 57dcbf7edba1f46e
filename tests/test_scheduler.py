"""gpuplane/scheduler.py without a server: placement, why a job waits, and a tick on a
real SQLite file (dispatches go through the lifecycle to a recording agent stand-in)."""
import pytest

from gpuplane.config import ServerConfig
from gpuplane.db import Database, events, jobs, now_ms
from gpuplane.lifecycle import Lifecycle
from gpuplane.scheduler import Scheduler

place, why = Scheduler._place, Scheduler._why_waiting


def job(gpus=1, cpu_only=False):
    return {"gpus": gpus, "cpu_only": cpu_only}


def node(name, ngpus, state="connected"):
    return {"name": name, "gpus": [{"index": i} for i in range(ngpus)], "state": state}


def test_best_fit_takes_the_node_with_the_fewest_free_gpus_that_hold_the_job():
    free = {"big": ([0, 1, 2, 3], 4), "small": ([1], 4), "mid": ([0, 2], 4)}
    assert place(job(1), free) == ("small", [1])
    assert place(job(2), free) == ("mid", [0, 2])
    assert place(job(3), free) == ("big", [0, 1, 2])
    assert place(job(5), free) == (None, None)


def test_cpu_jobs_go_where_most_cpu_slots_are_free():
    assert place(job(0, True), {"a": ([], 1), "b": ([0], 3)}) == ("b", [])
    assert place(job(0, True), {"a": ([0, 1], 0)}) == (None, None)


@pytest.mark.parametrize("j, nodes, says", [
    (job(1), [], "no agent has connected yet"),
    (job(4), [node("a", 2)], "needs 4 GPUs on one node; the largest node (a) has 2"),
    (job(2), [node("a", 2, "disconnected")], "no connected node has 2 GPUs"),
    (job(2), [node("a", 2)], "waiting for 2 free GPUs on one node"),
    (job(1), [node("a", 2)], "waiting for 1 free GPU on one node"),
    (job(0, True), [node("a", 0, "disconnected")], "no node is connected"),
    (job(0, True), [node("a", 0)], "waiting for a free CPU slot"),
])
def test_why_waiting(j, nodes, says):
    assert says in why(j, nodes)


class Agents:
    def __init__(self):
        self.started = []
        self.cancelled = []

    def start(self, job, token):
        self.started.append((job["id"], job["node"], job["gpu_indices"]))

    def cancel(self, node, job_id, attempt, warn=None):
        self.cancelled.append((node, job_id, attempt))


@pytest.fixture
def world(tmp_path):
    db = Database(tmp_path / "gpuctl.db")
    agents = Agents()
    lc = Lifecycle(db, agents=agents)
    connected = {"n1"}
    sched = Scheduler(db, lc, ServerConfig(home=str(tmp_path), node_grace_s=5),
                      is_connected=lambda n: n in connected)
    lc.bind(wake=sched.wake)
    lc.node_up({"node": "n1", "epoch": "e", "gpus": [{"index": 0}, {"index": 1}]})
    lc.node_synced("n1")
    return db, lc, sched, agents, connected


def spec(name, gpus=1, priority=0, time_limit_s=None):
    return {"name": name, "command": ["true"], "working_dir": "/w", "gpus": gpus,
            "cpu_only": gpus == 0, "priority": priority, "max_attempts": 2, "env": {},
            "project": "default", "experiment": "", "time_limit_s": time_limit_s}


def test_a_tick_fills_free_slots_by_priority_and_says_why_the_rest_wait(world):
    db, lc, sched, agents, _ = world
    low = lc.submit(spec("low"))
    big = lc.submit(spec("big", gpus=2))
    high = lc.submit(spec("high", priority=5))
    sched.tick()
    # high first, then low (queued before big); big cannot fit and is next on the node
    # (backfill's reservation: neither has a time limit, so when it starts is unknown)
    assert [a[0] for a in agents.started] == [high["id"], low["id"]]
    assert sorted(g for a in agents.started for g in a[2]) == [0, 1]
    waiting = jobs.get(db, big["id"])
    assert waiting["state"] == "QUEUED"
    assert waiting["pending_reason"] == (
        f"next on node n1 (it needs 2): it starts when job {low['id']}, job {high['id']} end "
        "(no time limit, so when is unknown)")
    late = lc.submit(spec("late"))                 # behind big, no limit: no backfill
    lc.finished(low["id"], 1, exit_code=0)
    sched.tick()
    assert len(agents.started) == 2 and jobs.get(db, late["id"])["state"] == "QUEUED"
    assert jobs.get(db, late["id"])["pending_reason"].startswith(f"waits behind job {big['id']}")
    assert jobs.get(db, big["id"])["pending_reason"].startswith("holding GPU 1 of node n1")
    sched.tick()                                   # nothing freed: nothing sent twice
    assert len(agents.started) == 2


def test_first_fit_lets_any_job_that_fits_run_now(world, tmp_path):
    db, lc, sched, agents, _ = world
    sched.cfg = sched.cfg.replace(scheduling="first-fit")
    low = lc.submit(spec("low"))
    big = lc.submit(spec("big", gpus=2))
    high = lc.submit(spec("high", priority=5))
    sched.tick()
    assert [a[0] for a in agents.started] == [high["id"], low["id"]]
    assert jobs.get(db, big["id"])["pending_reason"] == "waiting for 2 free GPUs on one node"


def test_a_limited_job_backfills_before_the_reservation_and_a_longer_one_waits(world):
    db, lc, sched, agents, _ = world
    running = lc.submit(spec("running", priority=9, time_limit_s=3600))
    sched.tick()                                   # GPU 0 until its limit, an hour on
    big = lc.submit(spec("big", gpus=2))
    long_ = lc.submit(spec("long", time_limit_s=7200))
    unlimited = lc.submit(spec("unlimited"))
    short = lc.submit(spec("short", time_limit_s=600))
    sched.tick()
    started = [a[0] for a in agents.started]
    assert started == [running["id"], short["id"]]      # ten minutes fit before the hour
    head = jobs.get(db, big["id"])
    assert head["pending_reason"].startswith("reserved to start at ")
    assert f"when job {running['id']} reaches its time limit" in head["pending_reason"]
    for j in (long_, unlimited):
        why = jobs.get(db, j["id"])["pending_reason"]
        assert why.startswith(f"would run past job {big['id']}'s reserved start"), why
    assert "no time limit" in jobs.get(db, unlimited["id"])["pending_reason"]
    # the estimate: big when running's hour is over, long after big (no limit: unknown)
    got = {j: jobs.get(db, j)["expected_start"] for j in (big["id"], long_["id"],
                                                          unlimited["id"])}
    assert got[big["id"]] is not None and got[long_["id"]] is None
    assert abs(got[big["id"]] - jobs.get(db, running["id"])["queued_at"] - 3600_000) < 60_000


def test_strict_lets_no_job_pass_a_waiting_one(world):
    db, lc, sched, agents, _ = world
    sched.cfg = sched.cfg.replace(scheduling="strict")
    lc.submit(spec("running", priority=9, time_limit_s=3600))
    sched.tick()
    big = lc.submit(spec("big", gpus=2))
    short = lc.submit(spec("short", time_limit_s=60))
    sched.tick()
    assert len(agents.started) == 1
    assert "scheduling is strict" in jobs.get(db, short["id"])["pending_reason"]
    assert jobs.get(db, big["id"])["pending_reason"].startswith("reserved to start at ")


def test_a_node_without_a_live_connection_gets_nothing(world):
    db, lc, sched, agents, connected = world
    connected.clear()
    lc.submit(spec("x"))
    sched.tick()
    assert agents.started == []


def test_a_node_gone_past_grace_has_its_jobs_declared_lost(world):
    db, lc, sched, agents, connected = world
    j = lc.submit(spec("x"))
    sched.tick()
    lc.started(j["id"], 1)
    lc.node_down("n1")
    connected.clear()
    sched.expire_lost_nodes()                      # within grace: nothing happens
    assert jobs.get(db, j["id"])["state"] == "RUNNING"
    with db.tx() as c:                             # ... and later: lost, queued again
        c.execute("UPDATE nodes SET disconnected_at = ?", (now_ms() - 10_000,))
    sched.expire_lost_nodes()
    after = jobs.get(db, j["id"])
    assert after["state"] == "QUEUED" and after["failure_kind"] == "NODE_LOST"


def test_a_full_node_still_gets_every_queued_job_its_reason(world):
    """With no slot free, the jobs that wait only for a slot get their reason without
    being placed one by one; a held job and one whose dependency failed, deep in the
    queue, are still looked at: the one is held, the other fails."""
    db, lc, sched, agents, _ = world
    running = [lc.submit(spec(f"r{i}")) for i in range(2)]
    sched.tick()
    assert len(agents.started) == 2
    doomed = lc.submit(spec("doomed"))
    lc.cancel(doomed["id"])
    waiting = [lc.submit(spec(f"w{i}", gpus=1 + i % 2)) for i in range(30)]
    held = lc.submit(dict(spec("held"), held=True))
    child = lc.submit(dict(spec("child"), depends_on=[doomed["id"]]))
    cpu = lc.submit(spec("cpu", gpus=0))
    sched.tick()
    # the first waits as the next on the node (backfill's reservation); the rest for a slot
    assert jobs.get(db, waiting[0]["id"])["pending_reason"].startswith("next on node n1")
    for w in waiting[1:]:
        assert jobs.get(db, w["id"])["pending_reason"] == (
            f"waiting for {w['gpus']} free GPU{'s' if w['gpus'] > 1 else ''} on one node")
    assert jobs.get(db, held["id"])["pending_reason"].startswith("held;")
    assert jobs.get(db, child["id"])["state"] == "FAILED"
    assert [a[0] for a in agents.started] == [r["id"] for r in running] + [cpu["id"]]


def test_reasons_follow_the_nodes_while_later_passes_skip_jobs_that_keep_theirs(world):
    """A pass leaves out the jobs that wait only for a slot and have their reason, while
    the nodes look as they did; a node that goes away changes every such reason, and a
    job released from hold gets its own at the next pass."""
    db, lc, sched, agents, connected = world
    [lc.submit(spec(f"r{i}")) for i in range(2)]
    sched.tick()
    waiting = [lc.submit(spec(f"w{i}")) for i in range(5)]
    held = lc.submit(dict(spec("held"), held=True))
    sched.tick()
    says = {jobs.get(db, w["id"])["pending_reason"] for w in waiting[1:]}
    assert says == {"waiting for 1 free GPU on one node"}
    assert jobs.get(db, waiting[0]["id"])["pending_reason"].startswith("next on node n1")
    lc.hold(held["id"], held=False)
    sched.tick()
    assert jobs.get(db, held["id"])["pending_reason"] == "waiting for 1 free GPU on one node"
    lc.node_down("n1")
    connected.clear()
    sched.tick()
    for w in waiting + [held]:
        assert jobs.get(db, w["id"])["pending_reason"] == (
            "no connected node has 1 GPU; waiting for one to come back")


def test_a_long_queue_is_read_a_page_at_a_time_and_still_placed_in_order(world, monkeypatch):
    """Once the free slots are filled, the rest of a long queue is not read at that pass
    (the next page is asked for with no room left: only jobs that lack a reason come);
    every job still starts in priority order, and each that waits gets its reason."""
    db, lc, sched, agents, _ = world
    pages = []
    real = jobs.placement_queue
    monkeypatch.setattr(jobs, "placement_queue", lambda *a, **kw: pages.append(kw) or real(
        *a, **kw))
    ids = [lc.submit(spec(f"j{i}", priority=i % 3))["id"] for i in range(40)]
    sched.tick()                        # the nodes are new: the whole queue, once
    assert len(pages) == 1 and "limit" not in pages[0]
    order = [a[0] for a in agents.started]
    assert len(order) == 2
    said = [jobs.get(db, i)["pending_reason"] for i in ids if i not in order]
    assert sum(r.startswith("next on node n1") for r in said) == 1     # the head
    assert sum(r == "waiting for 1 free GPU on one node" for r in said) == len(said) - 1
    while len(agents.started) < 40:
        running = [a for a in agents.started if jobs.get(db, a[0])["state"] == "DISPATCHED"]
        lc.started(running[0][0], 1)
        lc.finished(running[0][0], 1, exit_code=0)
        pages.clear()
        sched.tick()
        # one page with the free slot's room, then one with no room left (empty)
        assert len(pages) <= 2 and all(p["limit"] == 16 for p in pages)
    by_priority = sorted(ids, key=lambda i: (-(ids.index(i) % 3), ids.index(i)))
    assert [a[0] for a in agents.started] == by_priority


def test_a_job_queued_while_no_slot_fits_it_gets_its_reason_without_a_pass(world):
    db, lc, sched, agents, _ = world
    lc.bind(waits=sched.waits)
    lc.submit(spec("a"))
    lc.submit(spec("b"))
    sched.tick()                        # both GPUs taken: the pass leaves no room
    assert len(agents.started) == 2
    wakes = sched._wakes
    late = lc.submit(spec("late"))
    # it says why it waits from its submit on, and woke nobody: a pass would only say so
    assert late["pending_reason"] == "waiting for 1 free GPU on one node"
    assert jobs.get(db, late["id"])["pending_reason"] == late["pending_reason"]
    assert sched._wakes == wakes
    # a job the last pass left room for, or one with more than a slot to wait for,
    # wakes the scheduler as before
    cpu = lc.submit(spec("cpu", gpus=0))
    assert cpu["pending_reason"] is None and sched._wakes == wakes + 1
    sched.tick()
    wakes = sched._wakes
    held = lc.submit(dict(spec("held"), held=True))
    assert held["pending_reason"] is None and sched._wakes == wakes + 1
    # a slot freed (a wake) since the last pass: the next submit sets off a pass that
    # places it
    first = agents.started[0][0]
    lc.started(first, 1)
    lc.finished(first, 1, exit_code=0)
    sched.tick()
    assert agents.started[-1][0] == late["id"]
    nxt = lc.submit(spec("next"))
    assert nxt["pending_reason"] == "waiting for 1 free GPU on one node"


def test_a_wake_during_the_submit_transaction_wakes_the_scheduler_after_its_commit(world):
    db, lc, sched, agents, _ = world
    lc.bind(waits=sched.waits)
    lc.submit(spec("a"))
    lc.submit(spec("b"))
    sched.tick()
    wakes = sched._wakes
    with lc.transaction() as t:
        lc.submit(spec("c"), t=t)
        # a job ends meanwhile: its pass may have read the queue before "c" was in it
        sched.wake()
        assert sched._wakes == wakes + 1
    assert sched._wakes == wakes + 2     # woken again once "c" is committed


def test_held_jobs_that_have_their_reason_are_left_out_of_later_passes(world, monkeypatch):
    """A held job's reason changes only with a hold or a release (both clear it): once it
    has it, a pass on unchanged nodes does not read it again. Held after waiting, it says
    held; released, it is placed when a slot frees."""
    db, lc, sched, agents, _ = world
    running = [lc.submit(spec(f"r{i}")) for i in range(2)]
    sched.tick()
    held = [lc.submit(dict(spec(f"h{i}"), held=True)) for i in range(20)]
    waiter = lc.submit(spec("w"))
    sched.tick()
    assert all(jobs.get(db, h["id"])["pending_reason"].startswith("held;") for h in held)
    read = []
    real = jobs.placement_queue

    def recorded(*a, **kw):
        rows = real(*a, **kw)
        read.extend(r["id"] for r in rows)
        return rows
    monkeypatch.setattr(jobs, "placement_queue", recorded)
    sched.tick()
    assert read == []                           # nothing new, nothing read
    lc.hold(waiter["id"])                       # it waited for a slot; now it is held
    sched.tick()
    assert read == [waiter["id"]]
    assert jobs.get(db, waiter["id"])["pending_reason"].startswith("held;")
    lc.hold(held[7]["id"], held=False)
    lc.started(running[0]["id"], 1)
    lc.finished(running[0]["id"], 1, exit_code=0)
    sched.tick()
    assert agents.started[-1][0] == held[7]["id"]
    assert all(jobs.get(db, h["id"])["state"] == "QUEUED" for h in held if h != held[7])


def test_a_queue_read_a_page_at_a_time_is_the_queue_read_at_once(tmp_path):
    """Pages follow one another by seeking along the queue's index (the rest of a
    priority, then the lower ones): together they are the whole queue in placement
    order, ties in priority and queue time included."""
    db = Database(tmp_path / "gpuctl.db")
    lc = Lifecycle(db)
    for i in range(57):
        lc.submit(dict(spec(f"j{i}", priority=(i * 7) % 5 - 2), held=i % 4 == 0))
    with db.tx() as c:                          # ties in queued_at: the id decides
        c.execute("UPDATE jobs SET queued_at = 1000 + id / 3")
    room = (8, True)
    whole = [r["id"] for r in jobs.placement_queue(db)]
    assert len(whole) == 57
    for size in (1, 5, 16, 56, 57, 100):
        paged, after = [], None
        while True:
            page = jobs.placement_queue(db, room, after=after, limit=size)
            paged += [r["id"] for r in page]
            if len(page) < size:
                break
            after = (page[-1]["priority"], page[-1]["queued_at"], page[-1]["id"])
        assert paged == whole, size


def test_a_page_of_jobs_that_wait_for_others_reads_their_states_once(world, monkeypatch):
    """Jobs that run after others are looked at every pass; the states of what a page of
    them waits for are read once for the page, and each still gets its own reason (or
    fails when what it waits for failed)."""
    db, lc, sched, agents, _ = world
    first = [lc.submit(spec(f"r{i}")) for i in range(2)]
    sched.tick()
    doomed = lc.submit(spec("doomed"))
    lc.cancel(doomed["id"])
    after = [lc.submit(dict(spec(f"a{i}"), depends_on=[first[i % 2]["id"]]))
             for i in range(30)]
    orphan = lc.submit(dict(spec("orphan"), depends_on=[doomed["id"]]))
    reads = []
    real = jobs.states
    monkeypatch.setattr(jobs, "states", lambda db, ids: reads.append(list(ids)) or real(db, ids))
    sched.tick()
    assert len(reads) <= 3                      # 31 jobs that wait: 2 pages of 16 (or 1)
    for i, a in enumerate(after):
        assert jobs.get(db, a["id"])["pending_reason"] == (
            f"waiting for job {first[i % 2]['id']} (r{i % 2}, DISPATCHED) to succeed")
    assert jobs.get(db, orphan["id"])["state"] == "FAILED"


def test_states_of_more_jobs_than_one_query_takes(tmp_path):
    """A whole-queue pass asks for the states of everything its jobs run after at once:
    more ids than one query's variables are read in parts."""
    db = Database(tmp_path / "gpuctl.db")
    lc = Lifecycle(db)
    made = [lc.submit(spec(f"j{i}"))["id"] for i in range(3)]
    found = jobs.states(db, list(range(-1200, 0)) + made)    # made: in the third part
    assert found == {i: ("QUEUED", f"j{n}") for n, i in enumerate(made)}


def preemptible(name, priority=0, **kw):
    return dict(spec(name, priority=priority, **kw), preemptible=True)


def test_an_urgent_job_preempts_the_youngest_preemptible_one_which_queues_again(world):
    db, lc, sched, agents, _ = world
    sched.cfg = sched.cfg.replace(preempt_min_run_s=0)
    old = lc.submit(preemptible("old"))
    sched.tick()
    lc.started(old["id"], 1)
    young = lc.submit(preemptible("young"))
    sched.tick()
    lc.started(young["id"], 1)
    urgent = lc.submit(spec("urgent", priority=10))
    sched.tick()
    # one GPU needed: the youngest of the two is stopped, once, and says who took it
    assert agents.cancelled == [("n1", young["id"], 1)]
    stopping = jobs.get(db, young["id"])
    assert stopping["cancel_requested"] and stopping["preempted_by"] == urgent["id"]
    [ev] = [e for e in events.list_events(db, job_id=young["id"]) if e["type"] == "PREEMPTED"]
    assert f"preempted by job {urgent['id']}" in ev["message"]
    assert jobs.get(db, urgent["id"])["pending_reason"].startswith(
        f"preempting job {young['id']}")
    sched.tick()
    assert len(agents.cancelled) == 1                  # no second victim while it stops
    # it stops: queued again at its place, to resume; the urgent job takes the GPU
    assert lc.finished(young["id"], 1, exit_code=-15, failure_kind="CANCELLED") == "QUEUED"
    back = jobs.get(db, young["id"])
    assert back["state"] == "QUEUED" and back["resume"] and back["max_attempts"] >= 2
    sched.tick()
    assert agents.started[-1][0] == urgent["id"]
    assert jobs.get(db, young["id"])["state"] == "QUEUED"   # behind the urgent one


def test_no_preemption_of_a_job_that_ran_too_little_or_is_not_preemptible(world):
    db, lc, sched, agents, _ = world
    a = lc.submit(spec("plain"))                         # not preemptible
    b = lc.submit(preemptible("fresh"))
    sched.tick()
    for j in (a, b):
        lc.started(j["id"], 1)
    urgent = lc.submit(spec("urgent", priority=10))
    sched.tick()                                         # fresh ran < 60 s
    assert agents.cancelled == []
    assert jobs.get(db, urgent["id"])["state"] == "QUEUED"
    same = lc.submit(spec("same-priority"))
    sched.cfg = sched.cfg.replace(preempt_min_run_s=0)
    sched.tick()
    assert agents.cancelled == [("n1", b["id"], 1)]      # for urgent, not for `same`
    assert jobs.get(db, b["id"])["preempted_by"] == urgent["id"]
    assert jobs.get(db, same["id"])["state"] == "QUEUED"
