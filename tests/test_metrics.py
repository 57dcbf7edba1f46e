"""Metric ingest, rollups, downsampled series, summaries (a real SQLite file, Flask client)."""
import json
import math
import tomllib

import pytest

from gpuplane.app import create_app
from gpuplane import semantic
from gpuplane.db import metrics, now_ms, tokens
from gpuplane import metricwire, rollup
from gpuplane.rollup import Rollup

TS = 1_764_403_200_000


@pytest.fixture
def app(tmp_path):
    app = create_app(tmp_path, start_threads=False)
    yield app


@pytest.fixture
def db(app):
    return app.config["DB"]


@pytest.fixture
def client(app, tmp_path):
    admin = tomllib.loads((tmp_path / "server.toml").read_text())["admin_token"]
    c = app.test_client()
    c.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {admin}"
    return c


def new_run(client, name="r"):
    r = client.post("/api/v1/runs", json={"name": name, "project": "p", "source": "sdk"})
    assert r.status_code == 201, r.get_data(as_text=True)
    return r.get_json()["id"]


def post(client, run_id, keys, points, expect=200, **kw):
    r = client.post(f"/api/v1/runs/{run_id}/metrics",
                    data=json.dumps({"keys": keys, "points": points}),
                    content_type="application/json", **kw)
    assert r.status_code == expect, r.get_data(as_text=True)
    return r.get_json()


def get(client, path, expect=200):
    r = client.get(path)
    assert r.status_code == expect, r.get_data(as_text=True)
    return json.loads(r.get_data(as_text=True))   # strict: no NaN literals allowed below


def count_points(db):
    return db.query_one("SELECT count(*) FROM points")[0]


def ingest_series(db, run_id, key, values, start=0, ts=TS):
    with db.tx() as c:
        metrics.ingest(c, run_id, [key], [[0, start + i, v, ts] for i, v in enumerate(values)])


def test_roundtrip_raw(client):
    run = new_run(client)
    out = post(client, run, ["train/loss", "train/acc"],
               [[0, 0, 2.0, TS], [1, 0, 0.1, TS], [0, 1, 1.5, TS + 1], [1, 1, 0.4, TS + 1]])
    assert out == {"accepted": 4}
    s = get(client, f"/api/v1/runs/{run}/metrics/train/loss")
    assert s["key"] == "train/loss" and s["run_id"] == run and s["level"] == 1
    assert s["points"] == [[0, 2.0, 2.0, 2.0, 2.0, 1], [1, 1.5, 1.5, 1.5, 1.5, 1]]
    assert s["ts"] == [TS, TS + 1]              # each point's time, for a wall-clock axis
    summary = get(client, f"/api/v1/runs/{run}/metrics")
    by_key = {k["key"]: k for k in summary["keys"]}
    assert set(by_key) == {"train/loss", "train/acc"}
    assert by_key["train/acc"]["latest"] == {"step": 1, "value": 0.4, "ts": TS + 1}
    assert by_key["train/acc"]["direction"] == "max"
    assert by_key["train/loss"]["best"] == {"step": 1, "value": 1.5}


def test_series_range_and_unknown(client):
    run = new_run(client)
    post(client, run, ["x"], [[0, s, float(s), TS] for s in range(100)])
    s = get(client, f"/api/v1/runs/{run}/metrics/x?from_step=10&to_step=19")
    assert [p[0] for p in s["points"]] == list(range(10, 20))
    err = get(client, f"/api/v1/runs/{run}/metrics/nope", expect=404)
    assert err["error"]["code"] == "NotFound" and "x" in err["error"]["message"]
    assert get(client, "/api/v1/runs/999/metrics/x", expect=404)["error"]["code"] == "NotFound"
    assert get(client, "/api/v1/runs/999/metrics", expect=404)["error"]["code"] == "NotFound"
    get(client, f"/api/v1/runs/{run}/metrics/x?max_points=0", expect=400)
    get(client, f"/api/v1/runs/{run}/metrics/x?max_points=10001", expect=400)
    get(client, f"/api/v1/runs/{run}/metrics/x?from_step=5&to_step=1", expect=400)


@pytest.mark.parametrize("rolled", [False, True])
def test_downsampling_bounded_and_keeps_spike(client, db, rolled):
    run = new_run(client)
    values = [math.sin(i / 1000) for i in range(100_000)]
    values[77_777] = 1e9
    ingest_series(db, run, "loss", values)
    if rolled:
        rollup.roll_up(db)
        assert db.query_one("SELECT count(*) FROM metric_dirty")[0] == 0
    for max_points in (1000, 37, 5000):
        s = get(client, f"/api/v1/runs/{run}/metrics/loss?max_points={max_points}")
        pts = s["points"]
        assert 0 < len(pts) <= max_points
        assert len(pts) >= max_points // 4
        assert s["level"] > 1
        assert max(p[2] for p in pts) == 1e9
        assert sum(p[5] for p in pts) == 100_000
        spike = next(p for p in pts if p[2] == 1e9)
        assert spike[0] <= 77_777 < spike[0] + s["level"]
        assert [p[0] for p in pts] == sorted(p[0] for p in pts)
    # A narrow range reads raw points.
    s = get(client, f"/api/v1/runs/{run}/metrics/loss?from_step=77770&to_step=77790")
    assert s["level"] == 1 and len(s["points"]) == 21
    assert s["points"][7] == [77_777, 1e9, 1e9, 1e9, 1e9, 1]


