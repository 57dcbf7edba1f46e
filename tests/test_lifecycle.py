"""gpuplane/lifecycle.py on a real SQLite file: every transition writes its state and
exactly one lifecycle event in one transaction, and sets off its consequences (publish,
wake, agent command, listeners) only after the commit."""
import pytest

from gpuplane.db import Database, NestedTransaction, checkpoints, events, jobs, runs, tokens
from gpuplane.lifecycle import Lifecycle


class Agents:
    def __init__(self):
        self.started, self.cancelled = [], []

    def start(self, job, ingest_token):
        self.started.append((job["id"], job["attempt"], job["node"], ingest_token))

    def cancel(self, node, job_id, attempt, warn=None):
        self.cancelled.append((node, job_id, attempt))


class World:
    def __init__(self, tmp_path):
        self.db = Database(tmp_path / "gpuctl.db")
        self.published = 0
        self.woken = 0
        self.agents = Agents()
        self.heard = []
        self.lc = Lifecycle(self.db, publish=self._publish, wake=self._wake,
                            agents=self.agents)
        self.lc.on_event(self.heard.append)

    def _publish(self):
        self.published += 1

    def _wake(self):
        self.woken += 1

    def events(self):
        return events.list_events(self.db, limit=10_000)

    def new_events(self, fn, *a, **kw):
        """Run one transition; return (its result, the events it wrote)."""
        before = len(self.events())
        heard = len(self.heard)
        result = fn(*a, **kw)
        new = self.events()[before:]
        assert [e["id"] for e in self.heard[heard:]] == [e["id"] for e in new]
        return result, new


def spec(**kw):
    return {"name": "train", "command": ["python", "train.py"], "working_dir": "/w",
            "gpus": 1, "cpu_only": False, "priority": 0, "max_attempts": 2, "env": {},
            "project": "default", "experiment": "", **kw}


@pytest.fixture
def w(tmp_path):
    return World(tmp_path)


def one(evs, type):
    assert len(evs) == 1, evs
    assert evs[0]["type"] == type
    return evs[0]


def running_job(w, **kw):
    job = w.lc.submit(spec(**kw))
    w.lc.node_up({"node": "n1", "epoch": "e1", "gpus": [{"index": 0}]})
    w.lc.assign(job["id"], "n1", [0])
    w.lc.started(job["id"], 1)
    return jobs.get(w.db, job["id"])


def test_submit_assign_start_succeed(w):
    job, evs = w.new_events(w.lc.submit, spec())
    ev = one(evs, "QUEUED")
    assert job["state"] == "QUEUED" and ev["job_id"] == job["id"] and "queued" in ev["message"]
    assert w.woken == 1 and w.published == 1

    job, evs = w.new_events(w.lc.assign, job["id"], "n1", [0])
    ev = one(evs, "DISPATCHED")
    assert job["state"] == "DISPATCHED" and job["attempt"] == 1 and job["node"] == "n1"
    assert ev["run_id"] == job["run_id"] and ev["node"] == "n1" and ev["data"]["attempt"] == 1
    (job_id, attempt, node, secret), = w.agents.started
    assert (job_id, attempt, node) == (job["id"], 1, "n1")
    assert tokens.lookup(w.db, secret)["run_id"] == job["run_id"]
    assert runs.get(w.db, job["run_id"])["state"] == "STARTING"

    ok, evs = w.new_events(w.lc.started, job["id"], 1)
    assert ok
    one(evs, "STARTED")
    assert jobs.get(w.db, job["id"])["state"] == "RUNNING"
    assert runs.get(w.db, job["run_id"])["state"] == "RUNNING"

    state, evs = w.new_events(w.lc.finished, job["id"], 1, exit_code=0)
    assert state == "SUCCEEDED"
    ev = one(evs, "SUCCEEDED")
    assert ev["severity"] == "info" and ev["data"]["attempt"] == 1
    assert runs.get(w.db, job["run_id"])["state"] == "SUCCEEDED"


def test_a_second_assign_of_the_same_job_does_nothing(w):
    job = w.lc.submit(spec())
    w.lc.assign(job["id"], "n1", [0])
    result, evs = w.new_events(w.lc.assign, job["id"], "n1", [1])
    assert result is None and evs == [] and len(w.agents.started) == 1


