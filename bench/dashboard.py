"""Dashboard figures in headless Chromium (Debian's, driven by playwright).

1. run page: a run with KEYS keys x POINTS points (default 8 x 1 000 000, a step every
   10 ms); time from navigation to the first chart painted, and bytes transferred until
   every chart is drawn, three loads on the step axis and three on wall time; beside it
   a naive page that fetches every point of ONE key (paging the raw series 10 000 points
   at a time, the API's bound), in the same run.
2. log latency: a job prints its own clock every 100 ms; the job page notes when each
   line appears; p50 / p95 of (seen - printed), same host, same clock.
3. overview with N nodes x G GPUs (default 32 x 8): a full refresh from one status
   message, script time per refresh (p50 / p95 over --rounds), then style + layout,
   beside the cost of only parsing the same message (the floor any renderer pays).

    .venv/bin/python bench/dashboard.py [--points 1000000] [--keys 8] [--nodes 32] [--gpus 8]
    .venv/bin/python bench/dashboard.py --only overview      # or: run, logs
"""
import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import requests

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from procs import AgentProc, ServerProc, wait_for  # noqa: E402

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def status(nodes, gpus, round_):
    out = {"nodes": [], "queue": [], "running": []}
    job = 0
    for n in range(nodes):
        gl = []
        for g in range(gpus):
            holder = None
            if (n + g) % 3 == 0:
                job += 1
                holder = job
                out["running"].append({"id": job, "name": f"job-{job}", "state": "RUNNING",
                                       "node": f"node{n}", "gpu_indices": [g], "cpu_only": False,
                                       "started_at": 1764403200000, "created_at": 1764403200000})
            gl.append({"index": g, "name": "Fake GPU", "memory_total_mb": 81920,
                       "util": (n * 7 + g * 13 + round_) % 100, "mem_used_mb": 1000 + g * 900,
                       "temp_c": 40 + g, "power_w": 100 + n, "job_id": holder})
        out["nodes"].append({"name": f"node{n}", "hostname": f"h{n}", "state": "connected",
                             "last_seen": 0, "fake": True, "cpu_slots": 4, "gpus": gl,
                             "cpu_jobs": [], "host": {"cpu": 12, "mem_used_mb": 1000,
                                                      "mem_total_mb": 64000, "disk_free_mb": 1e5}})
    for q in range(20):
        out["queue"].append({"id": 10000 + q, "name": f"q{q}", "gpus": 8, "cpu_only": False,
                             "priority": 0, "pending_reason": None})
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def launch(p):
    return p.chromium.launch(executable_path="/usr/bin/chromium", args=FLAGS)


def login(browser, server, width=1280):
    ctx = browser.new_context(viewport={"width": width, "height": 900})
    page = ctx.new_page()
    page.goto(f"{server.url}/#token={server.token}")
    page.wait_for_selector("#who .who-name")
    return ctx, page


def bench_run(p, server, keys, points):
    from gpuplane.metricwire import BINARY_TYPE, encode_binary
    api = server.api
    run = api.post("/api/v1/runs", {"project": "bench", "name": "big"}, expect=201)
    names = [f"train/key{k}" for k in range(keys)]
    t0 = time.monotonic()
    start = int(time.time() * 1000) - points * 10       # a step every 10 ms, ending now
    batch = 200_000
    s = requests.Session()
    s.headers.update({"Authorization": f"Bearer {server.token}", "Content-Type": BINARY_TYPE})
    for k in range(keys):
        for lo in range(0, points, batch):
            pts = [[k, i, 1.0 / (1 + i / 1000) + (i % 97) * 1e-4, start + 10 * i] for i in range(lo, min(points, lo + batch))]
            r = s.post(f"{server.url}/api/v1/runs/{run['id']}/metrics", data=encode_binary(names, pts), timeout=300)
            assert r.ok, r.text
    ingest_s = time.monotonic() - t0

    def rolled():
        out = api.get(f"/api/v1/runs/{run['id']}/metrics/{names[-1]}?max_points=500", expect=200)
        return out["level"] >= 16 and out
    wait_for(rolled, 900, interval=1, what="rollups of the last key")
    print(f"run page: {keys} keys x {points} points ingested in {ingest_s:.0f} s, rolled up", flush=True)

    b = launch(p)
    ctx, page = login(b, server)
    figures = []
    for axis in ["step"] * 3 + ["time"] * 3:
        page2 = ctx.new_page()
        # the x axis is remembered per tab (sessionStorage): set before the page's scripts
        page2.add_init_script(f"sessionStorage.setItem('gpuplane.xaxis', '{axis}')")
        page2.goto(f"{server.url}/#/runs/{run['id']}")
        page2.wait_for_function("() => window.gpuplane && window.gpuplane.firstChartAt")
        first = page2.evaluate("() => window.gpuplane.firstChartAt")
        page2.wait_for_function(f"() => Object.values(window.gpuplane.charts).filter(c => c.u).length >= {min(keys, 8)}",
                                timeout=60_000)
        all_ms = page2.evaluate("() => performance.now()")
        kb = page2.evaluate("() => (performance.getEntriesByType('navigation')[0].transferSize"
                            " + performance.getEntriesByType('resource').reduce((a, e) => a + e.transferSize, 0)) / 1024")
        api_kb = page2.evaluate("() => performance.getEntriesByType('resource').filter(e => e.name.includes('/metrics/'))"
                                ".reduce((a, e) => a + e.transferSize, 0) / 1024")
        time_x = page2.evaluate("() => Object.values(window.gpuplane.charts).every("
                                "c => !c.u || (c.u.data[0][0] > 1e9) === (c.options.xaxis === 'time'))")
        assert time_x, f"the charts are not on the {axis} axis"
        figures.append((first, all_ms, kb, api_kb))
        page2.close()
    for axis, (first, all_ms, kb, api_kb) in zip(["step"] * 3 + ["wall time"] * 3, figures):
        print(f"  dashboard ({axis} axis): first chart painted {first:.0f} ms after navigation;"
              f" all charts {all_ms:.0f} ms; {kb:.0f} KB transferred ({api_kb:.0f} KB of series)")
    naive = page.evaluate("""async ([run, key, points]) => {
      const t = performance.now(); let bytes = 0, n = 0;
      const h = { Authorization: `Bearer ${localStorage.getItem('gpuplane.token')}` };
      for (let lo = 0; lo < points; lo += 10000) {
        const r = await fetch(`/api/v1/runs/${run}/metrics/${key}?max_points=10000&from_step=${lo}&to_step=${lo + 9999}`, { headers: h });
        const text = await r.text(); bytes += text.length; n += JSON.parse(text).points.length;
      }
      return { ms: performance.now() - t, kb: bytes / 1024, n };
    }""", [run["id"], names[0], points])
    print(f"  baseline, fetch every point of ONE key (paged raw): {naive['ms']:.0f} ms, "
          f"{naive['kb']:.0f} KB, {naive['n']} points; ratio to the dashboard's first chart "
          f"{naive['ms'] / statistics.median(f[0] for f in figures):.0f}x time, "
          f"{naive['kb'] / statistics.median(f[3] for f in figures):.0f}x bytes")
    b.close()


