"""A real server, a real agent with fake GPUs and Debian's Chromium driven by playwright.

Skips, saying why, when chromium or the playwright package are missing (`.ci/run`
installs both). One server and agent serve the whole module; each test gets a fresh
browser context (its own storage, so its own login).
"""
import os
import pathlib
import shutil
import tempfile

import pytest

try:
    from playwright.sync_api import sync_playwright
except ImportError:        # pragma: no cover - depends on the machine
    sync_playwright = None

from procs import AgentProc, ServerProc

CHROMIUM = os.environ.get("GPUPLANE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Screenshots of every page go to a temporary folder; to refresh the ones the README shows:
#   GPUPLANE_SCREENSHOTS=docs/screenshots .venv/bin/python -m pytest tests/browser
SCREENSHOTS = pathlib.Path(os.environ.get("GPUPLANE_SCREENSHOTS")
                           or pathlib.Path(tempfile.gettempdir()) / "gpuplane-screenshots")

if sync_playwright is None:
    pytest.skip("the playwright package is missing: pip install -e '.[test]'",
                allow_module_level=True)
if not pathlib.Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install -y chromium",
                allow_module_level=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("browser")
    server = ServerProc(home / "server").start()
    agent = AgentProc(server, home / "agent", "gpu-box", fake_gpus=2).start()
    yield server, agent, home
    agent.stop()
    server.stop()
    from procs import kill_leftover_jobs
    kill_leftover_jobs(agent.home)


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


class Watched:
    """A page whose console errors, uncaught errors, dialogs and foreign requests are kept."""

    def __init__(self, page, origin):
        self.page = page
        self.errors, self.dialogs, self.foreign = [], [], []
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        page.on("dialog", self._dialog)
        page.on("request", lambda r: r.url.startswith(("http:", "https:", "ws:", "wss:"))
                and not r.url.startswith(origin) and self.foreign.append(r.url))

    def _dialog(self, d):
        self.dialogs.append(d.message)
        d.dismiss()

    def assert_clean(self):
        assert not self.dialogs, f"a dialog opened: {self.dialogs}"
        assert not self.errors, f"console errors: {self.errors}"
        assert not self.foreign, f"requests to another origin: {self.foreign}"


@pytest.fixture
def open_page(browser, cluster):
    server = cluster[0]
    made = []

    def make(token=None, width=1280, height=900, scheme="light"):
        ctx = browser.new_context(viewport={"width": width, "height": height},
                                  color_scheme=scheme)
        page = ctx.new_page()
        page.set_default_timeout(40_000)   # a loaded 2-core CI machine
        w = Watched(page, server.url)
        made.append(ctx)
        if token:
            page.goto(f"{server.url}/#token={token}")
            page.wait_for_selector("#who .who-name")
        return w
    yield make
    for ctx in made:
        ctx.close()
