"""The framework callbacks register the checkpoints their trainer saves, and the Lightning
one logs at the step Lightning's own loggers use. Without the frameworks: the hooks are
called as the trainers call them, on objects with the attributes the callbacks read
(Lightning 2.x: `fit_loop.epoch_loop._batches_that_stepped`, `checkpoint_callbacks`;
transformers: `args.output_dir`, `state.global_step`), over files named as they name them."""
import types

import pytest

from gpuctl import callbacks


@pytest.fixture
def calls(monkeypatch):
    got = []
    monkeypatch.setattr(callbacks.run, "log", lambda m, step=None, **k: got.append(
        ("log", dict(m), step)))
    monkeypatch.setattr(callbacks.run, "log_checkpoint", lambda p, step=None, epoch=None:
                        got.append(("ckpt", str(p), step, epoch)))
    return got


def _bare(cls, *args):
    obj = object.__new__(cls)       # no framework base class needed for the hooks
    obj.__init__(*args)
    return obj


def test_lightning_logs_at_the_loggers_step_and_registers_saved_files(calls, tmp_path):
    cb = _bare(callbacks.GpuctlLightningCallback, 1)
    mc = types.SimpleNamespace(best_k_models={}, last_model_path="", best_model_path="")
    trainer = types.SimpleNamespace(
        global_step=1, current_epoch=0, is_global_zero=True, sanity_checking=False,
        callback_metrics={"train/loss": 0.5, "val/loss": 0.7},
        fit_loop=types.SimpleNamespace(epoch_loop=types.SimpleNamespace(
            _batches_that_stepped=0)),
        checkpoint_callbacks=[mc])
    cb.on_train_batch_end(trainer, None, None, None, 0)
    # the optimizer step made global_step 1; Lightning's TensorBoard logger writes at 0
    assert calls == [("log", {"train/loss": 0.5}, 0)]
    cb.on_validation_end(trainer, None)
    assert calls[-1] == ("log", {"train/loss": 0.5, "val/loss": 0.7}, 0)

    # ModelCheckpoint saved (after our hook ran): found at the next hook, once
    saved = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    saved.mkdir(parents=True)
    f = saved / "epoch=0-step=1.ckpt"
    f.write_bytes(b"x")
    mc.best_k_models = {str(f): 0.7}
    mc.best_model_path = str(f)
    mc.last_model_path = str(tmp_path / "not-written-yet.ckpt")
    del calls[:]
    trainer.global_step, trainer.fit_loop.epoch_loop._batches_that_stepped = 2, 1
    cb.on_train_epoch_start(trainer, None)
    cb.on_train_batch_end(trainer, None, None, None, 0)
    cb.on_train_end(trainer, None)
    assert [c for c in calls if c[0] == "ckpt"] == [("ckpt", str(f), 1, 0)]

    # without the loop's counter (older versions): one less than global_step
    del trainer.fit_loop
    assert callbacks._logger_step(trainer) == 1


def test_hf_registers_the_checkpoint_directory_once_saved(calls, tmp_path):
    cb = _bare(callbacks.GpuctlHFTrainerCallback)
    args = types.SimpleNamespace(output_dir=str(tmp_path / "out"))
    state = types.SimpleNamespace(global_step=20, epoch=1.0, is_world_process_zero=True)
    cb.on_save(args, state, None)
    assert calls == []                         # nothing written there: nothing registered
    d = tmp_path / "out" / "checkpoint-20"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"w")
    cb.on_save(args, state, None)
    assert calls == [("ckpt", str(d), 20, 1.0)]
    state.is_world_process_zero = False
    cb.on_save(args, state, None)
    assert len(calls) == 1
