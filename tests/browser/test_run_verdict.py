"""Issue 25 item 5, in a real Chromium: the run page shows the run's verdict beside its
curves in diagnose_run's words (and `run show` says the same), keys read as the server's
vocabulary says (goal unknown, system), and a system chart with one point, or none that
is finite, is drawn sanely."""
import re
import time

import pytest

from conftest import SCREENSHOTS
from gpuplane import cli, client
from procs import ServerProc, wait_for


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A server alone: these pages need no agent (overrides conftest's)."""
    home = tmp_path_factory.mktemp("verdict")
    server = ServerProc(home / "server").start()
    yield server, None, home
    server.stop()


def chart_state(page, key):
    return page.evaluate("""(key) => {
      const c = window.gpuplane.charts[key];
      if (!c || !c.raw) return null;
      if (!c.u) return {empty: c.plotEl.textContent};
      const u = c.u, x = c.data()[0][0], y = c.data()[3][0];
      const px = Math.round(u.valToPos(x, "x", true)), py = Math.round(u.valToPos(y, "y", true));
      const rgba = Array.from(u.ctx.getImageData(px - 1, py - 1, 3, 3).data);
      return {xmin: u.scales.x.min, xmax: u.scales.x.max,
              inked: rgba.some((v, i) => i % 4 === 3 && v > 0)};
    }""", key)


def test_run_page_verdict_matches_diagnose_and_run_show_and_sparse_system_charts(
        open_page, cluster, capsys, monkeypatch):
    server = cluster[0]
    c = client.Client(server.url, server.token)
    run = c.create_run(project="verdict")["id"]
    now = int(time.time() * 1000)
    keys = ["train/loss", "compare/a", "sys/cpu_percent", "sys/rss_mb"]
    pts = [[0, s, 0.7 + 0.01 * s * s, now] for s in range(120)]      # rises from its start
    pts += [[1, s, float(s), now] for s in range(50)]                 # says nothing of its goal
    pts += [[2, now // 1000, 12.5, now], [3, now // 1000, "NaN", now]]
    c.log_run_metrics(run, keys, pts)
    # the rules engine judges the points on its own thread, and its event is evidence:
    # the diagnosis to compare with is the one after it
    wait_for(lambda: c.list_events(run=run, type="LOSS_DIVERGED")["events"], 30,
             what="the LOSS_DIVERGED event")
    d = c.get_run_diagnosis(run)
    summary = {k["key"]: k for k in c.list_run_metrics(run)}

    w = open_page(token=server.token, height=1400)
    page = w.page
    page.goto(f"{server.url}/#/runs/{run}")
    page.wait_for_selector("#verdict [data-verdict]")
    # the verdict in diagnose_run's own words, beside the curves
    box = page.locator("#verdict [data-verdict]")
    assert box.get_attribute("data-verdict") == d["verdict"]
    assert page.inner_text("#verdict .verdict-word") == d["verdict"].upper()
    assert page.inner_text("#verdict .verdict-summary") == d["summary"]
    assert page.locator("#verdict .evidence li").all_inner_texts() == d["evidence"]
    assert page.inner_text("#verdict .verdict-advice") == f"advice: {d['advice']}"
    c = d["confidence"]
    assert page.inner_text("#verdict .verdict-confidence") == \
        f"confidence: {c['level']}" + (f" — {c['why']}" if c["why"] else "")
    # the keys table: the server's goal and trend, none decided in the page
    rows = {r.locator("td").first.locator("a").inner_text(): r
            for r in page.locator("#keys tbody tr").all()}
    assert set(rows) == {"train/loss", "compare/a"}              # system keys are charts only
    assert rows["compare/a"].locator(".goal").inner_text().strip() == "goal unknown"
    assert rows["compare/a"].locator(".trend").inner_text() == ""
    assert rows["train/loss"].locator(".trend").inner_text() == summary["train/loss"]["trend"]

    # `run show` prints the same verdict and trend
    monkeypatch.setenv("GPUCTL_TOKEN", server.token)
    assert cli.main(["--server", server.url, "run", "show", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"verdict: {d['verdict'].upper()} — {d['summary']}\n  advice: {d['advice']}\n" in out
    line = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()}
    assert re.search(rf"\smin\s+{summary['train/loss']['trend']}\s", line["train/loss"])
    assert re.search(r"\sunknown\s+-\s", line["compare/a"]), line["compare/a"]

    # system charts: one point is a dot on a minute of clock, a NaN-only one says so
    page.locator("#sys-charts").scroll_into_view_if_needed()
    wait_for(lambda: chart_state(page, "sys/cpu_percent") and chart_state(page, "sys/rss_mb"),
             30, what="the system charts to load")
    one = chart_state(page, "sys/cpu_percent")
    assert one["xmax"] - one["xmin"] <= 120, one        # was a three-year axis
    assert one["inked"], one            # a dot where the point is (was no visible mark)
    nan = chart_state(page, "sys/rss_mb")
    assert re.search(r"no finite value to draw", nan["empty"]), nan
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "run-verdict.png"), full_page=True)
    w.assert_clean()
