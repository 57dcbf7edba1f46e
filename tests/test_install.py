"""Installs and deploy files a careful user relies on: the offline wheel kit and the systemd
units. Both run the real tools (pip, systemd-analyze)."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import requests

from procs import ROOT, free_port, wait_for


def _pip_env():
    # The machine's pip settings (find-links, extra indexes) must not help the install:
    # only the kit may.
    return {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "GPUCTL_"))}


def test_offline_install_from_the_wheel_kit_starts_a_server(tmp_path):
    kit = tmp_path / "wheels"
    subprocess.run(["make", "-s", "wheels", f"WHEELS={kit}", f"VENV={pathlib.Path(sys.prefix)}"],
                   cwd=ROOT, check=True, capture_output=True, timeout=600)
    assert any(p.name.startswith("gpuplane-") for p in kit.iterdir())
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run([str(venv / "bin" / "pip"), "install", "--isolated", "--no-index",
                    "--find-links", str(kit), "gpuplane"],
                   check=True, capture_output=True, timeout=600, env=_pip_env(), cwd=tmp_path)
    home, port = tmp_path / "home", free_port()
    env = {**_pip_env(), "GPUCTL_HOME": str(home)}
    proc = subprocess.Popen([str(venv / "bin" / "gpuplane"), "server", "--port", str(port)],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: requests.get(f"http://127.0.0.1:{port}/api/v1/health", timeout=2).ok,
                 60, what="the server installed from the kit")
        # It runs the installed code, not this checkout's.
        out = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import gpuplane, gpuctl; print(gpuplane.__file__)"],
                             capture_output=True, text=True, check=True, cwd=tmp_path).stdout
        assert str(venv) in out
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed on this machine")
@pytest.mark.parametrize("unit", sorted(p.name for p in (ROOT / "deploy").glob("*.service")))
def test_systemd_units_verify(unit, tmp_path):
    # The units point at the venv of docs/deploy.md; here it is the test's own venv.
    text = (ROOT / "deploy" / unit).read_text()
    assert "%h/.local/share/gpuplane/venv/bin/" in text
    text = text.replace("%h/.local/share/gpuplane/venv/bin/", str(pathlib.Path(sys.executable).parent) + "/")
    (tmp_path / unit).write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / unit)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr


def test_man_pages_are_current(tmp_path):
    """man/*.1 are made from the parsers by `make man`; a changed option needs them again."""
    subprocess.run(["make", "-s", "man", f"MANDIR={tmp_path}", f"VENV={sys.prefix}"],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    made = sorted(p.name for p in tmp_path.glob("*.1"))
    assert made == ["gpuplane-agent.1", "gpuplane-mcp.1", "gpuplane.1"]

    def body(path):   # the first line carries the build date
        return path.read_text().split("\n", 1)[1]
    stale = [name for name in made if body(tmp_path / name) != body(ROOT / "man" / name)]
    assert not stale, f"man pages out of date: {stale}; run `make man` and commit them"