LOGGER = """
import sys, time
for i in range(int(sys.argv[1])):
    print(f"T {time.time() * 1000:.1f} line {i}", flush=True)
    time.sleep(0.1)
"""


def bench_logs(p, server, lines):
    agent = AgentProc(server, server.home.parent / "agent", "bench", fake_gpus=1).start()
    try:
        wd = server.home.parent / "work"
        wd.mkdir(exist_ok=True)
        (wd / "log.py").write_text(LOGGER)
        b = launch(p)
        ctx, page = login(b, server)
        blocker = server.api.submit(["python", "-c", "import time; time.sleep(600)"], wd, gpus=1)
        job = server.api.submit(["python", "log.py", str(lines)], wd, gpus=1)
        page.goto(f"{server.url}/#/jobs/{job['id']}")
        page.wait_for_selector("#log")
        page.evaluate("""() => { window.seen = [];
          new MutationObserver((ms) => { const now = Date.now();
            for (const m of ms) for (const n of m.addedNodes) {
              const t = n.textContent.match(/T (\\d+\\.\\d+) line/); if (t) window.seen.push(now - Number(t[1])); } })
          .observe(document.getElementById('log'), { childList: true }); }""")
        server.api.post(f"/api/v1/jobs/{blocker['id']}/cancel", expect=200)   # now the job starts
        page.wait_for_function(f"() => window.seen.length >= {lines}", timeout=lines * 1000 + 60_000)
        lat = page.evaluate("() => window.seen")
        print(f"log line to screen, {len(lat)} lines: p50 {pct(lat, .5):.0f} ms, p95 {pct(lat, .95):.0f} ms, "
              f"max {max(lat):.0f} ms (target p50 < 500 ms)")
        b.close()
    finally:
        agent.stop()


def bench_overview(p, server, nodes, gpus, rounds):
    msgs = [json.dumps(status(nodes, gpus, r)) for r in range(rounds)]
    b = launch(p)
    _ctx, page = login(b, server)
    page.wait_for_selector(".page-overview")
    times = page.evaluate("""async (msgs) => {
      const m = await import('/static/js/pages/overview.js');
      const els = { nodesEl: document.getElementById('nodes'), queueEl: document.getElementById('queue'),
                    runningEl: document.getElementById('running'), summary: document.getElementById('summary') };
      const render = [], layout = [], parse = [];
      for (const s of msgs) {
        let t = performance.now(); const d = JSON.parse(s); parse.push(performance.now() - t);
        t = performance.now(); m.renderStatus(d, els);
        const t1 = performance.now(); document.body.offsetHeight;     // force style + layout
        render.push(t1 - t); layout.push(performance.now() - t1);
      }
      return { render, layout, parse };
    }""", msgs)
    b.close()
    r, lay, base = times["render"][1:], times["layout"][1:], times["parse"][1:]   # [0]: first paint
    print(f"overview {nodes} nodes x {gpus} GPUs, {rounds} refreshes "
          f"({len(msgs[0]) // 1024} KB per status message)")
    print(f"  first render: script {times['render'][0]:.1f} ms, style+layout {times['layout'][0]:.1f} ms")
    print(f"  full refresh, script: p50 {pct(r, .5):.1f} ms, p95 {pct(r, .95):.1f} ms  (target < 100 ms)")
    print(f"  full refresh, style+layout after it: p50 {pct(lay, .5):.1f} ms, p95 {pct(lay, .95):.1f} ms")
    print(f"  baseline, JSON.parse of the same message only:  p50 {pct(base, .5):.2f} ms; "
          f"ratio {pct(r, .5) / max(pct(base, .5), 1e-3):.0f}x")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", type=int, default=1_000_000)
    ap.add_argument("--keys", type=int, default=8)
    ap.add_argument("--lines", type=int, default=50)
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--only", choices=("run", "logs", "overview"))
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright
    home = pathlib.Path(tempfile.mkdtemp(prefix="gpuplane-bench-"))
    server = ServerProc(home / "server").start()
    try:
        with sync_playwright() as p:
            if args.only in (None, "overview"):
                bench_overview(p, server, args.nodes, args.gpus, args.rounds)
            if args.only in (None, "logs"):
                bench_logs(p, server, args.lines)
            if args.only in (None, "run"):
                bench_run(p, server, args.keys, args.points)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
