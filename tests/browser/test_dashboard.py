"""The dashboard in a real Chromium against a real server and agent (fake GPUs).

Each test saves screenshots of the pages it visits into docs/screenshots/ (the README
shows them).
"""
import pathlib
import re

from conftest import SCREENSHOTS
from procs import wait_for

TRAIN = '''
import math, sys, time
from gpuctl import run
run.init()
print("<b>bold</b> <script>alert(1)</script> \\x1b[31mred\\x1b[0m \\x1b]0;title\\x07done", flush=True)
for i in range(1_000_000):
    run.log({"train/loss": 2 * math.exp(-i / 40) + 0.01 * (i % 7), "train/acc": 1 - math.exp(-i / 60)}, step=i)
    if i == 5:
        run.log_event("lr_drop", {"lr": 0.01}, step=i)
    print(f"step {i}", flush=True)
    time.sleep(0.05)
'''
HOSTILE = "<img src=x onerror=alert(1)>"


def shot(page, name):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.wait_for_timeout(300)     # let the last frame paint: a picture, not a check
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def chart_points(page, key):
    return page.evaluate("(k) => { const c = window.gpuplane.charts[k];"
                         " return c && c.u ? c.u.data[0].length : 0 }", key)


def workdir(home):
    wd = pathlib.Path(home) / "work"
    wd.mkdir(exist_ok=True)
    (wd / "train.py").write_text(TRAIN)
    return wd


def test_login_submit_watch_logs_and_curves_cancel_and_see_the_event(open_page, cluster):
    server, _agent, home = cluster
    wd = workdir(home)
    w = open_page()
    page = w.page
    page.goto(server.url + "/")
    page.wait_for_selector("#token")
    shot(page, "login")
    page.fill("#token", "not-a-token")
    page.click("#login")
    page.wait_for_selector("text=unknown or revoked")
    assert w.errors == ["Failed to load resource: the server responded with a status of 401 (UNAUTHORIZED)"]
    w.errors.clear()          # that 401 was the point
    page.fill("#token", server.token)
    page.click("#login")
    page.wait_for_selector("#who .who-name")
    assert "can write" in page.inner_text("#who")

    page.goto(server.url + "/#/jobs/new")
    page.fill("#name", "mnist-browser")
    page.fill("#command", "python -u train.py --note 'two words'")
    page.fill("#working_dir", str(wd))
    page.fill("#gpus", "1")
    page.fill("#project", "mnist")
    page.fill("#experiment", "browser")
    page.fill("#env", "LR=0.1")
    page.click("#submit")
    page.wait_for_url(re.compile(r".*#/jobs/\d+$"))
    job_id = int(page.url.rsplit("/", 1)[1])
    job = server.api.job(job_id)
    assert job["command"] == ["python", "-u", "train.py", "--note", "two words"]
    assert job["env"] == {"LR": "0.1"} and job["project"] == "mnist"

    # Log lines arrive live; HTML and terminal escapes are inert text.
    page.wait_for_selector("#log .line:has-text('step 3')")
    first = page.locator("#log .line .tx").first
    assert first.text_content() == "<b>bold</b> <script>alert(1)</script> red done"
    assert page.locator("#log b, #log script, #log img").count() == 0
    assert page.locator("#log .c-red").first.text_content() == "red"
    page.fill("#log-search", "step 2")
    page.wait_for_selector("#log-found:has-text('matching')")
    page.fill("#log-search", "")
    shot(page, "job")

    # Its run: the curves draw from the server's series (the chart holds the points).
    page.click("#open-run")
    page.wait_for_url(re.compile(r".*#/runs/\d+$"))
    page.wait_for_function("() => { const c = window.gpuplane.charts['train/loss'];"
                           " return c && c.u && c.u.data[0].length >= 10 }")
    data = page.evaluate("() => window.gpuplane.charts['train/loss'].u.data")
    steps, means = data[0], data[3]
    assert steps == sorted(steps) and steps[0] == 0
    assert abs(means[0] - 2.0) < 1e-9       # step 0: 2 * exp(0) + 0
    page.wait_for_selector("#run-events .event[data-type]:has-text('lr_drop')")
    page.check("#logscale")
    page.fill("#smoothing", "0.6")
    page.dispatch_event("#smoothing", "input")
    assert chart_points(page, "train/loss") >= 10
    shot(page, "run")

    # Zoom refetches the range at full resolution.
    page.evaluate("() => window.gpuplane.charts['train/loss'].zoomTo(2, 6)")
    zoomed = page.evaluate("() => window.gpuplane.charts['train/loss'].u.data[0]")
    assert zoomed == [2, 3, 4, 5, 6]

    # Cancel, with an in-page confirmation; then the event.
    page.goto(f"{server.url}/#/jobs/{job_id}")
    page.click("#cancel")
    page.wait_for_selector("#confirm[open]")
    page.click("#confirm-yes")
    server.api.wait_job(job_id, timeout=60)
    try:
        page.wait_for_selector(".page-head .badge:has-text('CANCELLED')")
    except Exception:
        raise AssertionError(f"job page: {page.inner_text('main')[:600]}; live: "
                             f"{page.evaluate('window.gpuplane.live.state')}; {w.errors}") from None
    page.goto(server.url + "/#/events")
    page.wait_for_selector(f"#events .event[data-type='CANCELLED']:has-text('job {job_id}')")
    shot(page, "events")
    w.assert_clean()