def test_exit_code_and_oom_fail_for_good_and_oom_stays_findable(w):
    job = running_job(w)
    state, evs = w.new_events(w.lc.finished, job["id"], 1, exit_code=3)
    assert state == "FAILED"
    ev = one(evs, "FAILED")
    assert ev["data"]["failure_kind"] == "EXIT_CODE" and ev["severity"] == "warning"

    job = running_job(w, name="big")
    state, evs = w.new_events(w.lc.finished, job["id"], 1, exit_code=1, failure_kind="OOM")
    ev = one(evs, "FAILED")
    assert ev["severity"] == "critical" and ev["data"]["failure_kind"] == "OOM"
    assert "OOM" in ev["message"]
    assert jobs.get(w.db, job["id"])["failure_kind"] == "OOM"


def test_a_lost_attempt_is_retried_until_attempts_run_out(w):
    job = running_job(w)                                   # max_attempts 2
    state, evs = w.new_events(w.lc.finished, job["id"], 1, failure_kind="LOST")
    assert state == "QUEUED"
    ev = one(evs, "RETRIED")
    assert ev["data"]["failure_kind"] == "NODE_LOST" and ev["severity"] == "warning"
    j = jobs.get(w.db, job["id"])
    assert j["state"] == "QUEUED" and j["node"] is None

    w.lc.assign(job["id"], "n1", [0])
    state, evs = w.new_events(w.lc.finished, job["id"], 2, failure_kind="NODE_LOST")
    assert state == "FAILED"
    assert one(evs, "FAILED")["data"]["failure_kind"] == "NODE_LOST"


def test_a_stale_attempt_changes_no_job_and_writes_no_event(w):
    job = running_job(w)
    w.lc.finished(job["id"], 1, failure_kind="LOST")
    w.lc.assign(job["id"], "n1", [0])
    state, evs = w.new_events(w.lc.finished, job["id"], 1, exit_code=0)
    assert state is None and evs == []
    assert jobs.get(w.db, job["id"])["state"] == "DISPATCHED"


def test_cancel_queued_is_one_event_and_cancel_running_waits_for_the_agent(w):
    job = w.lc.submit(spec())
    (job2, ok), evs = w.new_events(w.lc.cancel, job["id"])
    assert ok and job2["state"] == "CANCELLED"
    one(evs, "CANCELLED")
    (again, ok), evs = w.new_events(w.lc.cancel, job["id"])
    assert ok and evs == []

    job = running_job(w, name="long")
    published = w.published
    (job2, ok), evs = w.new_events(w.lc.cancel, job["id"])
    assert ok and evs == [] and job2["cancel_requested"] and job2["state"] == "RUNNING"
    assert w.agents.cancelled == [("n1", job["id"], 1)]
    assert w.published == published + 1
    # Whatever failure the agent reports, a job whose cancel was asked is CANCELLED.
    state, evs = w.new_events(w.lc.finished, job["id"], 1, exit_code=-15,
                              failure_kind="EXIT_CODE")
    assert state == "CANCELLED"
    one(evs, "CANCELLED")


def test_cancel_of_an_ended_job_is_refused(w):
    job = running_job(w)
    w.lc.finished(job["id"], 1, exit_code=0)
    (job2, ok), evs = w.new_events(w.lc.cancel, job["id"])
    assert not ok and evs == [] and job2["state"] == "SUCCEEDED"


def test_retry_by_hand_is_one_event_and_a_new_attempt(w):
    job = running_job(w)
    w.lc.finished(job["id"], 1, exit_code=2)
    (job2, ok), evs = w.new_events(w.lc.retry, job["id"])
    assert ok and job2["state"] == "QUEUED"
    one(evs, "RETRIED")
    (job3, ok), evs = w.new_events(w.lc.retry, job["id"])
    assert not ok and evs == []
    assigned = w.lc.assign(job["id"], "n1", [0])
    assert assigned["attempt"] == 2 and assigned["run_id"] != job["run_id"]


def test_retry_of_a_succeeded_job_is_a_new_attempt(w):
    # Issue 9 item 9: any final state may be retried.
    job = running_job(w)
    w.lc.finished(job["id"], 1, exit_code=0)
    (job2, ok), evs = w.new_events(w.lc.retry, job["id"])
    assert ok and job2["state"] == "QUEUED"
    one(evs, "RETRIED")
    assigned = w.lc.assign(job["id"], "n1", [0])
    assert assigned["attempt"] == 2 and assigned["run_id"] != job["run_id"]


