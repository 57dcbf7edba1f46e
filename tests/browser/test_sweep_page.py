"""The sweep pages in a real Chromium: the list, one sweep's trials table and its
parameter-against-metric scatter, against a real server and agent."""
import sys

from conftest import SCREENSHOTS  # noqa: F401  (the screenshots folder the others use)
from procs import wait_for
from test_dashboard import shot

TRIAL = """\
import argparse, time
from gpuctl import run
ap = argparse.ArgumentParser()
ap.add_argument("--x", type=float)
ap.add_argument("--opt")
a = ap.parse_args()
for step in range(1, 21):
    run.log({"val/loss": (a.x - 0.3) ** 2 + (0.1 if a.opt == "sgd" else 0) + 1 / step}, step=step)
    time.sleep(0.01)
with open(f"ck-{a.x}-{a.opt}.pt", "w") as f:
    f.write("w")
run.log_checkpoint(f"ck-{a.x}-{a.opt}.pt", step=20)
"""


def test_sweep_list_trials_table_and_scatter(open_page, cluster):
    server, _agent, home = cluster
    wd = home / "sweep-work"
    wd.mkdir(exist_ok=True)
    (wd / "trial.py").write_text(TRIAL)
    api = server.api
    s = api.post("/api/v1/sweeps", {
        "name": "page <b>x</b>", "experiment": "sweep-page", "working_dir": str(wd),
        "cpu_only": True, "parallel": 2, "metric": "val/loss",
        "command": f"{sys.executable} trial.py --x {{x}} --opt {{opt}}",
        "parameters": {"x": [0.0, 0.3, 0.9], "opt": ["adam", "sgd"]}}, expect=201)
    wait_for(lambda: api.get(f"/api/v1/sweeps/{s['id']}")["state"] == "DONE", 120,
             what="the sweep to end")
    w = open_page(token=server.token)
    page = w.page
    page.goto(server.url + "/#/sweeps")
    row = page.wait_for_selector(f"#sweeps-body tr[data-sweep='{s['id']}']")
    assert "page <b>x</b>" in row.inner_text() and "6 succeeded" in row.inner_text()
    assert "6 / 6 ended" in row.inner_text() and "trial 2" in row.inner_text()
    assert "x=0.3 opt=adam" in row.inner_text()
    shot(page, "sweeps")
    page.click(f"#sweeps-body tr[data-sweep='{s['id']}'] a")
    page.wait_for_selector("#trials-body tr[data-trial='5']")
    assert page.locator("#trials-body tr").count() == 6
    assert page.inner_text("#best").startswith("best: trial 2")     # DONE: not "so far"
    assert "6 succeeded" in page.inner_text("#trial-counts")
    assert "succeeded" in page.inner_text("#scatter-legend")
    assert "x=0.3 opt=adam" in page.inner_text("#best")
    assert page.locator("#trials-body tr.leader[data-trial='2']").count() == 1
    page.wait_for_selector("#recommended a")
    assert "ck-0.3-adam.pt" in page.inner_text("#recommended")
    # one dot per trial; the best (x=0.3) lowest on the plot (smaller loss is lower)
    pts = page.evaluate("() => window.gpuplane.sweep.points")
    assert len(pts) == 6
    best = next(p for p in pts if p["trial"] == 2)
    assert best["cy"] == max(p["cy"] for p in pts)
    assert page.evaluate("""() => { const c = document.getElementById('scatter');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; }""") > 200
    # a categorical parameter on the x axis
    page.select_option("#scatter-param", "opt")
    assert {p["x"] for p in page.evaluate("() => window.gpuplane.sweep.points")} == \
        {"adam", "sgd"}
    shot(page, "sweep")
    w.assert_clean()


DIVERGE = """\
import time
from gpuctl import run
for step in range(1, 3001):
    run.log({"loss": 1.0 / step if step < 40 else 10.0 * step}, step=step)
    time.sleep(0.02)
"""


