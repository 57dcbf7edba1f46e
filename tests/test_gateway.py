"""gpuplane/gateway.py without a socket: applying an agent's batch (exactly once, a bad
record skipped, the cursor advanced in the same transaction) and reconciling after a
(re)connect."""
import pytest

from gpuplane import series
from gpuplane.config import ServerConfig
from gpuplane.db import Database, events, jobs, logs, metrics, nodes, runs
from gpuplane.gateway import Gateway, ProtocolError
from gpuplane.hub import Hub
from gpuplane.lifecycle import Lifecycle


class Agents:
    def __init__(self):
        self.started = []

    def start(self, job, token):
        self.started.append(job["id"])

    def cancel(self, node, job_id, attempt, warn=None):
        pass


@pytest.fixture
def gw(tmp_path):
    db = Database(tmp_path / "gpuctl.db")
    hub = Hub()
    lc = Lifecycle(db, publish=hub.publish, agents=Agents())
    g = Gateway(db, hub, ServerConfig(home=str(tmp_path)), lc)
    lc.node_up({"node": "n1", "epoch": "E", "gpus": [{"index": 0}]})
    return g


def dispatched(g, name="x"):
    lc = g.lifecycle
    j = lc.submit({"name": name, "command": ["true"], "working_dir": "/w", "gpus": 1,
                   "cpu_only": False, "priority": 0, "max_attempts": 2, "env": {},
                   "project": "default", "experiment": ""})
    return lc.assign(j["id"], "n1", [0])


def batch(*records, epoch="E"):
    return {"type": "batch", "epoch": epoch, "records": list(records)}


def test_a_batch_is_applied_once_and_acked(gw):
    j = dispatched(gw)
    recs = [{"seq": 1, "kind": "job", "job_id": j["id"], "attempt": 1, "state": "RUNNING"},
            {"seq": 2, "kind": "log", "job_id": j["id"], "attempt": 1,
             "lines": [[1, 1000, "hello"]]},
            {"seq": 3, "kind": "metrics", "run_id": j["run_id"],
             "points": [["loss", 1, 0.5, 1000], ["loss", 2, 0.4, 1001]]},
            {"seq": 4, "kind": "checkpoint", "run_id": j["run_id"], "path": "/c/1.pt",
             "step": 2, "size_bytes": 10, "fingerprint": "f"}]
    version = gw.hub.version
    assert gw.apply_batch("n1", batch(*recs)) == {"type": "ack", "seq": 4}
    assert gw.hub.version > version
    assert jobs.get(gw.db, j["id"])["state"] == "RUNNING"
    with gw.db.read() as conn:
        assert nodes.cursor(conn, "n1") == ("E", 4)
    # The same batch again (a replay after a lost ack) changes nothing.
    assert gw.apply_batch("n1", batch(*recs)) == {"type": "ack", "seq": 4}
    assert [line["text"] for line in logs.tail(gw.db, j["id"], 10)] == ["hello"]
    key = metrics.key_id(gw.db, j["run_id"], "loss")
    assert series.series(gw.db, key)[1] and series.summary(gw.db, j["run_id"])[0]["count"] == 2
    assert [e["type"] for e in events.list_events(gw.db, job_id=j["id"])].count("STARTED") == 1


def test_a_gap_asks_for_a_resend_and_a_bad_record_is_skipped(gw):
    j = dispatched(gw)
    assert gw.apply_batch("n1", batch({"seq": 2, "kind": "log"})) == {"type": "resend",
                                                                      "from": 1}
    recs = [{"seq": 1, "kind": "job", "job_id": j["id"], "attempt": 1, "state": "RUNNING"},
            {"seq": 2, "kind": "job", "job_id": "nope", "attempt": 1, "state": "EXITED"},
            {"seq": 3, "kind": "job", "job_id": j["id"], "attempt": 1, "state": "EXITED",
             "exit_code": 0}]
    assert gw.apply_batch("n1", batch(*recs)) == {"type": "ack", "seq": 3}
    assert jobs.get(gw.db, j["id"])["state"] == "SUCCEEDED"
    types = [e["type"] for e in events.list_events(gw.db, job_id=j["id"])]
    assert types == ["QUEUED", "DISPATCHED", "STARTED", "SUCCEEDED"]


def test_a_batch_of_another_epoch_is_a_protocol_error(gw):
    with pytest.raises(ProtocolError):
        gw.apply_batch("n1", batch({"seq": 1, "kind": "log"}, epoch="old"))


