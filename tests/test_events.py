"""The event engine end to end: a real server, metrics over REST, events over REST/SSE."""
import json
import math
import sys

import pytest
import requests

from procs import ServerProc, wait_for


@pytest.fixture
def server(tmp_path):
    made = []

    def make(extra=""):
        s = ServerProc(tmp_path / f"server{len(made)}")
        with open(s.home / "server.toml", "a") as f:
            f.write(extra)
        made.append(s)
        return s.start()
    yield make
    for s in made:
        s.stop()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One server for the tests that need nothing special (each works in its own run)."""
    s = ServerProc(tmp_path_factory.mktemp("events") / "server").start()
    yield s
    s.stop()


def new_run(api):
    return api.post("/api/v1/runs", {"name": "t", "source": "sdk"}, expect=201)["id"]


def post_points(api, run_id, keys, points):
    body = json.dumps({"keys": keys, "points": points})
    r = api.session.post(f"{api.url}/api/v1/runs/{run_id}/metrics", data=body,
                         headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text


def loss_points(lo, hi, ts=1_700_000_000_000):
    return [[0, s, 0.5 + 2.0 * math.exp(-s / 100) * (1 + 0.01 * (s % 3)), ts + s] for s in
            range(lo, hi)]


def events_of(api, run_id, **q):
    return api.get("/api/v1/events", params={"run": run_id, **q}, expect=200)["events"]


def test_nan_spike_debounce_and_restart_without_duplicates(shared):
    s = shared
    api = s.api
    run = new_run(api)
    post_points(api, run, ["train/loss"], loss_points(0, 200))
    bad = loss_points(200, 210)
    bad[3][2] = "NaN"
    post_points(api, run, ["train/loss"], bad)
    nan = wait_for(lambda: events_of(api, run, type="LOSS_NAN"), what="LOSS_NAN event")
    assert len(nan) == 1
    ev = nan[0]
    assert ev["severity"] == "critical" and ev["step"] == 203 and ev["count"] == 1
    assert ev["data"] == {"key": "train/loss", "value": "nan"}
    assert "train/loss became nan at step 203" in ev["message"]

    spike = loss_points(210, 260)
    spike[20][2] = 40.0
    post_points(api, run, ["train/loss"], spike)
    sp = wait_for(lambda: events_of(api, run, type="LOSS_SPIKE"), what="LOSS_SPIKE")
    assert sp[0]["step"] == 230 and sp[0]["data"]["value"] == 40.0

    # more NaN within the debounce window: counted on the same event, not a new one
    again = loss_points(260, 270)
    again[0][2] = "Infinity"
    post_points(api, run, ["train/loss"], again)
    wait_for(lambda: events_of(api, run, type="LOSS_NAN")[0]["count"] == 2,
             what="the repeat counted")

    # a restart with full windows: the same points again and new NaN add no rows
    s.restart()
    api = s.api
    post_points(api, run, ["train/loss"], bad)                    # a replay
    post_points(api, run, ["train/loss"], loss_points(270, 300))  # rebuilds the window
    nan2 = loss_points(300, 305)
    nan2[1][2] = "NaN"
    post_points(api, run, ["train/loss"], nan2)
    wait_for(lambda: events_of(api, run, type="LOSS_NAN")[0]["count"] == 3,
             what="the repeat after the restart counted")
    rows = events_of(api, run)
    assert [e["type"] for e in rows] == ["STARTED", "LOSS_NAN", "LOSS_SPIKE"]

    # filters
    assert [e["type"] for e in events_of(api, run, severity="critical")] == ["LOSS_NAN"]
    assert events_of(api, run, type="LOSS_SPIKE,LOSS_NAN", since="1h") == rows[1:]
    assert events_of(api, run, since="2000-01-01T00:00:00Z") == rows


def test_sdk_events_flood_is_bounded_and_counted(shared):
    s = shared
    api = s.api
    run = new_run(api)
    for i in range(150):
        api.post(f"/api/v1/runs/{run}/events", {"name": "tick", "data": {"i": i}}, expect=201)
    for i in range(130):
        api.post(f"/api/v1/runs/{run}/events", {"name": f"n{i}"}, expect=201)
    def counted():
        rows = api.get("/api/v1/events", params={"run": run, "limit": 1000})["events"]
        return sum(e["count"] for e in rows if e["type"] != "STARTED") == 280 and rows
    rows = wait_for(counted, what="every SDK event counted")    # counts land each tick
    ticks = [e for e in rows if e["message"] == "tick"]
    assert len(ticks) == 1 and ticks[0]["count"] == 150
    users = [e for e in rows if e["type"] == "USER"]
    flood = [e for e in rows if e["type"] == "USER_FLOOD"]
    assert len(users) == 120 and len(flood) == 1
    assert sum(e["count"] for e in users + flood) == 280          # nothing lost or doubled
    assert "USER_FLOOD" in s.log_path.read_text() or "flood" in s.log_path.read_text()


def test_stream_resumes_after_last_event_id_and_checks_it(shared):
    s = shared
    api = s.api
    run = new_run(api)
    ids = [api.post(f"/api/v1/runs/{run}/events", {"name": f"e{i}"}, expect=201)["event_id"]
           for i in range(3)]
    headers = {"Authorization": f"Bearer {s.token}", "Last-Event-ID": str(ids[0])}
    with requests.get(f"{s.url}/api/v1/events/stream", params={"run": run}, headers=headers,
                      stream=True, timeout=10) as r:
        assert r.status_code == 200
        got = []
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("id: "):
                got.append(int(line[4:]))
            if len(got) == 2:
                break
    assert got == ids[1:]
    for bad in (str(2**63), "-1", "abc", "\u00b2", "1" * 40):
        r = requests.get(f"{s.url}/api/v1/events/stream",
                         headers={"Authorization": f"Bearer {s.token}", "Last-Event-ID": bad},
                         timeout=10)
        assert r.status_code == 400 and "Last-Event-ID" in r.json()["error"]["message"]
    r = api.session.get(f"{s.url}/api/v1/events", params={"severity": "loud"}, timeout=10)
    assert r.status_code == 400 and "info, warning, critical" in r.json()["error"]["message"]
    r = api.session.get(f"{s.url}/api/v1/events", params={"since": "99999999999d"}, timeout=10)
    assert r.status_code == 400 and "30m" in r.json()["error"]["message"]


def test_bad_events_settings_stop_the_server_with_a_sentence(tmp_path):
    from gpuplane.app import create_app
    from gpuplane.config import ConfigError
    (tmp_path / "server.toml").write_text('[events]\nspike_z = "high"\n')
    with pytest.raises(ConfigError, match="events.spike_z in server.toml must be a number"):
        create_app(tmp_path, start_threads=False)
    (tmp_path / "server.toml").write_text('[events]\nspike_zz = 3\n')
    with pytest.raises(ConfigError, match="events.spike_zz in server.toml is not a setting"):
        create_app(tmp_path, start_threads=False)


def test_a_database_from_before_event_counts_gets_them(tmp_path):
    import sqlite3
    from gpuplane.db import MIGRATIONS, Database, events
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    mine = next(i for i, m in enumerate(MIGRATIONS) if "ADD COLUMN fingerprint" in m)
    for i, script in enumerate(MIGRATIONS[:mine]):
        conn.executescript(script + f"\nPRAGMA user_version={i + 1};")
    conn.execute("INSERT INTO events (type, message, ts) VALUES ('NODE_UP', 'n1 up', 1)")
    conn.commit()
    conn.close()
    db = Database(path)
    old = events.query(db)[0]
    assert old["count"] == 1 and old["fingerprint"] is None and old["message"] == "n1 up"
    with db.tx() as c:
        assert events.record(c, {"type": "LOSS_NAN", "run_id": 1, "fingerprint": "f"},
                             60_000)[1]
        assert events.record(c, {"type": "LOSS_NAN", "run_id": 1, "fingerprint": "f"},
                             60_000) == (None, False)
        assert events.record(c, {"type": "LOSS_NAN", "run_id": 1, "fingerprint": "g"},
                             60_000)[1] is False
    assert [e["count"] for e in events.query(db, run_id=1)] == [2]


def test_job_log_oom_and_stall_from_a_real_agent(server, agent_factory, tmp_path):
    s = server("[events]\nstall_min_s = 1\nstall_factor = 4\nstall_min_intervals = 3\n")
    agent_factory(s)
    script = tmp_path / "job.py"
    script.write_text(
        "import time, pathlib, sys\n"
        "for i in range(25):\n"
        "    print('step', i, flush=True); time.sleep(0.2)\n"
        "print('RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB', flush=True)\n"
        "while not pathlib.Path(sys.argv[1]).exists():\n"
        "    time.sleep(0.05)\n")
    release = tmp_path / "release"
    job = s.api.submit([sys.executable, str(script), str(release)], tmp_path, gpus=1)
    try:
        oom = wait_for(lambda: s.api.get("/api/v1/events", params={
            "job": job["id"], "type": "OOM"})["events"], what="OOM from the log")
        assert oom[0]["severity"] == "critical" and "CUDA out of memory" in oom[0]["data"]["line"]
        try:
            stall = wait_for(lambda: s.api.get("/api/v1/events", params={
                "job": job["id"], "type": "STALLED"})["events"], timeout=60, what="STALLED")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{s.log_path.read_text()[-4000:]}") from None
        assert stall[0]["data"]["silent_s"] >= 1 and stall[0]["run_id"] is not None
        assert "may be hung" in stall[0]["message"]
    finally:
        release.touch()
    s.api.wait_job(job["id"])


def test_ten_thousand_sdk_events_in_a_second_are_bounded_and_counted(tmp_path, caplog):
    import time
    from gpuplane.db import Database, events as db_events
    from gpuplane.events import Engine
    db = Database(tmp_path / "gpuctl.db")
    engine = Engine(db, {})
    run = {"id": 1, "job_id": None, "node": None}
    t0 = time.monotonic()
    for i in range(10_000):
        engine.record_user_event(run, f"e{i % 500}" if i % 2 else "tick", {"i": i}, i, None)
    took = time.monotonic() - t0
    engine.tick()           # the engine thread's flush of the counts
    rows = db_events.query(db, run_id=1, limit=10_000)
    # 120 names a minute + one USER_FLOOD (a minute may turn during the loop: 120 more)
    assert len(rows) == 121 or (took > 0 and len(rows) <= 241)
    assert sum(r["type"] == "USER_FLOOD" for r in rows) == 1
    assert sum(r["count"] for r in rows) == 10_000           # every call counted, once
    assert [r for r in rows if r["message"] == "tick"][0]["count"] == 5000
    assert "SDK event flood" in caplog.text
    print(f"10,000 SDK events recorded in {took:.2f} s")


def engine_with_run(tmp_path, source="sdk"):
    from gpuplane.db import Database
    from gpuplane.events import Engine
    db = Database(tmp_path / "gpuctl.db")
    with db.tx() as c:
        c.execute("INSERT INTO jobs (id, name, command, working_dir, state, run_id, node,"
                  " attempt, created_at, queued_at) VALUES (5, 'j', '[]', '/', 'RUNNING', 1,"
                  " 'n1', 1, 0, 0)")
        c.execute("INSERT INTO runs (id, job_id, attempt, source, state, node, created_at)"
                  " VALUES (1, 5, 1, 'job', 'RUNNING', 'n1', 0)")
    return db, Engine(db, {"events": {"gpu_grace_s": 60, "gpu_window_s": 120}})


def test_engine_oom_failure_disk_and_idle_gpu(tmp_path):
    from gpuplane.db import events as db_events
    db, engine = engine_with_run(tmp_path)
    engine.offer_lifecycle({"id": None, "type": "FAILED", "run_id": 1, "job_id": 5,
                            "node": "n1", "data": {"failure_kind": "OOM", "attempt": 1,
                                                   "exit_code": 1}})
    engine.offer_lifecycle({"id": None, "type": "FAILED", "run_id": 1, "job_id": 5,
                            "node": "n1", "data": {"failure_kind": "OOM", "attempt": 1}})
    keys = ["sys/disk_free_mb", "sys/gpu0/util", "sys/cpu_percent"]
    for i in range(40):                                     # one sample every 10 s
        engine.offer_points(1, keys, ([0, 1, 2], [i] * 3, [900.0, 4.0, 50.0],
                                      [i * 10_000] * 3))
    engine.offer_node_stats("n1", {"disk_free_mb": 100})
    engine.tick()
    got = {e["type"]: e for e in db_events.query(db, limit=100)}
    assert set(got) == {"OOM", "DISK_LOW", "GPU_UNDERUTILIZED"}
    assert got["OOM"]["job_id"] == 5 and got["OOM"]["severity"] == "critical"
    assert got["OOM"]["count"] == 1                 # the same failure twice: one event
    disk = [e for e in db_events.query(db, types=["DISK_LOW"])]
    assert {(e["run_id"], e["node"]) for e in disk} == {(1, "n1"), (None, "n1")}
    assert got["GPU_UNDERUTILIZED"]["data"]["mean_util"] == 4.0


def test_webhook_from_a_real_server(server):
    from test_webhooks import Receiver
    rec = Receiver()
    try:
        s = server(f'[[webhooks]]\nurl = "{rec.url}/hook"\nkind = "json"\n'
                   'min_severity = "critical"\n')
        run = new_run(s.api)
        post_points(s.api, run, ["train/loss"], [[0, 1, "NaN", 1]])
        wait_for(lambda: rec.got, what="the webhook's POST")
        body = json.loads(rec.got[0]["body"])
        assert body["type"] == "LOSS_NAN" and body["run_id"] == run
        assert len(rec.got) == 1          # STARTED (info) is below min_severity
    finally:
        rec.close()


def test_a_batch_whose_keys_come_at_different_rates_gives_each_key_all_its_points(tmp_path):
    """A train loss and its learning rate every step, an eval loss and accuracy once an
    epoch (100 steps): a batch of 50 steps without the eval, keys (0, 1, 0, 1, ...) of four
    names, once matched the "every key at every step" layout at key 0's positions, and the
    spike rule got every other train-loss point (a corrupted batch at an odd step went
    unseen). Found on bench/data/real_runs.json.gz."""
    db, engine = engine_with_run(tmp_path)
    keys = ["train/loss", "lr", "eval/loss", "eval/acc"]
    loss = [1.0 / (1 + s / 100) for s in range(1, 401)]
    loss[300] = 40.0                               # step 301: odd, a corrupted batch
    for start in range(1, 401, 50):
        kidx, steps, values, ts = [], [], [], []
        for s in range(start, start + 50):
            for k, v in ((0, loss[s - 1]), (1, 0.01)):
                kidx.append(k), steps.append(s), values.append(v), ts.append(s * 100)
        if (start + 49) % 100 == 0:
            for k, v in ((2, 0.5), (3, 0.8)):                   # the epoch's eval
                kidx.append(k), steps.append(start + 49), values.append(v), ts.append(s * 100)
        engine.offer_points(1, keys, (kidx, steps, values, ts))
        engine.tick()
    sp = engine._runs[1].spikes["train/loss"]
    assert sp.n == 400                             # every point, not every other one
    from gpuplane.db import events as db_events
    spikes = db_events.query(db, types=["LOSS_SPIKE"])
    assert [e["step"] for e in spikes] == [301]