def test_token_link_logs_in_once_and_leaves_the_address_bar(open_page, cluster):
    server = cluster[0]
    w = open_page(token=server.token)
    assert "token" not in w.page.url
    assert w.page.evaluate("() => history.length") == 1 or "token" not in w.page.url
    w.page.click("#logout")
    w.page.wait_for_selector("#token")
    assert w.page.evaluate("() => localStorage.getItem('gpuplane.token')") is None
    w.assert_clean()


def test_read_token_sees_no_write_controls(open_page, cluster):
    server, _agent, home = cluster
    read = server.api.post("/api/v1/tokens", {"name": "viewer", "scope": "read"}, expect=201)
    queued = server.api.submit(["python", "train.py"], workdir(home), name="big", gpus=64)
    failed = server.api.submit(["python", "train.py"], workdir(home), name="to-cancel", gpus=64)
    server.api.post(f"/api/v1/jobs/{failed['id']}/cancel", expect=200)
    w = open_page(token=read["token"])
    page = w.page
    assert "read only" in page.inner_text("#who")
    page.goto(server.url + "/#/jobs")
    page.wait_for_selector(f"tr[data-job='{queued['id']}']")
    assert page.locator("#new-job").count() == 0
    page.goto(f"{server.url}/#/jobs/{queued['id']}")
    page.wait_for_selector("#job-name")
    assert page.locator("#cancel, #retry").count() == 0
    page.goto(f"{server.url}/#/jobs/{failed['id']}")
    page.wait_for_selector(".page-head .badge:has-text('CANCELLED')")
    assert page.locator("#cancel, #retry").count() == 0
    page.goto(server.url + "/#/jobs/new")
    page.wait_for_selector("text=can only read")
    assert page.locator("#submit-form").count() == 0
    server.api.post(f"/api/v1/jobs/{queued['id']}/cancel", expect=200)
    w.assert_clean()


def test_hostile_names_and_log_lines_render_as_inert_text(open_page, cluster):
    server, _agent, home = cluster
    wd = pathlib.Path(home) / "hostile"
    wd.mkdir(exist_ok=True)
    (wd / "say.py").write_text(
        'print("<img src=x onerror=alert(2)> \\x1b[1;32mgreen\\x1b[0m \\x1b[2J<a href=javascript:alert(3)>x</a>")\n')
    job = server.api.submit(["python", "say.py"], wd, name=HOSTILE, cpu_only=True,
                            project="<b>p</b>")
    server.api.wait_job(job["id"])
    waiting = server.api.submit(["true"], wd, name=HOSTILE, gpus=64)     # stays in the queue
    w = open_page(token=server.token)
    page = w.page
    for where in ("#/", "#/jobs", f"#/jobs/{job['id']}", "#/runs", "#/events", "#/experiments"):
        page.goto(server.url + "/" + where)
        try:
            page.wait_for_function("(t) => document.querySelector('main').textContent.includes(t)",
                                   arg=HOSTILE, timeout=20_000)
        except Exception:
            raise AssertionError(f"{where}: {page.inner_text('main')[:2000]}") from None
        assert page.locator("main img, main b, main script, main a[href^='javascript']").count() == 0
    page.goto(f"{server.url}/#/jobs/{job['id']}")
    line = page.wait_for_selector("#log .line .tx")
    assert line.text_content() == "<img src=x onerror=alert(2)> green <a href=javascript:alert(3)>x</a>"
    assert page.locator("#log .c-green.c-bold").count() == 1
    server.api.post(f"/api/v1/jobs/{waiting['id']}/cancel", expect=200)
    w.assert_clean()


