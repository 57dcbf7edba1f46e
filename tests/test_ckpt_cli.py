"""`gpuplane project/exp/metric/ckpt/import-run` against a real server (in-process CLI)."""
import json
import os

import pytest

from gpuplane import cli


@pytest.fixture
def run_cli(live_server, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("GPUCTL_TOKEN", live_server.token)
    monkeypatch.setenv("GPUCTL_HOME", str(tmp_path / "home"))

    def run(*argv, code=0):
        got = cli.main(["--server", live_server.url, *argv])
        out = capsys.readouterr()
        assert got == code, (argv, out.err)
        return out
    return run


def test_projects_experiments_and_metric_definitions(run_cli, live_server):
    run_cli("project", "create", "vision", "--description", "cnns")
    run_cli("exp", "create", "lr", "--project", "vision")
    assert "vision" in run_cli("project", "list").out
    run_cli("exp", "rename", "lr", "lr-sweep", "--project", "vision")
    exps = json.loads(run_cli("exp", "list", "--project", "vision", "--json").out)
    assert [e["name"] for e in exps] == ["lr-sweep"]
    out = run_cli("metric", "set", "eval/acc", "--primary", "--project", "vision",
                  "--experiment", "lr-sweep").out
    assert "eval/acc: max, primary (experiment vision/lr-sweep)" in out
    listed = json.loads(run_cli("metric", "list", "--project", "vision", "--experiment",
                                "lr-sweep", "--json").out)
    assert listed["primary"] == {"key": "eval/acc", "from": "experiment"}
    # A definition's scope is created with it (a sweep's metric is set before its runs).
    run_cli("metric", "set", "x", "--project", "vision", "--experiment", "nope")
    assert "nope" in run_cli("exp", "list", "--project", "vision").out
    run_cli("exp", "delete", "nope", "--project", "vision")
    assert "--experiment needs --project" in run_cli("metric", "set", "x", "--experiment",
                                                     "e", code=2).err
    assert "deleted project vision" in run_cli("project", "delete", "vision").out
    live_server.api.post("/api/v1/runs", {"project": "busy"}, expect=201)
    assert "--archive" in run_cli("project", "delete", "busy", code=1).err
    assert "archived project busy" in run_cli("project", "delete", "busy", "--archive").out
    assert "busy" in run_cli("project", "list", "--archived").out


def test_import_run_twice_adds_nothing(run_cli, live_server, tmp_path):
    from tensorboard.summary import Writer
    d = tmp_path / "old-run"
    w = Writer(str(d / "version_0"))        # a launch dir: not part of the keys
    for step in range(50):
        w.add_scalar("train/loss", 1.0 / (step + 1), step=step)
    w.add_scalar("val/acc", 0.9, step=49)
    w.close()
    (d / "checkpoints").mkdir()
    (d / "checkpoints" / "epoch=1-step=49.ckpt").write_bytes(b"x" * 10)
    hf = d / "checkpoint-20"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"y" * 7)
    (hf / "trainer_state.json").write_text("{}")

    first = json.loads(run_cli("import-run", str(d), "--project", "legacy", "--json").out)
    assert first["created"] and first["points"] == 51 and first["new_checkpoints"] == 2
    again = json.loads(run_cli("import-run", str(d), "--project", "legacy", "--json").out)
    assert again["run_id"] == first["run_id"] and not again["created"]
    assert again["new_checkpoints"] == 0
    api = live_server.api
    run = api.get(f"/api/v1/runs/{first['run_id']}", expect=200)
    assert run["source"] == "import" and run["project"] == "legacy"
    keys = {k["key"]: k for k in api.get(f"/api/v1/runs/{first['run_id']}/metrics")["keys"]}
    assert set(keys) == {"train/loss", "val/acc"} and keys["train/loss"]["count"] == 50
    ckpts = api.get(f"/api/v1/runs/{first['run_id']}/checkpoints")["checkpoints"]
    assert [(c["step"], c["format"], c["size_bytes"]) for c in ckpts] == \
        [(20, "hf", 9), (49, "lightning", 10)]
    assert all(os.path.isabs(c["path"]) for c in ckpts)
    out = run_cli("ckpt", "list", "--run", str(first["run_id"])).out
    assert "checkpoint-20" in out
    shown = run_cli("ckpt", "show", str(ckpts[1]["id"])).out
    assert "val/acc" in shown and "train/loss" in shown
    assert "not a directory" in run_cli("import-run", str(tmp_path / "nope"), "--project",
                                        "legacy", code=1).err
