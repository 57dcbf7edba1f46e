"""Thin callbacks for PyTorch Lightning and the Hugging Face Trainer.

Importing this module imports no framework. Each callback class is built on first
instantiation as a subclass of the framework's real base class (so the framework's own
``isinstance`` checks pass); without the framework, instantiating raises ImportError
naming the package to install.
"""

import os
import re

from . import run

_built: dict = {}


def _scalars(items):
    """The float-convertible scalars of a mapping: numbers, numpy scalars, one-element
    tensors. Everything else is left out."""
    out = {}
    for k, v in items:
        if isinstance(v, (bool, str, bytes)) or v is None:
            continue
        try:
            if hasattr(v, "numel") and v.numel() != 1:
                continue
            out[str(k)] = float(v.item() if hasattr(v, "item") else v)
        except Exception:
            continue
    return out


def _lightning_base():
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback
        except ImportError:
            raise ImportError("GpuctlLightningCallback needs PyTorch Lightning: "
                              "pip install lightning") from None
    return Callback


def _hf_base():
    try:
        from transformers import TrainerCallback
    except ImportError:
        raise ImportError("GpuctlHFTrainerCallback needs Hugging Face transformers: "
                          "pip install transformers") from None
    return TrainerCallback


_EVAL_PREFIXES = ("val", "eval", "test")


def _logger_step(trainer):
    """The step Lightning's own loggers (TensorBoard, CSV) write at this moment: the count
    of optimizer steps before the current one's increment (`_batches_that_stepped`),
    which is `global_step - 1` in on_train_batch_end and after validation. Logging at it
    keeps the SDK's curve on the same steps as the TensorBoard file's."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    return max(int(trainer.global_step) - 1, 0)


def _name_number(pattern, name):
    m = re.search(pattern, name)
    return int(m.group(1)) if m else None


class GpuctlLightningCallback:
    """Report Lightning metrics and checkpoints to GPUPlane.

    Every ``every_n_train_steps`` optimizer steps, the scalars of
    ``trainer.callback_metrics`` (what your module passed to ``self.log``) except those
    named ``val*``/``eval*``/``test*`` are logged. After every validation run (not the
    sanity check) all scalars are logged, so validation metrics logged with
    ``on_epoch=True`` arrive with their epoch value. Values are logged at the step
    Lightning's own loggers use (one less than ``trainer.global_step`` there), so a
    TensorBoard file of the same run shows the same steps. The files the trainer's
    ``ModelCheckpoint`` callbacks save (``epoch=3-step=1200.ckpt``, ``last.ckpt``) are
    registered with ``run.log_checkpoint`` once they exist, at the step in their name.
    Only rank 0 reports.

    Uses ``lightning.pytorch`` when installed, else ``pytorch_lightning``.
    """

    def __new__(cls, *args, **kwargs):
        if cls is GpuctlLightningCallback:
            impl = _built.get("lightning")
            if impl is None:
                base = _lightning_base()
                impl = _built["lightning"] = type(
                    "GpuctlLightningCallback", (GpuctlLightningCallback, base),
                    {"__doc__": GpuctlLightningCallback.__doc__})
            return impl(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, every_n_train_steps=50):
        self.every_n_train_steps = max(1, int(every_n_train_steps))
        self._last_step = None
        self._saved = {}         # checkpoint path -> mtime registered

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # a ModelCheckpoint runs after this callback in the hook that saves: what it
        # saved last time is found here, or at the end of training
        self._register_saved(trainer)
        step = trainer.global_step
        # with gradient accumulation several batches share one global step: report once
        if step == self._last_step or step % self.every_n_train_steps:
            return
        self._last_step = step
        if getattr(trainer, "is_global_zero", True):
            m = _scalars((k, v) for k, v in trainer.callback_metrics.items()
                         if not str(k).startswith(_EVAL_PREFIXES))
            run.log(m, step=_logger_step(trainer))

    def on_validation_end(self, trainer, pl_module):
        if getattr(trainer, "sanity_checking", False) or not getattr(trainer, "is_global_zero",
                                                                      True):
            return
        run.log(_scalars(trainer.callback_metrics.items()), step=_logger_step(trainer))

    def on_train_epoch_start(self, trainer, pl_module):
        self._register_saved(trainer)

    def on_train_end(self, trainer, pl_module):
        self._register_saved(trainer)

    def _register_saved(self, trainer):
        if not getattr(trainer, "is_global_zero", True):
            return
        try:
            for cb in getattr(trainer, "checkpoint_callbacks", None) or []:
                paths = list(getattr(cb, "best_k_models", None) or {})
                paths += [getattr(cb, "last_model_path", ""), getattr(cb, "best_model_path", "")]
                for path in paths:
                    if not path or not isinstance(path, str):
                        continue
                    try:
                        mtime = os.stat(path).st_mtime_ns
                    except OSError:
                        continue      # not written yet, or removed (save_top_k)
                    if self._saved.get(path) == mtime:
                        continue
                    self._saved[path] = mtime
                    name = os.path.basename(path)
                    step = _name_number(r"step=(\d+)", name)
                    epoch = _name_number(r"epoch=(\d+)", name)
                    run.log_checkpoint(
                        path, step=trainer.global_step if step is None else step,
                        epoch=trainer.current_epoch if epoch is None else epoch)
        except Exception:
            pass          # never into the training loop


class GpuctlHFTrainerCallback:
    """Report Hugging Face ``Trainer`` logs and checkpoints to GPUPlane: on every
    ``on_log`` the float-convertible scalars of ``logs`` (loss, learning_rate, eval_*,
    epoch, ...) are logged at ``state.global_step``; on every ``on_save`` the
    ``checkpoint-<step>/`` directory the trainer just wrote is registered as one
    checkpoint at that step. Only the main process reports."""

    def __new__(cls, *args, **kwargs):
        if cls is GpuctlHFTrainerCallback:
            impl = _built.get("hf")
            if impl is None:
                base = _hf_base()
                impl = _built["hf"] = type("GpuctlHFTrainerCallback",
                                           (GpuctlHFTrainerCallback, base),
                                           {"__doc__": GpuctlHFTrainerCallback.__doc__})
            return impl(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self):
        pass

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and getattr(state, "is_world_process_zero", True):
            run.log(_scalars(logs.items()), step=state.global_step)

    def on_save(self, args, state, control, **kwargs):
        if not getattr(state, "is_world_process_zero", True):
            return
        try:
            # transformers' PREFIX_CHECKPOINT_DIR; the Trainer calls on_save once written
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if os.path.isdir(path):
                run.log_checkpoint(path, step=state.global_step, epoch=state.epoch)
        except Exception:
            pass