def test_every_page_without_console_errors_at_desktop_and_phone_width(open_page, cluster):
    server = cluster[0]
    runs = server.api.get("/api/v1/runs", expect=200)["runs"]
    pages = {"overview": "#/", "jobs": "#/jobs", "runs": "#/runs", "experiments": "#/experiments",
             "events": "#/events", "metrics": "#/metrics", "submit": "#/jobs/new"}
    if runs:
        pages["run-page"] = f"#/runs/{runs[-1]['id']}"
    for width, scheme, suffix in ((1280, "light", ""), (390, "dark", "-phone")):
        w = open_page(token=server.token, width=width, height=844 if suffix else 900, scheme=scheme)
        page = w.page
        for name, where in pages.items():
            page.goto(server.url + "/" + where)
            try:
                page.wait_for_selector(".page h1")
            except Exception:
                raise AssertionError(f"{where}: {page.inner_text('main')[:2000]}; "
                                     f"console: {w.errors}") from None
            if name == "overview":
                page.wait_for_selector("#nodes .node[data-node='gpu-box'] tr[data-gpu='1']")
                assert page.locator("#nodes tr[data-gpu]").count() == 2
            if suffix == "" and name in ("overview", "jobs", "experiments", "metrics", "submit"):
                shot(page, name)
            if suffix and name in ("overview", "run-page"):
                shot(page, name + suffix)
        # Keyboard: the navigation is reachable by Tab from the top of the page.
        page.goto(server.url + "/#/")
        page.reload()                 # focus starts at the top of the document again
        page.wait_for_selector("#who .who-name")
        reached = []
        for _ in range(4):
            page.keyboard.press("Tab")
            reached.append(page.evaluate("() => document.activeElement.textContent.trim()"))
        assert "Skip to content" in reached and "Jobs" in reached, reached
        # One stream for the whole tab, whatever the pages opened.
        assert page.evaluate("() => window.gpuplane.live.state") == "live"
        w.assert_clean()


def test_metric_definition_set_from_the_page(open_page, cluster):
    server = cluster[0]
    w = open_page(token=server.token)
    page = w.page
    page.goto(server.url + "/#/metrics")
    page.wait_for_selector("#md-key")
    page.fill("#md-key", "val/score")
    page.select_option("#md-direction", "max")
    page.check("#md-primary")
    page.click("#md-save")
    page.wait_for_selector("#defs tr:has-text('val/score'):has-text('higher is better')")
    defs = server.api.get("/api/v1/metric-definitions", expect=200)["definitions"]
    assert any(d["key"] == "val/score" and d["direction"] == "max" and d["primary"] for d in defs)
    w.assert_clean()


CKPT_TRAIN = '''
import pathlib, time
from gpuctl import run
run.init()
pathlib.Path("ckpt").mkdir(exist_ok=True)
t0 = int(time.time() * 1000)
for i in range(100):          # <= 100 points: every chart width draws them all, raw
    # a point's time is when it was logged: given here, 10 ms apart
    run.log({"train/loss": 2.0 / (1 + i / 10)}, step=i, ts=t0 + 10 * i)
    if i in (30, 60, 99):
        # eval/loss is best at step 60: the recommendation is not simply the last one
        run.log({"eval/loss": {30: 0.9, 60: 0.4, 99: 0.6}[i]}, step=i, ts=t0 + 10 * i)
        p = pathlib.Path(f"ckpt/step_{i}.pt")
        p.write_bytes(b"x" * 1000)
        run.log_checkpoint(str(p), step=i)
run.finish()
'''


def x_data(page, key):
    return page.evaluate("(k) => { const c = window.gpuplane.charts[k];"
                         " return c && c.u ? [c.u.data[0], c.u.scales.x.time] : null }", key)


