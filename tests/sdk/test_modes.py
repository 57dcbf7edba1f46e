"""The three modes of run.init and the value rules of run.log, against a real HTTP server."""

import json
import math
import os
import threading
import time

from gpuctl import sender
from sdkutil import spool_points, TOKEN, wait_for


def _spool_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_local_mode_writes_everything_to_the_spool(sdk, tmp_path, monkeypatch):
    monkeypatch.setattr(sender, "BATCH_MAX", 1000)  # so 2500 points make several records
    assert sdk.init(project="p", config={"lr": 0.1}) is None
    s = sdk.summary()
    assert s["mode"] == "local" and s["state"] == "running"
    assert s["run_id"].startswith("local-%d-" % os.getpid())
    for i in range(2500):
        sdk.log({"loss": 1.0 / (i + 1)})
    sdk.log_checkpoint(tmp_path / "missing.pt")
    assert sdk.flush(5)
    s = sdk.summary()
    assert s["spool"] == str(tmp_path / "home" / "spool" / ("sdk-%s.jsonl" % s["run_id"]))
    lines = _spool_lines(s["spool"])
    assert lines[0]["t"] == "run" and lines[0]["project"] == "p"
    assert lines[0]["config"] == {"lr": 0.1}
    steps = [p[1] for ln in lines if ln["t"] == "metrics" for p in spool_points(ln["body"])]
    assert steps == list(range(2500))
    sizes = [len(spool_points(ln["body"])) for ln in lines if ln["t"] == "metrics"]
    assert max(sizes) <= 1000 and len(sizes) >= 3
    assert lines[-1]["t"] == "checkpoint" and lines[-1]["body"]["size_bytes"] == 0
    assert s["sent"] == 0 and s["queued"] == 2501 - 1  # the checkpoint is not a point
    assert [t.name for t in threading.enumerate()].count("gpuctl-sdk-sender") == 1


def test_registered_mode_sends_everything_and_finishes_once(sdk, server, monkeypatch):
    monkeypatch.setattr(sender, "BATCH_MAX", 1000)  # so 5000 points take several posts
    run_id = sdk.init(project="mnist", experiment="sweep", name="r1", config={"lr": 1e-3},
                      server=server.url, token=TOKEN)
    assert run_id == "101"
    assert server.runs[101] == {"project": "mnist", "experiment": "sweep", "name": "r1",
                                "config": {"lr": 1e-3}, "source": "sdk"}
    assert sdk.init(project="other") == "101"  # idempotent: no second run
    assert len(server.runs) == 1
    for i in range(2500):
        sdk.log({"train/loss": 2.0 - i / 2500, "train/acc": i / 2500}, step=i)
    assert sdk.flush(10)
    assert server.identities(101) == {(k, i) for i in range(2500)
                                      for k in ("train/loss", "train/acc")}
    assert all(p[0].startswith("/api/v1/runs/101/") for p in server.posts("/metrics"))
    sizes = [len(b["points"]) for _, b in server.posts("/metrics")]
    assert max(sizes) <= 1000 and len(sizes) >= 5
    s = sdk.summary()
    assert s["sent"] == 5000 and s["queued"] == 0 and s["spool"] is None
    assert s["latest"]["train/acc"] == 2499 / 2500
    sdk.finish("FAILED")
    assert [b for _, b in server.posts("/runs/101/finish")] == [{"status": "FAILED"}]
    sdk.finish()
    sdk.log({"late": 1.0})  # ignored after finish
    assert len(server.posts("/finish")) == 1
    assert sdk.summary()["state"] == "finished"
    assert "gpuctl-sdk-sender" not in [t.name for t in threading.enumerate()]
    assert ("late", 2500) not in server.identities(101)


def test_attached_mode_from_the_environment_without_init(sdk, server, monkeypatch):
    monkeypatch.setenv("GPUCTL_RUN_ID", "77")
    monkeypatch.setenv("GPUCTL_SERVER", server.url + "/")
    monkeypatch.setenv("GPUCTL_TOKEN", TOKEN)
    sdk.log({"loss": 0.5})  # no init: attaches to the job's run
    sdk.log({"loss": 0.4})
    assert sdk.summary()["mode"] == "attached" and sdk.summary()["run_id"] == "77"
    assert sdk.init(project="ignored") == "77"
    assert sdk.flush(5)
    assert server.identities(77) == {("loss", 0), ("loss", 1)}
    assert server.runs == {}  # attached runs are never registered
    sdk.finish()
    assert server.posts("/finish") == []  # the agent reports a job's outcome
    path, headers, _ = server.requests[0]
    assert headers["Authorization"] == "Bearer " + TOKEN


