"""The watchers of a running attempt and of the node: TensorBoard, checkpoints, node stats.

Nothing here waits with sleep(): every wait polls a condition with a deadline.
"""
import logging
import os

import pytest

import agent
from agentutil import PY, job_records, records, start_msg, wait_until, write_script


def _tb_write(tb_dir, points):
    from tensorboard.summary import Writer
    w = Writer(str(tb_dir))
    for tag, step, value in points:
        w.add_scalar(tag, value, step=step)
    w.flush()
    w.close()


def test_tb_hook_emits_metrics_and_persists_offsets(tmp_path, hosts):
    """The real TBTailer inside the runner: points reach the outbox once, and a restarted
    agent carries on from the saved offsets (a second event file appears meanwhile)."""
    tb = tmp_path / "tb"
    write_script(tmp_path / "sleepy.py", "import time\nwhile True: time.sleep(1)\n")
    home = tmp_path / "home"
    a = hosts(home)
    a.runner.handle_start(start_msg(17, [PY, "sleepy.py"], tmp_path, tb_dir="tb"))
    _tb_write(tb, [("loss", 1, 0.5), ("loss", 2, 0.25)])
    wait_until(lambda: sum(len(r["points"]) for r in records(a.outbox, "metrics")
                           if r["source"] == "tb") == 2, what="tb metrics")
    m = [r for r in records(a.outbox, "metrics") if r["source"] == "tb"][0]
    assert m["run_id"] == 117
    assert [p[:3] for p in m["points"]] == [["loss", 1, 0.5], ["loss", 2, 0.25]]
    a.stop()
    _tb_write(tb / "eval", [("acc", 3, 0.75)])
    b = hosts(home)
    wait_until(lambda: [r for r in records(b.outbox, "metrics") if r["source"] == "tb"
                        and r["points"][0][0] == "eval/acc"], what="new tb point")
    tb_points = [p[:3] for r in records(b.outbox, "metrics") if r["source"] == "tb"
                 for p in r["points"]]
    assert tb_points == [["loss", 1, 0.5], ["loss", 2, 0.25], ["eval/acc", 3, 0.75]]
    b.runner.handle_cancel({"type": "cancel", "job_id": 17, "attempt": 1})
    b.wait_exited(17)


def test_checkpoint_watch(tmp_path, hosts):
    h = hosts(tmp_path / "home")
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    write_script(tmp_path / "sleepy.py", "import time\nwhile True: time.sleep(1)\n")
    h.runner.handle_start(start_msg(18, [PY, "sleepy.py"], tmp_path, watch_dir="checkpoints"))
    (ck / "model-step=200.pt").write_bytes(b"w" * 100)
    (ck / "ignored.tmp").write_bytes(b"w")
    (ck / "notes.txt").write_bytes(b"not a checkpoint")
    rec = wait_until(lambda: records(h.outbox, "checkpoint"), what="checkpoint")[0]
    assert rec["path"] == str(ck / "model-step=200.pt")
    assert rec["step"] == 200 and rec["size_bytes"] == 100 and rec["run_id"] == 118
    assert rec["format"] == "pt" and rec["step_source"] == "name"
    h.runner.handle_cancel({"type": "cancel", "job_id": 18, "attempt": 1})
    h.wait_exited(18)
    assert len(records(h.outbox, "checkpoint")) == 1


# What the frameworks write, by name (Lightning 2.x ModelCheckpoint with its default
# filename and save_last, and a monitored filename; HF Trainer's output_dir with
# save_steps; Keras ModelCheckpoint; plain torch.save and safetensors).
LIGHTNING = ["lightning_logs/version_0/checkpoints/epoch=3-step=1200.ckpt",
             "lightning_logs/version_0/checkpoints/epoch=4-step=1500-v1.ckpt",
             "lightning_logs/version_0/checkpoints/last.ckpt",
             "lightning_logs/version_0/checkpoints/epoch=2-val_loss=0.12.ckpt",
             "lightning_logs/version_0/hparams.yaml"]


HF_FILES = ["config.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
            "rng_state.pth", "trainer_state.json", "training_args.bin"]


