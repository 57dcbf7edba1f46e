"""Tests on a real NVIDIA GPU (issue 22). Skipped, with the reason, where NVML finds no
GPU; the CUDA ones also need a CUDA build of torch in the interpreter that runs jobs
(`.venv/bin/pip install torch` with CUDA on the GPU host). Run them on a GPU host:

    .venv/bin/python -m pytest tests/gpu -q -s

They use a real agent without --fake-gpus: its readings come from NVML, and its jobs get
CUDA_VISIBLE_DEVICES for the card they hold.
"""
import shutil
import subprocess
import sys

import pytest


def _nvml_gpus():
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount(), None
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:     # no library, no driver, no device
        return 0, f"{type(e).__name__}: {e}"


_COUNT, _WHY = _nvml_gpus()


def pytest_collection_modifyitems(config, items):
    here = [i for i in items if "tests/gpu/" in str(i.fspath).replace("\\", "/")]
    if _COUNT:
        return
    skip = pytest.mark.skip(reason=f"NVML finds no GPU on this host ({_WHY or '0 devices'}); "
                                   "tests/gpu runs on a GPU host")
    for item in here:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def nvidia_smi():
    exe = shutil.which("nvidia-smi")
    if exe is None:
        pytest.skip("nvidia-smi is not on PATH")
    return exe


@pytest.fixture(scope="session")
def cuda_python():
    """The interpreter jobs run with, when its torch can use CUDA."""
    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode or r.stdout.strip() != "True":
        pytest.skip("torch with CUDA is not installed in this interpreter "
                    f"({(r.stderr or r.stdout).strip()[-200:]}); the CUDA job tests need it")
    return sys.executable
