"""The SDK against the real GPUPlane server (gunicorn, SQLite): the wire format of
docs/api.md as the server actually parses it."""

import math

import requests


def test_registered_run_against_the_real_server(sdk, server_factory, tmp_path):
    srv = server_factory()
    run_id = sdk.init(project="real", name="sdk-run", config={"lr": 0.1},
                      server=srv.url, token=srv.token)
    assert run_id is not None and sdk.summary()["mode"] == "registered"
    for i in range(3000):
        sdk.log({"train/loss": math.nan if i == 1500 else 1.0 / (i + 1),
                 "train/inf": math.inf})
    ckpt = tmp_path / "last.pt"
    ckpt.write_bytes(b"w" * 42)
    sdk.log_checkpoint(ckpt, epoch=1)
    sdk.log_event("done", {"ok": True})
    assert sdk.flush(30)
    s = sdk.summary()
    assert s["sent"] == 6000 and s["errors"] == 0 and s["queued"] == 0
    sdk.finish()

    h = {"Authorization": "Bearer " + srv.token}
    run = requests.get("%s/api/v1/runs/%s" % (srv.url, run_id), headers=h, timeout=10).json()
    assert run["source"] == "sdk" and run["project"] == "real" and run["name"] == "sdk-run"
    assert run["state"] == "SUCCEEDED"
    keys = requests.get("%s/api/v1/runs/%s/metrics" % (srv.url, run_id), headers=h,
                        timeout=10).json()["keys"]
    names = {k["key"] if isinstance(k, dict) else k for k in keys}
    assert {"train/loss", "train/inf"} <= names
    series = requests.get("%s/api/v1/runs/%s/metrics/train/loss?max_points=5000"
                          % (srv.url, run_id), headers=h, timeout=10).json()
    assert len(series["points"]) == 3000


def test_one_bad_member_never_costs_the_batch(sdk, server_factory):
    """Issue 22: an empty or over-long name, a negative step, or two names that are the
    same text (1 and "1") used to make the server refuse the whole batch, which the SDK
    then dropped. Now the good points are stored, the bad ones counted with reasons."""
    srv = server_factory()
    run_id = sdk.init(project="real", name="bad-members", server=srv.url, token=srv.token)
    for i in range(200):
        sdk.log({"loss": 1.0 / (i + 1), "": 1.0, "x" * 600: 2.0, 1: 0.5, "1": 0.25}, step=i)
    sdk.log({"loss": 9.0}, step=-1)
    assert sdk.flush(30)
    s = sdk.summary()
    assert s["refused"] == 401 and s["errors"] == 0 and s["sent"] == 600, s
    assert sum(s["refusals"].values()) == 401
    assert any("must not be empty" in r for r in s["refusals"]), s["refusals"]
    assert any("at most 512" in r for r in s["refusals"]), s["refusals"]
    assert any("step" in r for r in s["refusals"]), s["refusals"]
    sdk.finish()
    h = {"Authorization": "Bearer " + srv.token}
    keys = {k["key"]: k["count"] for k in requests.get(
        "%s/api/v1/runs/%s/metrics" % (srv.url, run_id), headers=h, timeout=10).json()["keys"]}
    assert keys == {"loss": 200, "1": 200}, keys
    ev = requests.get("%s/api/v1/events?run=%s&type=METRIC_POINTS_REFUSED" % (srv.url, run_id),
                      headers=h, timeout=10).json()["events"]
    assert sum(e["count"] for e in ev) == 401