def test_value_rules(sdk, server):
    sdk.init(server=server.url, token=TOKEN)

    class Scalar:  # a one-element tensor or numpy scalar, as far as float() is concerned
        def __float__(self):
            return 3.5

    before = time.time() * 1000
    sdk.log({"a": 1, "s": "text", "n": None, "l": [1], "b": True, "nan": float("nan"),
             "inf": float("inf"), "ninf": -math.inf, "obj": Scalar(), 5: 2.0})
    after = time.time() * 1000
    sdk.log({})  # nothing, and no step used
    sdk.log({"a": 2})  # auto step 1
    sdk.log({"a": 3}, step=10)
    sdk.log({"a": 4})  # 11
    sdk.log({"a": 5}, step=7.0, epoch=2)  # a float step is made an int
    sdk.log({"a": 6}, step=20, ts=1234)
    assert sdk.flush(5)
    vals = server.values(101)
    assert set(vals) == {("a", 0), ("nan", 0), ("inf", 0), ("ninf", 0), ("obj", 0), ("5", 0),
                         ("a", 1), ("a", 10), ("a", 11), ("a", 7), ("epoch", 7), ("a", 20)}
    assert vals[("nan", 0)] == {"nan"} and vals[("inf", 0)] == {math.inf}
    assert vals[("ninf", 0)] == {-math.inf} and vals[("obj", 0)] == {3.5}
    assert vals[("epoch", 7)] == {2.0}
    metrics = [b for _, b in server.posts("/metrics")]
    pts = {(b["keys"][p[0]], p[1]): p[3] for b in metrics for p in b["points"]}
    assert before - 1 <= pts[("a", 0)] <= after + 1
    assert pts[("a", 20)] == 1234
    assert sdk.summary()["latest"]["a"] == 6


def test_bad_input_never_raises(sdk, tmp_path):
    sdk.init()
    sdk.log(None)
    sdk.log("loss")
    sdk.log([("a", 1)])
    sdk.log({"a": 1}, step="x")
    sdk.log({"a": 1}, ts="yesterday")
    sdk.log({"a": 10 ** 400})  # no float can hold it
    sdk.log_checkpoint(None)
    sdk.log_checkpoint(tmp_path, step="nope")
    sdk.log_event(object(), data={"x": object()})
    sdk.flush(timeout_s="soon")
    sdk.finish(status=object())
    sdk.finish()
    assert sdk.summary()["errors"] >= 5


def test_checkpoints_and_events_keep_their_place_between_points(sdk, server, tmp_path,
                                                               monkeypatch):
    d = tmp_path / "ckpt"
    (d / "sub").mkdir(parents=True)
    (d / "a.bin").write_bytes(b"x" * 100)
    (d / "sub" / "b.bin").write_bytes(b"y" * 23)
    f = tmp_path / "one.pt"
    f.write_bytes(b"z" * 7)
    monkeypatch.chdir(tmp_path)
    sdk.init(server=server.url, token=TOKEN)
    sdk.log({"loss": 1.0}, step=1)
    sdk.log_checkpoint("ckpt", epoch=1)
    sdk.log({"loss": 0.5}, step=2)
    sdk.log_checkpoint(f, step=2)
    sdk.log_event("lr_drop", {"lr": 0.01})
    assert sdk.flush(5)
    order = [(p.rsplit("/", 1)[1], b) for p, _, b in server.requests][1:]  # after POST /runs
    kinds = [k for k, _ in order]
    assert kinds == ["metrics", "checkpoints", "metrics", "checkpoints", "events"]
    c1, c2 = json.loads(order[1][1]), json.loads(order[3][1])
    assert c1["path"] == str(d) and c1["abs_path"] == str(d)  # no job dir to resolve with
    assert c1["size_bytes"] == 123 and c1["step"] == 1 and c1["epoch"] == 1.0
    assert c2["path"] == str(f) and c2["size_bytes"] == 7 and c2["step"] == 2
    ev = json.loads(order[4][1])
    assert ev["name"] == "lr_drop" and ev["data"] == {"lr": 0.01} and ev["step"] == 2
    assert d.exists() and f.read_bytes() == b"z" * 7  # registered, never moved


def test_attached_checkpoint_path_is_sent_as_given(sdk, server, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPUCTL_RUN_ID", "5")
    monkeypatch.setenv("GPUCTL_SERVER", server.url)
    monkeypatch.setenv("GPUCTL_TOKEN", TOKEN)
    sdk.log_checkpoint("ckpt/last.pt", step=3)
    assert sdk.flush(5)
    [(path, body)] = server.posts("/checkpoints")
    assert path == "/api/v1/runs/5/checkpoints"
    assert body["path"] == "ckpt/last.pt"  # the server resolves it with the job's dir
    assert body["abs_path"] == str(tmp_path / "ckpt" / "last.pt")


def test_registration_refused_falls_back_to_local(sdk, server):
    server.mode = "401"
    assert sdk.init(server=server.url, token=TOKEN) is None
    assert sdk.summary()["mode"] == "local"
    sdk.log({"loss": 1.0})
    assert sdk.flush(5)
    assert server.applied == []


def test_server_down_at_init_falls_back_to_local(sdk, server):
    url = server.url
    server.close()  # nothing listens there now
    assert sdk.init(server=url, token=TOKEN) is None
    sdk.log({"loss": 1.0})
    assert sdk.flush(5)
    s = sdk.summary()
    assert s["mode"] == "local" and os.path.exists(s["spool"])


def test_local_run_is_registered_when_the_server_comes_back(sdk, server):
    server.mode = "500"
    assert sdk.init(project="late", server=server.url, token=TOKEN) is None
    for i in range(1500):
        sdk.log({"loss": float(i)})
    sdk.log_event("hello")
    assert sdk.flush(5)
    server.mode = "good"
    wait_for(lambda: sdk.summary()["mode"] == "registered", what="late registration")
    run_id = int(sdk.summary()["run_id"])
    assert server.runs[run_id]["project"] == "late"
    sdk.log({"loss": -1.0})
    assert sdk.flush(5)
    assert server.identities(run_id) == {("loss", i) for i in range(1501)}
    assert len(server.posts("/events")) == 1
    assert sdk.summary()["spool"] is None
