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