def test_rolled_series_matches_raw_aggregation(client, db):
    run = new_run(client)
    values = [(i * 7919) % 1000 / 10 for i in range(20_000)]
    ingest_series(db, run, "m", values)
    before = get(client, f"/api/v1/runs/{run}/metrics/m?max_points=300")
    rollup.roll_up(db)
    after = get(client, f"/api/v1/runs/{run}/metrics/m?max_points=300")
    assert after["level"] == before["level"]
    assert len(after["points"]) == len(before["points"])
    for x, y in zip(after["points"], before["points"]):
        assert x == pytest.approx(y)
    # Every bucket agrees with a direct computation over the raw values.
    w = after["level"]
    for step, mn, mx, mean, last, n in after["points"]:
        chunk = values[step:step // w * w + w]
        assert (mn, mx, last, n) == (min(chunk), max(chunk), chunk[-1], len(chunk))
        assert mean == pytest.approx(sum(chunk) / len(chunk))


def test_tail_not_yet_rolled_is_read_raw(client, db):
    run = new_run(client)
    ingest_series(db, run, "m", [1.0] * 50_000)
    rollup.roll_up(db)
    ingest_series(db, run, "m", [5.0] * 10_000, start=50_000)   # not rolled up yet
    s = get(client, f"/api/v1/runs/{run}/metrics/m?max_points=100")
    assert sum(p[5] for p in s["points"]) == 60_000
    assert s["points"][-1][4] == 5.0
    summary = get(client, f"/api/v1/runs/{run}/metrics")["keys"][0]
    assert summary["count"] == 60_000 and summary["last_step"] == 59_999


def test_points_below_the_rolled_step_not_yet_rolled_are_read_raw(client, db):
    # Two writers: the later steps arrive (and are rolled up) first.
    run = new_run(client)
    ingest_series(db, run, "m", [1.0] * 5_000, start=15_000)
    rollup.roll_up(db)
    ingest_series(db, run, "m", [3.0] * 15_000)        # not rolled up yet
    s = get(client, f"/api/v1/runs/{run}/metrics/m?max_points=100")
    assert sum(p[5] for p in s["points"]) == 20_000
    assert s["points"][0][1] == 3.0 and s["points"][-1][4] == 1.0
    rollup.roll_up(db)
    after = get(client, f"/api/v1/runs/{run}/metrics/m?max_points=100")
    assert [p[:6] for p in after["points"]] == [p[:6] for p in s["points"]]


def test_idempotent_reingest(client, db):
    run = new_run(client)
    pts = [[0, s, s * 0.5, TS] for s in range(1000)] + [[1, s, 1.0, TS] for s in range(10)]
    post(client, run, ["a", "b"], pts)
    assert count_points(db) == 1010
    post(client, run, ["a", "b"], pts)
    post(client, run, ["b", "a"], [[1 - k, s, v, t] for k, s, v, t in pts])
    assert count_points(db) == 1010
    assert db.query_one("SELECT count(*) FROM metric_keys")[0] == 2
    # The same step twice in one batch (inside a multi-row insert and across its edge):
    # the later point wins.
    post(client, run, ["a"], [[0, s % 300, float(s), TS] for s in range(600)])
    assert count_points(db) == 1010
    assert db.query_one("SELECT value FROM points WHERE step = 299 AND key_id ="
                        " (SELECT id FROM metric_keys WHERE key = 'a')")[0] == 599.0


def test_out_of_order_and_replaced_points_reach_rollups(client, db):
    run = new_run(client)
    post(client, run, ["loss"], [[0, s, 1.0, TS] for s in range(0, 4000, 2)])
    rollup.roll_up(db)
    # Odd steps arrive late, and one old point is replaced by a spike.
    post(client, run, ["loss"], [[0, s, 2.0, TS] for s in range(3999, 0, -2)])
    post(client, run, ["loss"], [[0, 1234, -50.0, TS]])
    rollup.roll_up(db)
    s = get(client, f"/api/v1/runs/{run}/metrics/loss?max_points=10")
    assert sum(p[5] for p in s["points"]) == 4000
    assert min(p[1] for p in s["points"]) == -50.0
    assert max(p[2] for p in s["points"]) == 2.0
    top = db.query("SELECT count, min FROM rollups r JOIN metric_rollup m USING (key_id)"
                   " WHERE r.width = m.top_width")
    assert sum(r[0] for r in top) == 4000 and min(r[1] for r in top) == -50.0
    # The replaced point's base bucket was recomputed.
    b = db.query_one("SELECT min, max, count, last FROM rollups WHERE width = ? AND bucket = ?",
                     (metrics.BASE, 1234 // metrics.BASE))
    assert tuple(b) == (-50.0, 2.0, metrics.BASE, 2.0)
    summary = get(client, f"/api/v1/runs/{run}/metrics")["keys"][0]
    assert summary["best"] == {"step": 1234, "value": -50.0}


def test_new_coarse_level_covers_history(client, db):
    run = new_run(client)
    post(client, run, ["loss"], [[0, s, float(s), TS] for s in range(100)])
    rollup.roll_up(db)
    post(client, run, ["loss"], [[0, s, float(s), TS] for s in range(100_000, 100_050)])
    rollup.roll_up(db)
    top = db.query_one("SELECT top_width FROM metric_rollup")[0]
    assert top > 100_050
    row = db.query_one("SELECT count, min, max FROM rollups WHERE width = ?", (top,))
    assert tuple(row) == (150, 0.0, 100_049.0)


def test_retention_prunes_raw_and_keeps_rollups(client, db, app):
    run = new_run(client)
    recent = now_ms()
    old = recent - 30 * 86_400_000
    values = [float(i % 100) for i in range(10_000)]
    with db.tx() as c:
        metrics.ingest(c, run, ["loss"], [[0, i, v, old] for i, v in enumerate(values)])
        metrics.ingest(c, run, ["loss"], [[0, 10_000 + i, 7.0, recent] for i in range(100)])
    rollup = Rollup(db, {"raw_retention_days": 7})
    before = get(client, f"/api/v1/runs/{run}/metrics/loss?max_points=50")
    rollup.tick()
    assert count_points(db) == 100           # only the recent points are raw now
    after = get(client, f"/api/v1/runs/{run}/metrics/loss?max_points=50")
    assert sum(p[5] for p in after["points"]) == 10_100
    assert after["points"] == before["points"]
    summary = get(client, f"/api/v1/runs/{run}/metrics")["keys"][0]
    assert summary["count"] == 10_100 and summary["first_step"] == 0
    assert summary["best"]["value"] == 0.0
    # A narrow old range can no longer be raw: it comes from the finest level.
    s = get(client, f"/api/v1/runs/{run}/metrics/loss?from_step=0&to_step=40")
    assert s["level"] == 16 and s["points"][0][1:4] == [0.0, 15.0, 7.5]
    # Keep-forever is the default.
    assert Rollup(db, {}).prune(now=recent * 2) == 0
    assert Rollup(db, {"raw_retention_days": 0}).prune(now=recent * 2) == 0
    assert count_points(db) == 100


def test_nan_and_infinities_roundtrip(client, db):
    run = new_run(client)
    body = ('{"keys": ["m"], "points": [[0, 0, NaN, 1], [0, 1, "NaN", 1], [0, 2, Infinity, 1],'
            ' [0, 3, "-Infinity", 1], [0, 4, 1.5, 1]]}')
    r = client.post(f"/api/v1/runs/{run}/metrics", data=body, content_type="application/json")
    assert r.status_code == 200 and r.get_json() == {"accepted": 5}
    s = get(client, f"/api/v1/runs/{run}/metrics/m")
    assert [p[1] for p in s["points"]] == ["NaN", "NaN", "Infinity", "-Infinity", 1.5]
    rollup.roll_up(db)
    bucket = db.query_one("SELECT min, max, sum, count, vcount, last FROM rollups"
                          " WHERE width = 16 AND bucket = 0")
    assert tuple(bucket) == (-math.inf, math.inf, None, 5, 3, 1.5)   # inf - inf is NaN
    summary = get(client, f"/api/v1/runs/{run}/metrics")["keys"][0]
    assert summary["latest"]["value"] == 1.5
    post(client, run, ["m"], [[0, 5, float("nan"), 1]])
    summary = get(client, f"/api/v1/runs/{run}/metrics")["keys"][0]
    assert summary["latest"]["value"] == "NaN"


def test_all_nan_bucket_reads_nan(client, db):
    run = new_run(client)
    post(client, run, ["m"], [[0, s, "NaN", 1] for s in range(8)] + [[0, 8, 3.0, 1]])
    rollup.roll_up(db)
    s = get(client, f"/api/v1/runs/{run}/metrics/m?max_points=2")
    assert s["level"] == 8 and s["points"][0] == [0, "NaN", "NaN", "NaN", "NaN", 8]
    assert s["points"][1] == [8, 3.0, 3.0, 3.0, 3.0, 1]


@pytest.mark.parametrize("body,fragment", [
    ({"keys": "loss", "points": []}, "'keys' must be a list"),
    ({"keys": [f"k{i}" for i in range(10_001)], "points": []}, "at most 10000"),
    ({"keys": ["a"], "points": {"0": 1}}, "'points' must be a list"),
    ({"points": []}, "the body must be an object"),
    ([1, 2], "the body must be an object"),
])
def test_validation_errors(client, db, body, fragment):
    run = new_run(client)
    r = client.post(f"/api/v1/runs/{run}/metrics", json=body)
    assert r.status_code == 400, r.get_data(as_text=True)
    err = r.get_json()["error"]
    assert err["code"] == "BadRequest" and fragment in err["message"], err
    assert count_points(db) == 0


# One bad member of a batch: refused with its reason, the good ones kept (before issue 22
# each of these was a 400 for the whole batch, which the SDK then dropped).
@pytest.mark.parametrize("keys,bad,fragment", [
    (["good", 1], [1, 1, 2.0, 1], "must be a string"),
    (["good", "good"], [1, 1, 2.0, 1], "listed twice"),
    (["good", ""], [1, 1, 2.0, 1], "must not be empty"),
    (["good", "x" * 513], [1, 1, 2.0, 1], "at most 512"),
    (["good"], [0, 1, 2.0], "4 items"),
    (["good"], [0, 1, 2.0, 1, 5], "4 items"),
    (["good"], {"k": 0, "s": 1, "v": 2, "t": 3}, "must be a list"),
    (["good"], 5, "must be a list"),
    (["good"], "abcd", "must be a list"),
    (["good"], [1, 1, 2.0, 1], "out of range"),
    (["good"], [-1, 1, 2.0, 1], "out of range"),
    (["good"], ["a", 1, 2.0, 1], "key_index must be an integer"),
    (["good"], [True, 1, 2.0, 1], "key_index must be an integer"),
    (["good"], [0, -1, 2.0, 1], "step must be an integer from 0"),
    (["good"], [0, 1.5, 2.0, 1], "step must be an integer"),
    (["good"], [0, 2**64, 2.0, 1], "step must be an integer from 0"),
    (["good"], [0, 1, "high", 1], "\"NaN\""),
    (["good"], [0, 1, None, 1], "value must be a number"),
    (["good"], [0, 1, 2.0, "now"], "ts must be an integer"),
])
def test_a_bad_point_is_refused_and_the_good_ones_kept(client, db, keys, bad, fragment):
    run = new_run(client)
    good = [[0, s, 0.5, TS] for s in range(3)] + [[0, 3, "NaN", TS]]
    out = post(client, run, keys, good[:2] + [bad] + good[2:])
    assert out["accepted"] == 4 and out["refused"] == 1, out
    assert fragment in out["refusals"][0]["reason"] and out["refusals"][0]["points"] == 1
    assert count_points(db) == 4
    assert [k["key"] for k in get(client, f"/api/v1/runs/{run}/metrics")["keys"]] == ["good"]
    # the same bad point alone: nothing to keep, so the batch is the client's mistake
    err = post(client, run, keys, [bad], expect=400)["error"]
    assert err["code"] == "BadRequest" and fragment in err["message"], err
    ev = get(client, f"/api/v1/events?run={run}&type=METRIC_POINTS_REFUSED")["events"]
    assert len(ev) == 1 and ev[0]["count"] == 2 and ev[0]["severity"] == "warning", ev
    assert fragment in ev[0]["data"]["reasons"][0]["reason"]


def test_bad_json_and_empty_body(client):
    run = new_run(client)
    for data in (b"", b"{nope", b"\xff\xfe"):
        r = client.post(f"/api/v1/runs/{run}/metrics", data=data,
                        content_type="application/json")
        assert r.status_code == 400 and r.get_json()["error"]["code"] == "BadRequest"


def test_a_batch_loses_only_its_bad_points(client, db):
    run = new_run(client)
    out = post(client, run, ["a"], [[0, 0, 1.0, 1]] * 5 + [[0, 1, "bad", 1]])
    assert out == {"accepted": 5, "refused": 1, "refusals": [
        {"reason": out["refusals"][0]["reason"], "points": 1}]}
    assert count_points(db) == 1          # five times the same (key, step): one point


def test_tokens_and_unknown_run(client, db):
    run_a, run_b = new_run(client, "a"), new_run(client, "b")
    _, ingest_a = tokens.create(db, "run a", "ingest", run_id=run_a)
    _, read = tokens.create(db, "reader", "read")
    as_a = {"headers": {"Authorization": f"Bearer {ingest_a}"}}
    post(client, run_a, ["m"], [[0, 0, 1.0, 1]], **as_a)
    err = post(client, run_b, ["m"], [[0, 0, 1.0, 1]], expect=403, **as_a)
    assert err["error"]["code"] == "ForbiddenRun"
    err = post(client, run_a, ["m"], [[0, 1, 1.0, 1]], expect=403,
               headers={"Authorization": f"Bearer {read}"})
    assert err["error"]["code"] == "WriteScopeError"
    post(client, run_a, ["m"], [[0, 1, 1.0, 1]], expect=401, headers={"Authorization": ""})
    # The ingest token reads its own run and nothing else.
    r = client.get(f"/api/v1/runs/{run_a}/metrics/m", headers=as_a["headers"])
    assert r.status_code == 200
    r = client.get(f"/api/v1/runs/{run_b}/metrics", headers=as_a["headers"])
    assert r.status_code == 403
    assert count_points(db) == 1
    err = post(client, 4242, ["m"], [[0, 0, 1.0, 1]], expect=404)
    assert "4242" in err["error"]["message"]


def test_summary_best_latest_trend(client, db):
    run = new_run(client)
    n = 5000
    ingest_series(db, run, "train/loss", [10.0 / (1 + i / 100) for i in range(n)])
    ingest_series(db, run, "val/acc", [0.9 - i / n / 2 for i in range(n)])
    ingest_series(db, run, "lr", [0.1] * n)
    ingest_series(db, run, "one/loss", [1.0])
    ingest_series(db, run, "compare/a", [float(i) for i in range(100)])   # add_scalars
    rollup.roll_up(db)
    ingest_series(db, run, "train/loss", [0.001], start=n)   # the best, still raw
    keys = {k["key"]: k for k in get(client, f"/api/v1/runs/{run}/metrics")["keys"]}
    loss = keys["train/loss"]
    assert loss["direction"] == "min" and loss["trend"] == "improving"
    assert loss["best"] == {"step": n, "value": 0.001}
    assert loss["latest"]["step"] == n and loss["count"] == n + 1
    assert (loss["first_step"], loss["last_step"]) == (0, n)
    acc = keys["val/acc"]
    assert acc["direction"] == "max" and acc["trend"] == "worsening"
    assert acc["best"] == {"step": 0, "value": 0.9}
    # a schedule is not judged (issue 9 item 15)
    assert keys["lr"]["trend"] is None and keys["lr"]["judged"] is False
    assert keys["one/loss"]["trend"] == "unknown" and keys["one/loss"]["count"] == 1
    # a name that says nothing of its direction: goal unknown, never better or worse
    a = keys["compare/a"]
    assert a["direction"] is None and a["trend"] is None and a["best"] is None
    assert a["judged"] is False and a["role"] == "other" and not a["counter"]
    assert loss["role"] == "train" and loss["loss_like"] and loss["direction_from"] == "name"
    assert acc["role"] == "eval" and not acc["loss_like"]


def test_best_step_found_through_levels(client, db):
    run = new_run(client)
    values = [1.0] * 300_000
    values[123_457] = 0.5
    ingest_series(db, run, "loss", values)
    rollup.roll_up(db)
    k = get(client, f"/api/v1/runs/{run}/metrics")["keys"][0]
    assert k["best"] == {"step": 123_457, "value": 0.5}
    assert k["count"] == 300_000


@pytest.mark.parametrize("key,want", [
    ("train/loss", "min"), ("val_acc", "max"), ("eval/accuracy_top1", "max"),
    ("reward/mean", "max"), ("perplexity", "min"), ("step_time", "min"), ("lr", None),
    ("val/wer", "min"), ("f1", "max"), ("val/mse", "min"), ("compare/a", None),
])
def test_direction(key, want):
    assert semantic.direction(key) == want


def test_multi_run_series(client):
    a, b, c = new_run(client, "a"), new_run(client, "b"), new_run(client, "c")
    post(client, a, ["train/loss"], [[0, s, 1.0, TS] for s in range(50)])
    post(client, b, ["train/loss"], [[0, s, 2.0, TS + 10 * s] for s in range(5000)])
    post(client, c, ["other"], [[0, 0, 1.0, TS]])
    s = get(client, f"/api/v1/metrics/series?runs={a},{b},{c}&key=train/loss&max_points=100")
    by_run = {x["run_id"]: x for x in s["series"]}
    assert len(by_run[a]["points"]) == 50 and by_run[a]["level"] == 1
    assert 0 < len(by_run[b]["points"]) <= 100 and by_run[b]["points"][0][1] == 2.0
    # each bucket's time is its first point's: step 10 ms apart here
    assert by_run[b]["ts"] == [TS + 10 * p[0] for p in by_run[b]["points"]]
    assert by_run[a]["ts"] == [TS] * 50 and by_run[c]["ts"] == []
    assert by_run[c]["missing"] is True and by_run[c]["points"] == []
    err = get(client, f"/api/v1/metrics/series?runs={c}&key=train/loss", expect=404)
    assert "other" in err["error"]["message"]
    get(client, f"/api/v1/metrics/series?runs={a},999&key=train/loss", expect=404)
    get(client, "/api/v1/metrics/series?runs=x&key=train/loss", expect=400)
    get(client, f"/api/v1/metrics/series?runs={a}", expect=400)


def test_gateway_style_ingest_inside_outer_transaction(db, client):
    run = new_run(client)
    with pytest.raises(RuntimeError):
        with db.tx() as c:
            metrics.ingest(c, run, ["fresh"], [[0, 0, 1.0, 1]])
            raise RuntimeError("the batch failed")
    assert db.query_one("SELECT count(*) FROM metric_keys")[0] == 0
    post(client, run, ["fresh"], [[0, 0, 1.0, 1]])
    assert db.query_one("SELECT count(*) FROM points p JOIN metric_keys k ON k.id = p.key_id"
                        " WHERE k.key = 'fresh'")[0] == 1


def test_rollup_thread_survives_a_failing_tick(db, monkeypatch):
    from procs import wait_for
    calls = []

    def flaky(db_, stop=None):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")

    monkeypatch.setattr(rollup, "roll_up", flaky)
    r = Rollup(db, {})
    r.interval = 0.01
    r.start()
    try:
        wait_for(lambda: len(calls) >= 3, 10, what="ticks after a failure")
    finally:
        r.stop()
    assert not r._thread.is_alive()


def test_sparse_steps_still_fill_the_answer(client, db):
    run = new_run(client)
    with db.tx() as c:
        metrics.ingest(c, run, ["eval/loss"], [[0, s * 1000, 1.0 / (1 + s), TS]
                                              for s in range(20_000)])
    rollup.roll_up(db)
    s = get(client, f"/api/v1/runs/{run}/metrics/eval/loss?max_points=500")
    assert 250 <= len(s["points"]) <= 500
    assert sum(p[5] for p in s["points"]) == 20_000
    s = get(client, f"/api/v1/runs/{run}/metrics/eval/loss?from_step=5000000&to_step=5099999")
    assert s["level"] == 1 and [p[0] for p in s["points"]] == list(range(5_000_000, 5_100_000,
                                                                         1000))


def test_rollup_thread_keeps_up_with_concurrent_ingest(client, db):
    from procs import wait_for
    run = new_run(client)
    rollup = Rollup(db, {})
    rollup.interval = 0.01
    rollup.start()
    try:
        expect = {}
        for b in range(30):
            # Forward batches, a late batch filling gaps, and replacements of old steps.
            steps = range(b * 700, b * 700 + 700, 2) if b % 3 else range(b * 700 - 699, b * 700, 2)
            pts = [[0, s, float((s * 31) % 97), TS] for s in steps if s >= 0]
            pts += [[0, b * 10, -float(b), TS]]
            for _, s, v, _ in pts:
                expect[s] = v
            post(client, run, ["m"], pts)
        wait_for(lambda: db.query_one("SELECT count(*) FROM metric_dirty")[0] == 0, 30,
                 what="the rollup thread to drain the dirty ranges")
    finally:
        rollup.stop()
    top = db.query("SELECT r.count, r.min, r.max FROM rollups r JOIN metric_rollup m"
                   " USING (key_id) WHERE r.width = m.top_width")
    assert sum(r[0] for r in top) == len(expect) == count_points(db)
    assert min(r[1] for r in top) == min(expect.values())
    assert max(r[2] for r in top) == max(expect.values())
    base = {r[0]: tuple(r[1:]) for r in db.query(
        "SELECT bucket, count, min, max, last FROM rollups WHERE width = ?", (metrics.BASE,))}
    for bucket, (n, mn, mx, last) in base.items():
        vals = [(s, v) for s, v in expect.items() if s // metrics.BASE == bucket]
        assert n == len(vals) and mn == min(v for _, v in vals) and mx == max(v for _, v in vals)
        assert last == max(vals)[1]


def post_binary(client, run_id, body, expect=200):
    r = client.post(f"/api/v1/runs/{run_id}/metrics", data=body,
                    content_type=metricwire.BINARY_TYPE)
    assert r.status_code == expect, r.get_data(as_text=True)
    return r.get_json()


def test_binary_batches_store_the_same_points_as_json(client, db):
    a, b = new_run(client, "json"), new_run(client, "binary")
    points = [[0, s, 1.0 / (s + 1), TS + s] for s in range(300)] + \
        [[1, 5, float("nan"), TS], [1, 6, float("inf"), TS], [1, 7, -2.5, TS]]
    keys = ["train/loss", "odd"]
    post(client, a, keys, points)
    assert post_binary(client, b, metricwire.encode_binary(keys, points)) == {"accepted": 303}
    # a replay adds nothing
    post_binary(client, b, metricwire.encode_binary(keys, points))
    for key in keys:
        sa = get(client, f"/api/v1/runs/{a}/metrics/{key}?max_points=10000")["points"]
        sb = get(client, f"/api/v1/runs/{b}/metrics/{key}?max_points=10000")["points"]
        assert sa == sb and sa
    assert count_points(db) == 2 * 303


@pytest.mark.parametrize("mangle, fragment", [
    (lambda b: b"XXXX" + b[4:], "not a binary metric batch"),
    (lambda b: b[:-3], "carries"),
    (lambda b: b[:9] + b"{" + b[10:], "header is not JSON"),
])
def test_bad_binary_batches_are_400_and_store_nothing(client, db, mangle, fragment):
    run = new_run(client)
    body = metricwire.encode_binary(["loss"], [[0, 1, 0.5, TS], [0, 2, 0.4, TS]])
    out = post_binary(client, run, mangle(body), expect=400)
    assert fragment in out["error"]["message"]
    bad_index = metricwire.encode_binary(["loss"], [[3, 1, 0.5, TS]])
    assert "out of range" in post_binary(client, run, bad_index, expect=400)["error"]["message"]
    assert count_points(db) == 0


def test_binary_batch_keeps_its_good_points(client, db):
    run = new_run(client)
    keys = ["loss", "", "x" * 600, "loss"]
    points = [[0, 1, 0.5, TS], [1, 1, 0.5, TS], [2, 1, 0.5, TS], [3, 1, 0.5, TS],
              [9, 1, 0.5, TS], [0, 2, float("inf"), TS], [0, 3, float("nan"), TS]]
    out = post_binary(client, run, metricwire.encode_binary(keys, points))
    assert out["accepted"] == 3 and out["refused"] == 4, out
    assert sorted(r["reason"][:18] for r in out["refusals"]) == sorted(
        ["a key must not be ", "a point's key_inde", "key 'loss' is list", "key 'xxxxxxxxxxxxx"])
    assert count_points(db) == 3


def _same(a, b):
    """Rollup rows equal; sums (the only value whose rounding depends on how a bucket was
    split between batches) to 1e-12."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        x, y = tuple(x), tuple(y)
        if x[:5] + x[6:] != y[:5] + y[6:]:
            return False
        if (x[5] is None) != (y[5] is None) or (x[5] is not None and x[5] != pytest.approx(y[5], rel=1e-12)):
            return False
    return True


def test_buckets_written_at_ingest_equal_those_from_raw(client, db):
    """A batch that appends to its keys has its base buckets written by the ingest from
    the batch in memory; every level must hold exactly what aggregating the raw points
    gives, through appends (regular and irregular layouts, gaps, NaN, infinities, buckets
    split across batches), a late batch, a replayed one, and appends after those."""
    run = new_run(client)
    keys = ["loss", "acc", "lr"]
    # regular layout: every step lists all keys in order, steps 0..99 then 100..249
    post(client, run, keys, [[k, s, 1.0 / (1 + s) + k, TS + s] for s in range(100)
                             for k in range(3)])
    post(client, run, keys, [[k, s, float("nan") if s % 7 == 0 else s * 0.5 - k,
                              TS + 1000 - s]           # a clock that went back
                             for s in range(100, 250) for k in range(3)])
    # irregular: loss every step, acc every 10th, lr once; gaps; infinities
    pts = [[0, s, math.inf if s == 260 else -s, TS + s] for s in range(250, 400, 3)]
    pts += [[1, s, 2.0, TS] for s in range(250, 400, 10)] + [[2, 399, -math.inf, TS]]
    post(client, run, keys, pts)
    ids = {k: metrics.key_id(db, run, k) for k in keys}
    marks = db.query("SELECT key_id, base FROM metric_dirty ORDER BY id")
    assert all(base == 1 for _, base in marks)      # the appends took the ingest path
    written = db.query("SELECT count(*) FROM rollups WHERE width = ?", (metrics.BASE,))[0][0]
    assert written > 0                               # before any rollup ran
    rollup.roll_up(db)
    # a late batch (fills in), a replay with new values, then appends again
    post(client, run, ["loss"], [[0, s, 7.0, TS] for s in range(251, 400, 3)])
    post(client, run, ["acc"], [[0, s, -1.0, TS] for s in range(0, 120)])
    post(client, run, keys, [[k, s, float(s % 5), TS + s] for s in range(400, 450)
                             for k in range(3)])
    marks = db.query("SELECT key_id, base FROM metric_dirty ORDER BY id")
    assert [b for _, b in marks[:2]] == [0, 0] and all(b == 1 for _, b in marks[2:])
    rollup.roll_up(db)
    top = db.query_one("SELECT max(top_width) FROM metric_rollup")[0]
    with db.read() as conn:
        for key, key_id in ids.items():
            for w in [w for w in metrics.LEVELS if w <= top]:
                stored = metrics.level_rows(conn, key_id, w, 0, 10**6)
                fresh = metrics.agg_raw(conn, key_id, w, 0, 10**6)
                assert _same(stored, fresh), (key, w, stored[:3], fresh[:3])


def test_agg_batch_matches_sql_on_nan_and_infinities():
    steps = list(range(5, 60)) + [70, 71, 90]
    values = [float("nan") if s % 3 == 0 else math.inf if s == 20 else -math.inf if s == 22
              else s / 3 for s in steps]
    rows = metrics.agg_batch(steps, values, [TS + s for s in steps], 16)
    by_bucket = {r[0]: r for r in rows}
    assert sorted(by_bucket) == [0, 1, 2, 3, 4, 5]
    b1 = by_bucket[1]                     # steps 16..31, with inf and -inf: NaN sum
    assert b1[1:3] == (16, 31) and b1[3] == -math.inf and b1[4] == math.inf
    assert math.isnan(b1[5]) and b1[6] == 16 and b1[7] == 16 - 5
    assert by_bucket[5][1:3] == (90, 90) and by_bucket[5][6:8] == (1, 0)   # 90: NaN only
    assert by_bucket[5][3] is None and by_bucket[5][5] is None
    assert metrics.agg_batch([3, 2], [1.0, 1.0], [TS, TS], 16) is None
    assert metrics.agg_batch([3, 3], [1.0, 1.0], [TS, TS], 16) is None


def test_merge_rows_keeps_a_nan_sum_nan():
    """Rows (bucket, first, last, min, max, sum, count, vcount, last, first_ts): a NULL
    sum over values that are not all NaN is inf - inf, and folding it with another
    bucket must not lose that; a NULL sum over only NaN is no sum at all."""
    nan_sum = (0, 0, 15, -math.inf, math.inf, None, 16, 11, 1.0, TS + 3)
    plain = (0, 16, 31, 1.0, 2.0, 24.0, 16, 16, 2.0, TS)
    only_nan = (0, 32, 40, None, None, None, 9, 0, None, TS + 40)
    m = metrics.merge_rows(nan_sum, plain)
    assert m[:5] == (0, 0, 31, -math.inf, math.inf) and math.isnan(m[5])
    assert m[6:] == (32, 27, 2.0, TS)
    assert metrics.merge_rows(plain, only_nan)[3:8] == (1.0, 2.0, 24.0, 25, 16)


def test_summary_direction_from_a_definition(client, db):
    """`gpuplane metric set KEY --direction` decides before the name, in the summaries that
    `run show`, get_metric_summary and the dashboard read (gpuplane/vocab.py)."""
    run = new_run(client)
    ingest_series(db, run, "compare/a", [float(i) for i in range(200)])
    ingest_series(db, run, "val/acc", [float(i) for i in range(200)])
    keys = {k["key"]: k for k in get(client, f"/api/v1/runs/{run}/metrics")["keys"]}
    assert keys["compare/a"]["direction"] is None and keys["compare/a"]["trend"] is None
    for key, d in (("compare/a", "max"), ("val/acc", "min")):
        r = client.put("/api/v1/metric-definitions", json={"key": key, "project": "p",
                                                          "direction": d})
        assert r.status_code == 200, r.get_json()
    keys = {k["key"]: k for k in get(client, f"/api/v1/runs/{run}/metrics")["keys"]}
    a, acc = keys["compare/a"], keys["val/acc"]
    assert (a["direction"], a["direction_from"], a["trend"]) == ("max", "definition",
                                                                 "improving")
    assert a["best"] == {"step": 199, "value": 199.0}
    assert (acc["direction"], acc["trend"], acc["best"]["step"]) == ("min", "worsening", 0)


def test_after_retention_a_checkpoint_never_takes_another_steps_value(client, db):
    """Issue 22: once raw points were pruned, a checkpoint's value (GET /checkpoints/ID,
    recommend) silently came from the nearest surviving step, however far. Retention now
    keeps the point at each registered checkpoint's step; a checkpoint without one in the
    pruned range has no value, and recommend never ranks by another step's."""
    run = new_run(client)
    recent = now_ms()
    old = recent - 30 * 86_400_000
    # eval/loss every 100 steps, lowest (best) at step 500; old except the last ten
    pts = [[0, s, 1.0 + abs(s - 500) / 1000, old] for s in range(0, 10_000, 100)]
    pts += [[0, 10_000 + s, 5.0, recent] for s in range(10)]
    with db.tx() as c:
        metrics.ingest(c, run, ["eval/loss"], pts)
    ck = {}
    for step in (500, 550):          # 550: between two logged steps
        r = client.post(f"/api/v1/runs/{run}/checkpoints", json={"path": f"/c/{step}.pt",
                                                                "step": step})
        ck[step] = r.get_json()["id"]
    Rollup(db, {"raw_retention_days": 7}).tick()
    assert count_points(db) == 11            # the ten recent ones and step 500's
    c500 = get(client, f"/api/v1/checkpoints/{ck[500]}")["metrics"]
    assert c500 == {"eval/loss": {"step": 500, "value": 1.0}}
    assert get(client, f"/api/v1/checkpoints/{ck[550]}")["metrics"] == {}
    # registered after the prune: no value either (the nearest left is step 500 or 10000)
    r = client.post(f"/api/v1/runs/{run}/checkpoints", json={"path": "/c/9000.pt",
                                                            "step": 9000})
    assert get(client, f"/api/v1/checkpoints/{r.get_json()['id']}")["metrics"] == {}
    best = get(client, f"/api/v1/checkpoints:recommend?run={run}&key=eval/loss")
    assert best["checkpoint"]["checkpoint_id"] == ck[500], best
    assert [c["checkpoint_id"] for c in best["ranked"]] == [ck[500]]
    assert best["candidates"] == 3 and best["runner_up"] is None