def test_checkpoint_layouts_of_the_frameworks(tmp_path):
    root = tmp_path / "out"
    for rel in LIGHTNING + ["keras/model.05.keras", "keras/weights.h5", "torch/ckpt-1500.pt",
                            "torch/epoch_7.pth", "st/model.safetensors",
                            ".hidden/x.pt", "big.pt.partial"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * 10)
    for step in (500, 1000):
        for name in HF_FILES:
            (root / "hf" / f"checkpoint-{step}").mkdir(parents=True, exist_ok=True)
            (root / "hf" / f"checkpoint-{step}" / name).write_bytes(b"y" * 7)
    (root / "hf" / "tmp-checkpoint-1500").mkdir()        # HF writes here, then renames
    (root / "hf" / "tmp-checkpoint-1500" / "model.safetensors").write_bytes(b"z")
    att = agent.Attempt(1, 1, str(tmp_path))
    found = agent.CheckpointHook(att).scan(str(root))
    rel = {os.path.relpath(p, root): (fmt, size) for p, (_sig, fmt, size, _m) in found.items()}
    assert rel == {
        LIGHTNING[0]: ("lightning", 10), LIGHTNING[1]: ("lightning", 10),
        LIGHTNING[2]: ("lightning", 10), LIGHTNING[3]: ("lightning", 10),
        "keras/model.05.keras": ("keras", 10), "keras/weights.h5": ("keras", 10),
        "torch/ckpt-1500.pt": ("pt", 10), "torch/epoch_7.pth": ("pt", 10),
        "st/model.safetensors": ("safetensors", 10),
        "hf/checkpoint-500": ("hf", 7 * len(HF_FILES)),
        "hf/checkpoint-1000": ("hf", 7 * len(HF_FILES))}
    steps = {r: agent.checkpoint_step(os.path.basename(r)) for r in rel}
    assert steps[LIGHTNING[0]] == (1200, 3.0) and steps[LIGHTNING[1]] == (1500, 4.0)
    assert steps[LIGHTNING[2]] == (None, None) and steps[LIGHTNING[3]] == (None, 2.0)
    assert steps["hf/checkpoint-500"] == (500, None)
    assert steps["torch/ckpt-1500.pt"] == (1500, None)
    assert steps["torch/epoch_7.pth"] == (None, 7.0)
    assert steps["st/model.safetensors"] == (None, None)


def test_hf_checkpoint_written_just_before_exit_is_one_checkpoint(tmp_path, hosts):
    """The job writes checkpoint-20/ and exits at once: the final scan registers it (the
    process is gone, so it is complete), as ONE checkpoint at step 20, path absolute."""
    h = hosts(tmp_path / "home")
    code = ("import os\n"
            "d = os.path.join('out', 'checkpoint-20')\n"
            "os.makedirs(d)\n"
            f"for n in {HF_FILES!r}:\n"
            "    open(os.path.join(d, n), 'wb').write(b'w' * 5)\n"
            "open('out/final.safetensors', 'wb').write(b'f' * 3)\n")
    h.runner.handle_start(start_msg(30, [PY, "-c", code], tmp_path, watch_dir="out"))
    h.wait_exited(30)
    recs = records(h.outbox, "checkpoint")
    by_path = {r["path"]: r for r in recs}
    assert set(by_path) == {str(tmp_path / "out" / "checkpoint-20"),
                            str(tmp_path / "out" / "final.safetensors")}
    hf = by_path[str(tmp_path / "out" / "checkpoint-20")]
    assert hf["format"] == "hf" and hf["step"] == 20 and hf["size_bytes"] == 5 * len(HF_FILES)
    final = by_path[str(tmp_path / "out" / "final.safetensors")]
    assert final["step"] is None and final["step_source"] == "latest"
    # the final record comes after the checkpoints
    kinds = [r["kind"] for r in records(h.outbox) if r.get("job_id", 30) == 30]
    assert kinds[-1] == "job" and kinds.index("checkpoint") < len(kinds) - 1