def test_node_up_down_and_lost(w):
    _, evs = w.new_events(w.lc.node_up, {"node": "n2", "epoch": "e", "gpus": []})
    assert one(evs, "NODE_UP")["node"] == "n2"
    woken = w.woken
    _, evs = w.new_events(w.lc.node_down, "n2")
    assert one(evs, "NODE_DOWN")["severity"] == "warning"
    assert w.woken == woken + 1
    _, evs = w.new_events(w.lc.node_down, "n2")          # already down: no change
    assert evs == []

    a = running_job(w, name="a")
    b = running_job(w, name="b", max_attempts=1)
    w.lc.node_down("n1")
    lost, evs = w.new_events(w.lc.node_lost, "n1", 60)
    assert sorted(lost) == sorted([a["id"], b["id"]])
    assert sorted(e["type"] for e in evs) == ["FAILED", "RETRIED"]
    assert all(e["data"]["failure_kind"] == "NODE_LOST" for e in evs)


def test_runs_of_their_own_start_and_finish_once(w):
    run_id, evs = w.new_events(w.lc.register_run, source="sdk", project="p",
                               experiment="", name="r", config={})
    assert one(evs, "STARTED")["run_id"] == run_id
    _, evs = w.new_events(w.lc.finish_run, run_id, "FAILED")
    one(evs, "FAILED")
    _, evs = w.new_events(w.lc.finish_run, run_id, "SUCCEEDED")
    assert evs == [] and runs.get(w.db, run_id)["state"] == "FAILED"


def test_nothing_is_set_off_before_commit_or_after_a_rollback(w):
    seen = []
    w.lc.on_event(lambda e: seen.append(jobs.get(w.db, e["job_id"]) if e["job_id"] else None))
    with pytest.raises(RuntimeError):
        with w.lc.transaction() as t:
            w.lc.submit(spec(), t=t)
            assert w.published == 0 and seen == []
            raise RuntimeError("boom")
    assert w.published == 0 and seen == [] and w.events() == []
    assert jobs.list_jobs(w.db) == []
    # After a commit a listener sees the committed state, from any connection.
    w.lc.submit(spec())
    assert seen and seen[-1]["state"] == "QUEUED"


def test_a_savepoint_drops_what_its_part_set_off(w):
    job = w.lc.submit(spec())
    w.lc.assign(job["id"], "n1", [0])
    with w.lc.transaction() as t:
        with pytest.raises(ValueError):
            with t.savepoint():
                w.lc.started(job["id"], 1, t=t)
                raise ValueError("malformed")
        w.lc.finished(job["id"], 1, exit_code=0, t=t)
    assert [e["type"] for e in w.events()][-1:] == ["SUCCEEDED"]
    assert "STARTED" not in [e["type"] for e in w.heard]


def test_a_failing_listener_does_not_undo_the_transition(w):
    w.lc.on_event(lambda e: 1 / 0)
    job = w.lc.submit(spec())
    assert jobs.get(w.db, job["id"])["state"] == "QUEUED"


def test_tx_refuses_to_nest(w):
    with w.db.tx():
        with pytest.raises(NestedTransaction):
            with w.db.tx():
                pass
    with w.db.tx() as c:          # the outer one is still usable afterwards
        c.execute("SELECT 1")


def test_one_checkpoint_per_run_and_path(w):
    # docs/checkpoints.md: the same file is one checkpoint, whoever reports it and however
    # often; a new fingerprint (the file was rewritten) updates that checkpoint
    run_id = w.lc.register_run(source="sdk", project="p", experiment="", name="r",
                               config={})
    with w.db.tx() as c:
        a, _ = checkpoints.register(c, run_id, "/c/1.pt", step=10, size_bytes=5,
                                    fingerprint="fp1", ts=1)
        b, _ = checkpoints.register(c, run_id, "/c/1.pt", step=10, size_bytes=5,
                                    fingerprint="fp1", ts=2)
        d, _ = checkpoints.register(c, run_id, "/c/1.pt", step=20, step_source="name",
                                    size_bytes=6, fingerprint="fp2", source="watcher", ts=3)
        e, _ = checkpoints.register(c, run_id, "/c/2.pt", step=30, size_bytes=7, ts=4)
    assert a == b == d and e != a
    row = checkpoints.get(w.db, a)
    assert (row["fingerprint"], row["size_bytes"], row["step"]) == ("fp2", 6, 10)


def test_a_new_server_process_takes_every_node_down_once(w):
    w.lc.node_up({"node": "n1", "epoch": "e", "gpus": []})
    w.lc.node_up({"node": "n2", "epoch": "e", "gpus": []})
    w.lc.node_down("n2")
    _, evs = w.new_events(w.lc.server_started)
    assert [(e["type"], e["node"]) for e in evs] == [("NODE_DOWN", "n1")]
    from gpuplane.db import nodes
    assert all(n["state"] == "disconnected" for n in nodes.list_nodes(w.db))
    _, evs = w.new_events(w.lc.server_started)
    assert evs == []
