"""Thin callbacks for PyTorch Lightning and the Hugging Face Trainer.

Importing this module imports no framework. Each callback class is built on first
instantiation as a subclass of the framework's real base class (so the framework's own
``isinstance`` checks pass); without the framework, instantiating raises ImportError
naming the package to install.
"""

from . import run

_built = {}


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


class GpuctlLightningCallback:
    """Report Lightning metrics to GPUPlane.

    Every ``every_n_train_steps`` optimizer steps, the scalars of
    ``trainer.callback_metrics`` (what your module passed to ``self.log``) except those
    named ``val*``/``eval*``/``test*`` are logged at ``trainer.global_step``. After every
    validation run (not the sanity check) all scalars are logged, so validation metrics
    logged with ``on_epoch=True`` arrive with their epoch value. Only rank 0 reports.

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

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        # with gradient accumulation several batches share one global step: report once
        if step == self._last_step or step % self.every_n_train_steps:
            return
        self._last_step = step
        if getattr(trainer, "is_global_zero", True):
            m = _scalars((k, v) for k, v in trainer.callback_metrics.items()
                         if not str(k).startswith(_EVAL_PREFIXES))
            run.log(m, step=step)

    def on_validation_end(self, trainer, pl_module):
        if getattr(trainer, "sanity_checking", False) or not getattr(trainer, "is_global_zero",
                                                                      True):
            return
        run.log(_scalars(trainer.callback_metrics.items()), step=trainer.global_step)


class GpuctlHFTrainerCallback:
    """Report Hugging Face ``Trainer`` logs to GPUPlane: on every ``on_log`` the
    float-convertible scalars of ``logs`` (loss, learning_rate, eval_*, epoch, ...) are
    logged at ``state.global_step``. Only the main process reports."""

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