@pytest.mark.parametrize("watch", ["missing", "afile", "/", "loop"])
def test_bad_watch_dirs_are_a_logged_skip(tmp_path, hosts, caplog, watch):
    (tmp_path / "afile").write_text("x")
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    h = hosts(tmp_path / "home")
    with caplog.at_level(logging.WARNING, logger="gpuplane.agent"):
        h.runner.handle_start(start_msg(31, "echo done", tmp_path, watch_dir=watch))
        rec = h.wait_exited(31)
    assert rec["exit_code"] == 0 and rec["failure_kind"] is None
    assert not records(h.outbox, "checkpoint")
    skips = [r.getMessage() for r in caplog.records if "not watching" in r.getMessage()]
    assert len(skips) == 1 and repr(watch) in skips[0]


def test_checkpoint_scan_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(agent, "CKPT_MAX_ENTRIES", 50)
    monkeypatch.setattr(agent, "CKPT_MAX_DEPTH", 2)
    deep = tmp_path / "a" / "b" / "c" / "d"
    deep.mkdir(parents=True)
    (deep / "deep.pt").write_bytes(b"x")
    (tmp_path / "a" / "b" / "ok.pt").write_bytes(b"x")
    for i in range(200):
        (tmp_path / f"f{i:03d}.pt").write_bytes(b"x")
    found = agent.CheckpointHook(agent.Attempt(1, 1, str(tmp_path))).scan(str(tmp_path))
    assert len(found) <= 50
    assert not any(p.endswith("deep.pt") for p in found)


def test_fake_gpus_and_system_metrics(tmp_path, hosts):
    probe = agent.GpuProbe(fake_gpus=2, node="box-a")
    facts = probe.facts()
    # two agents on one host simulate two nodes: their GPUs must not look the same
    other = agent.GpuProbe(fake_gpus=2, node="box-b").facts()
    assert len({g["uuid"] for g in facts + other}) == 4
    assert [g["name"] for g in facts] == ["Fake GPU 0", "Fake GPU 1"]
    assert all(g["fake"] and g["memory_total_mb"] == 24576 for g in facts)
    sample = probe.sample({1})
    assert sample[1]["util"] > sample[0]["util"] and sample[1]["mem_used_mb"] > 1000

    h = hosts(tmp_path / "home")
    write_script(tmp_path / "sleepy.py", "import time\nwhile True: time.sleep(1)\n")
    h.runner.handle_start(start_msg(19, [PY, "sleepy.py"], tmp_path, gpus=[1],
                                    cpu_only=False))
    wait_until(lambda: job_records(h.outbox, 19, "RUNNING"), what="RUNNING")
    stats = agent.StatsReporter(h.outbox, h.runner, probe, str(tmp_path))
    stats.tick()
    ns = records(h.outbox, "node_stats")[0]
    assert len(ns["gpus"]) == 2 and ns["gpus"][1]["fake"] is True
    assert ns["host"]["mem_total_mb"] > 0 and ns["host"]["disk_free_mb"] > 0
    m = [r for r in records(h.outbox, "metrics") if r["source"] == "system"][0]
    keys = {p[0] for p in m["points"]}
    assert {"sys/cpu_percent", "sys/rss_mb", "sys/gpu1/util", "sys/gpu1/mem_used_mb"} <= keys
    assert m["run_id"] == 119 and not any(k.startswith("sys/gpu0") for k in keys)
    assert all(p[1] == m["points"][0][1] for p in m["points"])
    h.runner.handle_cancel({"type": "cancel", "job_id": 19, "attempt": 1})
    h.wait_exited(19)


def test_no_driver_logs_once_and_reports_no_gpus(caplog):
    with caplog.at_level(logging.WARNING, logger="gpuplane.agent"):
        probe = agent.GpuProbe(fake_gpus=0)
    if probe.nvml is not None:
        pytest.skip("this host has an NVIDIA driver")
    msgs = [r.getMessage() for r in caplog.records if "no NVIDIA driver" in r.getMessage()]
    assert len(msgs) == 1 and "--fake-gpus" in msgs[0]
    assert probe.facts() == [] and probe.sample() == []
