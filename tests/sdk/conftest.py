"""Fixtures for the SDK tests; the recording HTTP server lives in sdkutil.py."""
import os

import pytest

from sdkutil import IngestServer


@pytest.fixture
def server():
    s = IngestServer()
    yield s
    s.close()


@pytest.fixture
def sdk(tmp_path, monkeypatch):
    """The gpuctl.run module with a fresh run, its own GPUCTL_HOME, no GPUCTL_* from the
    environment, and short retry delays so failures heal within a test."""
    from gpuctl import run, sender

    for k in list(os.environ):
        if k.startswith("GPUCTL_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("GPUCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sender, "RETRY_MIN_S", 0.05)
    monkeypatch.setattr(sender, "RETRY_MAX_S", 0.2)
    monkeypatch.setattr(sender, "INTERVAL_S", 0.05)
    monkeypatch.setattr(sender, "TIMEOUT", (1.0, 1.0))
    monkeypatch.setattr(sender, "FOREIGN_SCAN_S", 0.2)
    run._run = run._Run()
    yield run
    r = run._run
    if r.sender is not None and r.sender.is_alive():
        r.sender.stop(join_s=5)
    run._run = run._Run()