def test_a_job_stopped_on_an_event_is_shown_as_stopped_not_cancelled(open_page, cluster):
    server, _agent, home = cluster
    wd = home / "stop-work"
    wd.mkdir(exist_ok=True)
    (wd / "diverge.py").write_text(DIVERGE)
    api = server.api
    job = api.post("/api/v1/jobs", {"command": [sys.executable, "diverge.py"],
                                    "working_dir": str(wd), "cpu_only": True,
                                    "stop_on": ["LOSS_DIVERGED"]}, expect=201)
    done = wait_for(lambda: (j := api.job(job["id"]))["state"] == "CANCELLED" and j, 60,
                    what="the job to stop on its divergence")
    assert done["failure_kind"] == "STOPPED_ON_EVENT"
    w = open_page(token=server.token)
    page = w.page
    page.goto(server.url + "/#/jobs")
    row = page.wait_for_selector(f"tr[data-job='{job['id']}']")
    assert "STOPPED ON EVENT" in row.inner_text() and "CANCELLED" not in row.inner_text()
    page.goto(server.url + f"/#/jobs/{job['id']}")
    page.wait_for_selector("#job-name")
    text = page.inner_text("main")
    assert "stopped on LOSS_DIVERGED" in text and "STOPPED ON EVENT" in text
    page.goto(server.url + f"/#/runs/{done['run_id']}")
    page.wait_for_selector(".badge.s-stopped")
    assert "stopped on LOSS_DIVERGED" in page.inner_text("main")
    w.assert_clean()


def test_first_hour_pages_say_what_they_show(open_page, cluster):
    """The experiments page opens on the newest run's experiment; a job that never started
    says why where its log would be; the run page's checkpoints show the ids that its
    recommendation names."""
    server, _agent, home = cluster
    api = server.api
    wd = home / "first-hour"
    wd.mkdir(exist_ok=True)
    (wd / "ck.py").write_text(
        "from gpuctl import run\n"
        "for s in (1, 2):\n"
        "    run.log({'val/loss': 1.0 / s}, step=s)\n"
        "    open(f'c{s}.pt', 'w').write('w')\n"
        "    run.log_checkpoint(f'c{s}.pt', step=s)\n")
    good = api.post("/api/v1/jobs", {"command": [sys.executable, "ck.py"], "cpu_only": True,
                                     "working_dir": str(wd), "project": "fh",
                                     "experiment": "newest"}, expect=201)
    bad = api.post("/api/v1/jobs", {"command": ["true"], "cpu_only": True,
                                    "working_dir": str(wd / "missing")}, expect=201)
    for j in (good, bad):
        wait_for(lambda j=j: api.job(j["id"])["state"] in ("SUCCEEDED", "FAILED"), 60,
                 what=f"job {j['id']} to end")
    w = open_page(token=server.token)
    page = w.page
    page.goto(server.url + "/#/experiments")
    page.wait_for_selector("#x-group")
    assert page.eval_on_selector("#x-group", "e => e.value") == "fh\u0000newest"
    page.goto(server.url + f"/#/jobs/{bad['id']}")
    page.wait_for_selector("#log-empty")
    assert "working dir does not exist" in page.inner_text("#log-empty")
    run_id = api.job(good["id"])["run_id"]
    page.goto(server.url + f"/#/runs/{run_id}")
    rec = page.wait_for_selector("#recommendation")
    named = rec.get_attribute("data-checkpoint")
    row = page.wait_for_selector(f"#checkpoint-table tr[data-checkpoint='{named}']")
    assert f"#{named}" in row.inner_text()
    w.assert_clean()


def test_the_overview_shows_which_gpus_are_held_for_which_job(open_page, cluster):
    """Backfill's reservation on the overview: a free GPU held for the queue's head says
    "held for #ID · HH:MM" (its reserved start); /status lists it."""
    server, _agent, home = cluster
    api = server.api
    wd = home / "held"
    wd.mkdir(exist_ok=True)
    busy = api.post("/api/v1/jobs", {"name": "busy", "gpus": 1, "time_limit": "1h",
                                     "command": [sys.executable, "-c",
                                                 "import time; time.sleep(120)"],
                                     "working_dir": str(wd)}, expect=201)
    wait_for(lambda: api.job(busy["id"])["state"] == "RUNNING", 30, what="busy to run")
    head = api.post("/api/v1/jobs", {"name": "needs-two", "gpus": 2, "command": ["true"],
                                     "working_dir": str(wd)}, expect=201)
    held = wait_for(lambda: (r := api.get("/api/v1/status")["reservations"]) and r[0], 30,
                    what="the reservation in /status")
    assert held["job_id"] == head["id"] and held["start"]
    w = open_page(token=server.token)
    page = w.page
    page.goto(server.url + "/#/")
    cell = page.wait_for_selector(".held")
    assert f"held for #{head['id']}" in cell.inner_text()
    assert "reserved for job" in cell.get_attribute("title")
    shot(page, "overview-reservation")
    api.post(f"/api/v1/jobs/{head['id']}/cancel")
    api.post(f"/api/v1/jobs/{busy['id']}/cancel")
    w.assert_clean()
