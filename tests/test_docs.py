"""Every shell example in README.md and docs/*.md runs, as written.

The fenced ```sh blocks are taken from the files. A comment line just before a block
says how it is run:

  (none)                          run on its own against a real `gpuplane up` (module-wide)
  <!-- docs-test: setup -->       run, and run again before every later block of the file
                                  (it sets variables the file's examples use, as a reader
                                  who follows the page has them set)
  <!-- docs-test: tour -->        README's tour: one shell session, top to bottom
  <!-- docs-test: tour-background -->  the tour's `make up`, left running meanwhile
  <!-- docs-test: skip (WHY) -->  not run; WHY says why it cannot be, and must be given

Every block runs with `bash -e -o pipefail` in the repository root, with the project's
interpreter first on PATH (as after `source .venv/bin/activate`), HOME in a temporary
directory (so `~/.gpuctl` is fresh) and GPUCTL_SERVER naming the server, whose port is
free, not 8600 — except the README's tour, which runs without GPUCTL_SERVER, as a reader
whose port was taken would (see test_readme_tour).
"""
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from procs import ROOT, free_port, sigint_as_at_a_terminal, wait_for

DOC_FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
MARK = re.compile(r"^<!--\s*docs-test:\s*(?P<kind>[a-z-]+)\s*(?:\((?P<why>.*)\))?\s*-->\s*$")
KINDS = {"setup", "tour", "tour-background", "skip"}
BLOCK_TIMEOUT_S = 120


class Block:
    def __init__(self, path, line, kind, why, body):
        self.path, self.line, self.kind, self.why, self.body = path, line, kind, why, body

    @property
    def name(self):
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path):
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```sh":
            start = i
            j = i - 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            m = MARK.match(lines[j].strip()) if j >= 0 else None
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            out.append(Block(path, start + 1, m["kind"] if m else None,
                             (m["why"] or "").strip() if m else None, "\n".join(body) + "\n"))
        i += 1
    return out


ALL = [b for path in DOC_FILES for b in blocks(path)]
README_TEXT = (ROOT / "README.md").read_text()


def test_every_shell_block_is_run_or_says_why_not():
    assert ALL, "no ```sh blocks found"
    bad = []
    for b in ALL:
        if b.kind is not None and b.kind not in KINDS:
            bad.append(f"{b.name}: unknown docs-test mark {b.kind!r}; use one of {sorted(KINDS)}")
        if b.kind == "skip" and len(b.why or "") < 10:
            bad.append(f"{b.name}: `docs-test: skip` needs the reason: skip (why it cannot run)")
        if b.kind in ("tour", "tour-background") and b.path.name != "README.md":
            bad.append(f"{b.name}: tour marks belong to the README's tour")
    assert not bad, "\n".join(bad)


# -- the environment the blocks run in -----------------------------------------------------