def test_reconcile_resends_what_the_agent_never_got_and_stops_what_it_should_not_run(gw):
    never_got = dispatched(gw, "a")
    lost = dispatched(gw, "b")
    gw.lifecycle.started(lost["id"], 1)
    version = gw.hub.version
    cmds = gw.reconcile("n1", {"type": "sync", "running": [{"job_id": 999, "attempt": 1}],
                               "known": []})
    starts = [c for c in cmds if c["type"] == "start"]
    assert [c["job_id"] for c in starts] == [never_got["id"]]
    assert starts[0]["ingest_token"].startswith("gpi_") and starts[0]["run_id"] == never_got["run_id"]
    assert {"type": "cancel", "job_id": 999, "attempt": 1} in cmds
    # A RUNNING attempt the agent does not know of is lost, and retried.
    after = jobs.get(gw.db, lost["id"])
    assert after["state"] == "QUEUED" and after["failure_kind"] == "NODE_LOST"
    assert nodes.get(gw.db, "n1")["synced"] and gw.hub.version > version
    assert runs.get(gw.db, lost["run_id"])["state"] == "FAILED"


def test_reconcile_leaves_known_attempts_alone(gw):
    j = dispatched(gw)
    gw.lifecycle.started(j["id"], 1)
    assert gw.reconcile("n1", {"running": [{"job_id": j["id"], "attempt": 1}],
                               "known": []}) == []
    assert jobs.get(gw.db, j["id"])["state"] == "RUNNING"


def test_a_malformed_sync_is_a_protocol_error(gw):
    with pytest.raises(ProtocolError):
        gw.reconcile("n1", {"running": [{"job": 1}], "known": []})


def test_one_long_tag_never_skips_the_rest_of_a_metrics_record(gw, caplog):
    """Issue 22: a TensorBoard tag over 512 characters made the whole record (up to 5000
    points) a skipped malformed record. Now only its points are refused and counted."""
    j = dispatched(gw)
    pts = [["loss", s, 1.0 / (s + 1), 1000 + s] for s in range(4998)]
    pts += [["t" * 700, 1, 0.5, 1000], ["loss", -3, 0.5, 1000]]
    recs = [{"seq": 1, "kind": "job", "job_id": j["id"], "attempt": 1, "state": "RUNNING"},
            {"seq": 2, "kind": "metrics", "run_id": j["run_id"], "points": pts}]
    assert gw.apply_batch("n1", batch(*recs)) == {"type": "ack", "seq": 2}
    key = metrics.key_id(gw.db, j["run_id"], "loss")
    assert gw.db.query_one("SELECT count(*) FROM points WHERE key_id = ?", (key,))[0] == 4998
    assert metrics.key_names(gw.db, j["run_id"]) == ["loss"]
    assert "2 points refused" in caplog.text
    ev = events.query(gw.db, run_id=j["run_id"], types=["METRIC_POINTS_REFUSED"])
    assert len(ev) == 1 and ev[0]["count"] == 2 and ev[0]["node"] == "n1"


@pytest.mark.parametrize("stats", [
    {"gpus": [1, 2]}, {"gpus": [{"index": "0"}]}, {"gpus": [{"index": 0, "util": [1]}]},
    {"gpus": [{"index": 0, "util": float("nan")}]}, {"gpus": {"index": 0}},
    {"gpus": [{"index": i} for i in range(65)]}, {"gpus": [{"index": 0}, {"index": 0}]},
    {"host": [1]}, {"host": {"cpu": {"deep": 1}}}, {"host": {"name": "x" * 300}},
    {"host": {f"k{i}": 1 for i in range(65)}},
])
def test_node_stats_that_do_not_fit_the_protocol_are_refused(gw, stats, caplog):
    """Issue 22: wrong types inside node stats were stored, and /status, /nodes and the
    dashboard's stream then answered 500 for everyone."""
    import json
    from gpuplane.api.nodes import node_views
    good = {"seq": 1, "kind": "node_stats", "gpus": [{"index": 0, "util": 50.0}],
            "host": {"cpu": 3.5}}
    bad = {"seq": 2, "kind": "node_stats", **{"gpus": [], "host": {}, **stats}}
    assert gw.apply_batch("n1", batch(good, bad)) == {"type": "ack", "seq": 2}
    assert "skipped malformed node_stats record seq 2" in caplog.text
    view = node_views(gw.db)
    assert view[0]["gpus"][0]["util"] == 50.0 and view[0]["host"] == {"cpu": 3.5}
    json.dumps(view, allow_nan=False)
    with pytest.raises(ProtocolError):
        gw._on_hello(None, {"node": "n2", "epoch": "E", **{"gpus": stats.get("gpus", [1])}})


def test_stored_stats_of_any_shape_never_break_the_node_views(gw):
    import json
    from gpuplane.api.nodes import node_views
    for raw in ('[1]', '{"gpus": [1, {"index": [0]}], "host": 5}', '{"gpus": {"a": 1}}',
                'null', '"text"'):
        with gw.db.tx() as c:
            c.execute("UPDATE nodes SET stats = ?, gpus = ? WHERE name = 'n1'", (raw, raw))
        json.dumps(node_views(gw.db), allow_nan=False)
