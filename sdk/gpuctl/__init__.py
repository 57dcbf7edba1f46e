"""gpuctl: the training-side SDK of GPUPlane. Needs only ``requests``.

    from gpuctl import run
    run.log({"train/loss": 0.42}, step=100)

See ``gpuctl.run`` for the API and ``gpuctl.callbacks`` for Lightning and Hugging Face.
"""

from . import run

__version__ = "0.1.0"
__all__ = ["run", "__version__"]