def _env(user_home, url=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
    env["HOME"] = str(user_home)
    env["PATH"] = os.pathsep.join([str(pathlib.Path(sys.executable).parent), env["PATH"]])
    env["VIRTUAL_ENV"] = sys.prefix
    env["PYTHONUNBUFFERED"] = "1"
    if url:
        env["GPUCTL_SERVER"] = url
    return env


def _prepare_home(tmp):
    """A user home whose ~/.gpuctl/server.toml names a free port (8600 may be taken)."""
    user_home = tmp / "user"
    gpuctl = user_home / ".gpuctl"
    gpuctl.mkdir(parents=True)
    port = free_port()
    (gpuctl / "server.toml").write_text(f"port = {port}\n")
    return user_home, f"http://127.0.0.1:{port}"


class Up:
    """`gpuplane up` (or the README's `make up`) in the background until stopped."""

    def __init__(self, argv, env, log):
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=sigint_as_at_a_terminal)

    def wait_ready(self):
        wait_for(lambda: self.proc.poll() is not None or "Press Ctrl-C" in self.text(), 120,
                 interval=0.1, what="`gpuplane up` to be ready")
        assert self.proc.poll() is None, self.text()

    def text(self):
        return self.log.read_text(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _bash(script, env, timeout=BLOCK_TIMEOUT_S):
    # Its own process group, killed whole at the deadline: a block that never ends (a
    # stream, a follower) must fail the test, not hang it on a child holding the pipes.
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(killed: still running after {timeout}s; a block must end by itself)"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _report(name, proc):
    return (f"{name} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}"
            f"\n--- stderr ---\n{proc.stderr[-3000:]}")


# -- the README's tour --------------------------------------------------------------------


def _make_up_argv(port=None):
    # `make up` with this interpreter's environment as the Makefile's .venv, when it is
    # installed the way `make install` leaves it; else the same command, installed.
    stamp = pathlib.Path(sys.prefix) / ".installed"
    if shutil.which("make") and stamp.exists() and \
            stamp.stat().st_mtime >= (ROOT / "pyproject.toml").stat().st_mtime:
        return ["make", "-s", "up", f"VENV={sys.prefix}"] + ([f"PORT={port}"] if port else [])
    return [sys.executable, "-m", "gpuplane", "up", "--example"] + (
        ["--port", str(port)] if port else [])


def test_readme_tour(tmp_path):
    """README.md's tour, top to bottom, verbatim, with the port it names taken by another
    program: `make up` says so in a sentence and writes nothing; `make up PORT=N`, the one
    change the README documents, in one terminal; the rest, as pasted, in another, with no
    $GPUCTL_SERVER (the CLI finds the server `up` started). Slow-ish (the example job, the
    tour's job, two trainings and six evaluations: about a minute)."""
    readme = [b for b in ALL if b.path.name == "README.md"]
    background = [b for b in readme if b.kind == "tour-background"]
    tour = [b for b in readme if b.kind == "tour"]
    assert [b.body.split("#")[0].strip() for b in background] == ["make up"]
    assert tour, "README.md has no tour blocks"
    assert "make up PORT=" in README_TEXT
    user_home, _ = _prepare_home(tmp_path)
    toml = user_home / ".gpuctl" / "server.toml"
    taken = int(toml.read_text().split("=")[1])
    env = _env(user_home)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        refused = subprocess.run(_make_up_argv(), cwd=ROOT, env=env, capture_output=True,
                                 text=True, timeout=60)
    assert refused.returncode != 0
    assert f"port {taken} on 127.0.0.1 is in use by" in refused.stderr, refused.stderr
    assert "make up PORT=" in refused.stderr
    assert toml.read_text() == f"port = {taken}\n"         # nothing written
    up = Up(_make_up_argv(free_port()), env, tmp_path / "up.log")
    try:
        up.wait_ready()
        text = up.text()
        assert "SUCCEEDED" in text, text          # the example job
        if "no NVIDIA driver" in text or "NVML" in text:
            assert "pretends this host has 2 GPUs" in text and "--fake-gpus 0" in text
        proc = _bash("".join(b.body for b in tour), env, timeout=300)
        assert proc.returncode == 0, _report("the tour", proc)
    finally:
        up.stop()
    out = proc.stdout
    assert "epoch" in out and "SUCCEEDED" in out
    assert re.search(r"^run \d+ demo|^run \d+", out, re.M), out
    assert "event: end" in out or "data:" in out      # the SSE stream of the curl block
    # the checkpoint block: both trainings and every evaluation ended, then a recommendation
    assert re.search(r"^checkpoint \d+  run \d+  step \d+  eval/loss = ", out, re.M), out


# -- every other block --------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs")
    user_home, url = _prepare_home(tmp)
    env = _env(user_home, url)
    up = Up([sys.executable, "-m", "gpuplane", "up", "--example"], env, tmp / "up.log")
    try:
        up.wait_ready()
        yield env
    finally:
        up.stop()


RUNNABLE = [b for b in ALL if b.kind in (None, "setup")]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.name for b in RUNNABLE])
def test_doc_block_runs(block, stack):
    setup = [b.body for b in ALL if b.path == block.path and b.kind == "setup"
             and b.line < block.line]
    proc = _bash("".join(setup) + block.body, stack)
    assert proc.returncode == 0, _report(block.name, proc) + (
        "\nFix the example, or mark it `<!-- docs-test: skip (why) -->` if it cannot run "
        "in a test (see tests/test_docs.py)")