def test_checkpoints_evaluate_recommend_and_the_wall_time_axis(open_page, cluster):
    server, _agent, home = cluster
    wd = pathlib.Path(home) / "ckpt-run"
    wd.mkdir(exist_ok=True)
    (wd / "train.py").write_text(CKPT_TRAIN)
    (wd / "eval.py").write_text("from gpuctl import run\nrun.init()\nrun.log({'eval/loss': 0.3})\n")
    job = server.api.submit(["python", "train.py"], wd, name="ckpt-train", cpu_only=True,
                            project="ckpt", experiment="browser", eval_command=["python", "eval.py"])
    assert server.api.wait_job(job["id"])["state"] == "SUCCEEDED"
    run_id = server.api.job(job["id"])["run_id"]
    ckpts = wait_for(lambda: (c := server.api.get(f"/api/v1/runs/{run_id}/checkpoints",
                                                  expect=200)["checkpoints"]) and len(c) == 3 and c,
                     30, what="3 checkpoints")
    by_step = {c["step"]: c["id"] for c in ckpts}
    wait_for(lambda: server.api.get(f"/api/v1/runs/{run_id}/metrics/train/loss",
                                    expect=200)["points"][-1][0] == 99, 30, what="all points")
    # eval/loss decides in this project (another test makes val/score primary globally)
    server.api.post("/api/v1/metric-definitions", {"key": "eval/loss", "project": "ckpt",
                                                   "direction": "min", "primary": True})
    assert server.api.last.status_code in (200, 201), server.api.last.text
    rec = server.api.get(f"/api/v1/checkpoints:recommend?run={run_id}", expect=200)
    assert rec["checkpoint"]["checkpoint_id"] == by_step[60]

    w = open_page(token=server.token)
    page = w.page
    page.goto(f"{server.url}/#/runs/{run_id}")
    # The table lists them with their metrics; the recommendation is the API's.
    page.wait_for_selector("#checkpoint-table tbody tr[data-checkpoint]")
    assert page.locator("#checkpoint-table tbody tr").count() == 3
    for step, cid in by_step.items():
        row = page.locator(f"#checkpoint-table tr[data-checkpoint='{cid}']")
        assert f"step_{step}.pt" in row.inner_text() and "eval/loss" in row.inner_text()
    assert page.get_attribute("#recommendation", "data-checkpoint") == str(by_step[60])
    assert f"checkpoint #{by_step[60]}" in page.inner_text("#recommendation")
    assert "recommended" in page.get_attribute(f"tr[data-checkpoint='{by_step[60]}']", "class")

    # The x axis: steps, then wall time (epoch seconds, each bucket's ts), remembered.
    page.wait_for_function("() => { const c = window.gpuplane.charts['train/loss'];"
                           " return c && c.u && c.u.data[0].length === 100 }")
    api_series = server.api.get(f"/api/v1/runs/{run_id}/metrics/train/loss?max_points=1000",
                                expect=200)
    steps = [p[0] for p in api_series["points"]]
    times = sorted(t / 1000 for t in api_series["ts"])
    assert x_data(page, "train/loss") == [steps, False]
    page.select_option("#xaxis", "time")
    page.wait_for_function("() => window.gpuplane.charts['train/loss'].u.data[0][0] > 1e9")
    assert x_data(page, "train/loss") == [times, True]
    assert times[0] > 1.7e9 and 0.5 < times[-1] - times[0] < 600
    shot(page, "run-wall-time")
    # Zoom on the clock asks the server for the steps drawn there and shows those times.
    a, b = times[40], times[60]
    page.evaluate("([a, b]) => window.gpuplane.charts['train/loss'].zoomToTime(a, b)", [a, b])
    zoom, view, xs = page.evaluate("() => { const c = window.gpuplane.charts['train/loss'];"
                                   " return [c.zoom, [c.u.scales.x.min, c.u.scales.x.max],"
                                   " c.u.data[0]] }")
    assert zoom[0] <= 40 and zoom[1] >= 60 and view == [a, b]
    assert xs == times[zoom[0]:zoom[1] + 1]          # raw: one point per step, at its ts
    # ... and by the mouse: a drag across the chart is a wall-clock zoom, not a step one.
    page.dblclick("#chart-train_loss .u-over")
    page.wait_for_function("() => !window.gpuplane.charts['train/loss'].zoom")
    box = page.locator("#chart-train_loss .u-over").bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * 0.3, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.5, y, steps=5)
    page.mouse.move(box["x"] + box["width"] * 0.7, y, steps=5)
    page.mouse.up()
    page.wait_for_function("() => { const c = window.gpuplane.charts['train/loss'];"
                           " return c.zoom && c.view && c.u.scales.x.min === c.view[0] }")
    zoom, view = page.evaluate("() => { const c = window.gpuplane.charts['train/loss'];"
                               " return [c.zoom, c.view] }")
    assert times[0] < view[0] < view[1] < times[-1]
    assert zoom[0] <= times.index(min(t for t in times if t >= view[0]))
    page.reload()
    page.wait_for_function("() => { const c = window.gpuplane.charts['train/loss'];"
                           " return c && c.u && c.u.data[0].length === 100 }")
    assert page.input_value("#xaxis") == "time"
    assert x_data(page, "train/loss") == [times, True]
    # ... and back by keyboard.
    page.focus("#xaxis")
    page.keyboard.press("ArrowUp")
    page.wait_for_function("() => window.gpuplane.charts['train/loss'].u.data[0][0] === 0")
    assert x_data(page, "train/loss") == [steps, False]

    # Evaluate: a confirmation, then an EVALUATE job the API knows.
    page.click(f"tr[data-checkpoint='{by_step[30]}'] button.evaluate")
    page.wait_for_selector("#confirm[open]")
    assert f"checkpoint #{by_step[30]}" in page.inner_text("#confirm-text")
    page.click("#confirm-yes")
    page.wait_for_selector("#evaluation-queued")
    evals = server.api.get(f"/api/v1/checkpoints/{by_step[30]}/evaluations",
                           expect=200)["evaluations"]
    assert len(evals) == 1
    assert server.api.job(evals[0]["job_id"])["command"] == ["python", "eval.py"]
    assert f"job #{evals[0]['job_id']}" in page.inner_text("#evaluation-queued")
    page.wait_for_selector(f"tr[data-checkpoint='{by_step[30]}'] .evaluations "
                           f"a[href='#/jobs/{evals[0]['job_id']}']")
    # Pin, which retention always keeps, and unpin: the API says the same each time.
    row = f"tr[data-checkpoint='{by_step[30]}']"
    page.click(f"{row} button.pin")
    page.wait_for_selector(f"{row} .kept .badge.pinned")
    assert server.api.get(f"/api/v1/checkpoints/{by_step[30]}")["pinned"] is True
    assert page.inner_text(f"{row} button.pin") == "Unpin"
    page.click(f"{row} button.pin")
    page.wait_for_selector(f"{row} .kept .badge.pinned", state="detached")
    assert server.api.get(f"/api/v1/checkpoints/{by_step[30]}")["pinned"] is False
    shot(page, "run-checkpoints")
    w.assert_clean()

    # A read token: the same table and recommendation, no evaluate control.
    read = server.api.post("/api/v1/tokens", {"name": "ckpt-viewer", "scope": "read"}, expect=201)
    r = open_page(token=read["token"])
    r.page.goto(f"{server.url}/#/runs/{run_id}")
    r.page.wait_for_selector("#checkpoint-table tbody tr[data-checkpoint]")
    r.page.wait_for_selector("#recommendation")
    assert r.page.locator("#checkpoints button, button.evaluate").count() == 0
    # The overlay on the experiments page follows the tab's axis too (wall time here).
    r.page.evaluate("() => sessionStorage.setItem('gpuplane.xaxis', 'time')")
    r.page.goto(f"{server.url}/#/experiments?project=ckpt&experiment=browser")
    r.page.wait_for_function("() => { const o = window.gpuplane.charts.overlay;"
                             " return o && o.u && o.u.data[0].length > 0 }")
    xs = r.page.evaluate("() => window.gpuplane.charts.overlay.u.data[0]")
    assert xs[0] > 1.7e9 and r.page.input_value("#xaxis") == "time"
    r.assert_clean()


def test_live_updates_resume_after_a_server_restart_without_a_reload(open_page, cluster):
    # Last in this module: it restarts the module's server.
    server = cluster[0]
    w = open_page(token=server.token)
    page = w.page
    page.goto(server.url + "/#/")
    page.wait_for_selector("#nodes .node")
    page.wait_for_function("() => window.gpuplane.live.state === 'live'")
    page.evaluate("() => { window.notReloaded = true; }")
    server.restart()
    queued = server.api.submit(["true"], "/tmp", name="after-restart", gpus=64)
    page.wait_for_selector(f"#queue a[href='#/jobs/{queued['id']}']", timeout=60_000)
    assert page.evaluate("() => window.notReloaded === true")
    assert page.evaluate("() => window.gpuplane.live.state") == "live"
    server.api.post(f"/api/v1/jobs/{queued['id']}/cancel", expect=200)
    # The restart's failed reconnects are network errors in the console; nothing else.
    assert all("ERR_CONNECTION_REFUSED" in e or "Failed to load resource" in e
               for e in w.errors), w.errors
    w.errors.clear()
    w.assert_clean()
