"""The callbacks inside the real frameworks: a tiny model built from a config (no
downloads), a few steps on CPU, and the points must reach the server.

An optional group (``-m frameworks``): it needs torch plus lightning / transformers, which
are not project dependencies. Each test is skipped, saying why, where they are missing.
Run it in a venv that has them, e.g.:

    .bench/fw-venv/bin/python -m pytest tests/sdk/test_callbacks_frameworks.py
"""

import pytest

from sdkutil import TOKEN

pytestmark = pytest.mark.frameworks


def test_lightning_callback_reports_train_and_validation_metrics(sdk, server, tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed")
    from gpuctl.callbacks import GpuctlLightningCallback

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train/loss", loss)
            return loss

        def validation_step(self, batch, _):
            x, y = batch
            self.log("val/loss", torch.nn.functional.mse_loss(self.layer(x), y), on_epoch=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    sdk.init(server=server.url, token=TOKEN)
    cb = GpuctlLightningCallback(every_n_train_steps=2)
    assert isinstance(cb, L.Callback) and isinstance(cb, GpuctlLightningCallback)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[cb])
    trainer.fit(Tiny(), loader, loader)
    assert sdk.flush(10)
    got = server.identities(101)
    # at the steps Lightning's own loggers write (global_step - 1: _batches_that_stepped
    # is counted up after the metrics are logged and after validation)
    assert {s for k, s in got if k == "train/loss"} == {1, 3, 5, 7}
    assert {s for k, s in got if k == "val/loss"} == {7}


def test_hf_trainer_callback_reports_logs(sdk, server, tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="accelerate (needed by transformers.Trainer) "
                                             "is not installed")
    from gpuctl.callbacks import GpuctlHFTrainerCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50,
                                     n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 50, (16, 8))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, logging_steps=1, per_device_train_batch_size=4,
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)
    sdk.init(server=server.url, token=TOKEN)
    cb = GpuctlHFTrainerCallback()
    assert isinstance(cb, transformers.TrainerCallback)
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    assert sdk.flush(10)
    got = server.identities(101)
    assert {s for k, s in got if k == "loss"} == {1, 2, 3, 4}
    assert {s for k, s in got if k == "learning_rate"} == {1, 2, 3, 4}


def _tb_steps(logdir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    steps = set()
    import pathlib
    for f in pathlib.Path(logdir).rglob("*tfevents*"):
        acc = EventAccumulator(str(f))
        acc.Reload()
        if tag in acc.Tags().get("scalars", []):
            steps |= {e.step for e in acc.Scalars(tag)}
    return steps


def test_lightning_callback_matches_tensorboard_steps_and_registers_checkpoints(
        sdk, server, tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed")
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger
    from gpuctl.callbacks import GpuctlLightningCallback

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train/loss", loss)
            return loss

        def validation_step(self, batch, _):
            x, y = batch
            self.log("val/loss", torch.nn.functional.mse_loss(self.layer(x), y), on_epoch=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    sdk.init(server=server.url, token=TOKEN)
    ckpt_dir = tmp_path / "ckpts"
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", log_every_n_steps=1,
                        logger=TensorBoardLogger(str(tmp_path / "tb")),
                        callbacks=[GpuctlLightningCallback(every_n_train_steps=1),
                                   ModelCheckpoint(dirpath=str(ckpt_dir), save_top_k=-1)],
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    trainer.fit(Tiny(), loader, loader)
    assert sdk.flush(10)
    got = server.identities(101)
    # one curve, not two a step apart: the SDK's steps are the TensorBoard file's
    assert {s for k, s in got if k == "train/loss"} == _tb_steps(tmp_path / "tb", "train/loss")
    assert {s for k, s in got if k == "val/loss"} == _tb_steps(tmp_path / "tb", "val/loss")
    # the files ModelCheckpoint wrote, each registered once, at the step in its name
    written = sorted(p.name for p in ckpt_dir.iterdir())
    assert written == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt"]
    posted = [(b["path"], b["step"], b["epoch"]) for _, b in server.posts("/checkpoints")]
    assert posted == [(str(ckpt_dir / "epoch=0-step=8.ckpt"), 8, 0.0),
                      (str(ckpt_dir / "epoch=1-step=16.ckpt"), 16, 1.0)]


def test_hf_trainer_callback_registers_its_checkpoint_directories(sdk, server, tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="accelerate (needed by transformers.Trainer) "
                                             "is not installed")
    from gpuctl.callbacks import GpuctlHFTrainerCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50,
                                     n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 50, (16, 8))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, logging_steps=1, per_device_train_batch_size=4,
        report_to="none", save_strategy="steps", save_steps=2, use_cpu=True,
        disable_tqdm=True)
    sdk.init(server=server.url, token=TOKEN)
    transformers.Trainer(model=model, args=args, train_dataset=data,
                         callbacks=[GpuctlHFTrainerCallback()]).train()
    assert sdk.flush(10)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2",
                                                                     "checkpoint-4"]
    posted = [(b["path"], b["step"]) for _, b in server.posts("/checkpoints")]
    assert posted == [(str(tmp_path / "checkpoint-2"), 2), (str(tmp_path / "checkpoint-4"), 4)]
    assert all(b["size_bytes"] > 0 for _, b in server.posts("/checkpoints"))
