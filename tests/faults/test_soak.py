"""Soak: several fake-GPU agents running jobs that log lines and post SDK points, SSE log
followers and a health poller, for a bounded time. Afterwards the server's file
descriptors are back near the baseline, its threads within the gthread pool, health
stayed responsive all along (p99 printed), memory growth printed. Also measured: how many
long-lived connections the gthread pool holds before a health check starves."""
import json
import statistics
import threading
import time

import requests

from .helpers import (check_lines, fd_kinds, log_rows, proc_counts, report, stream_command, wait_for,
                      worker_pid)

POOL = 24                                   # server.toml `threads` for the soak


def _follow(url, token, counts, key, stop):
    """An SSE follower: counts data lines until the stream ends (or stop)."""
    try:
        with requests.get(url, headers={"Authorization": f"Bearer {token}"}, stream=True,
                          timeout=60) as r:
            for raw in r.iter_lines(decode_unicode=True):
                if raw.startswith("data: ") and '"text": "line ' in raw:
                    counts[key] = counts.get(key, 0) + 1
                elif raw == "event: end" or stop.is_set():
                    return
    except requests.RequestException as e:
        counts[f"{key}-error"] = repr(e)


def test_soak_returns_to_baseline(server_factory, agent_factory, tmp_path, job_home,
                                  faults_long):
    soak_s = 300.0 if faults_long else 20.0
    n_agents, jobs_per_agent, followers = 3, 2, 3
    server = server_factory({"threads": POOL, "log_keep_lines": 10_000_000})
    api = server.api
    pid = worker_pid(server)
    api.get("/api/v1/health", expect=200)
    base, base_kinds = proc_counts(pid), fd_kinds(pid)

    stop = threading.Event()
    lat, failures = [], []

    def poll_health():
        s = requests.Session()
        while not stop.is_set():
            t = time.monotonic()
            try:
                ok = s.get(server.url + "/api/v1/health", timeout=10).ok
            except requests.RequestException as e:
                ok = False
                failures.append(repr(e))
            lat.append(time.monotonic() - t)
            if not ok:
                failures.append("not ok")
            time.sleep(0.05)
    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()

    agents = [agent_factory(server, name=f"soak{i}", fake_gpus=jobs_per_agent)
              for i in range(n_agents)]
    lines, steps, keys = int(soak_s * 60), int(soak_s * 40), 2
    jobs = [api.submit(stream_command(tmp_path, lines, steps, keys, soak_s), tmp_path, gpus=1,
                       env={"GPUCTL_HOME": str(job_home)})
            for _ in range(n_agents * jobs_per_agent)]
    counts, sse = {}, []
    for i in range(followers):
        url = f"{server.url}/api/v1/jobs/{jobs[i]['id']}/logs/stream?tail=2000"
        t = threading.Thread(target=_follow, args=(url, server.token, counts, i, stop),
                             daemon=True)
        t.start()
        sse.append(t)
    peak = [base]

    def busy():
        peak.append(proc_counts(pid))
        return all(api.job(j["id"])["state"] in ("SUCCEEDED", "FAILED", "CANCELLED")
                   for j in jobs)
    wait_for(busy, soak_s + 180, interval=1.0, what="every soak job finished")
    for t in sse:
        t.join(30)
    for a in agents:
        a.stop()
    wait_for(lambda: all(n["state"] == "disconnected"
                         for n in api.get("/api/v1/nodes", expect=200)["nodes"]), 30,
             what="agents gone")
    stop.set()
    poller.join(15)

    # Sockets close and WebSocket reader threads end; idle pool threads exit after 5 s.
    # SQLite connections are the database's fixed pool, not per thread: their descriptors
    # never move.
    def settled():
        _fds, threads, _ = proc_counts(pid)
        kinds = fd_kinds(pid)
        return (kinds["socket"] <= base_kinds["socket"] + 2 and kinds["other"] <= base_kinds["other"] + 2
                and kinds["db"] <= base_kinds["db"] and threads <= base[1] + POOL)
    try:
        wait_for(settled, 30, interval=0.5, what="fds and threads back near the baseline")
    except AssertionError:
        pass                                 # reported and asserted below
    after, after_kinds = proc_counts(pid), fd_kinds(pid)
    results = [api.job(j["id"]) for j in jobs]
    lost = sum(check_lines(log_rows(server, j["id"]), lines)[1] for j in jobs)
    doubled = sum(check_lines(log_rows(server, j["id"]), lines)[2] for j in jobs)
    lat.sort()
    p99 = lat[int(len(lat) * 0.99) - 1] if lat else None
    report("soak", seconds=soak_s, agents=n_agents, jobs=len(jobs), sse_followers=followers,
           lines_lost=lost, lines_doubled=doubled,
           sse_lines=json.dumps({str(k): v for k, v in counts.items()}, separators=(",", ":")),
           health_checks=len(lat), health_failed=len(failures),
           health_p50_ms=round(statistics.median(lat) * 1000, 1) if lat else None,
           health_p99_ms=round(p99 * 1000, 1) if p99 else None,
           fds_base=base[0], fds_peak=max(p[0] for p in peak), fds_after=after[0],
           sockets_base=base_kinds["socket"], sockets_after=after_kinds["socket"],
           db_fds_base=base_kinds["db"], db_fds_after=after_kinds["db"],
           threads_base=base[1], threads_peak=max(p[1] for p in peak), threads_after=after[1],
           rss_base_mb=round(base[2] / 1024, 1), rss_after_mb=round(after[2] / 1024, 1))
    assert all(j["state"] == "SUCCEEDED" for j in results), [j["state"] for j in results]
    assert lost == 0 and doubled == 0
    assert not failures, failures[:5]
    assert all(counts.get(i) == lines for i in range(followers)), counts
    assert after_kinds["socket"] <= base_kinds["socket"] + 2, (base_kinds, after_kinds)
    assert after_kinds["other"] <= base_kinds["other"] + 2, (base_kinds, after_kinds)
    assert after_kinds["db"] <= base_kinds["db"], (base_kinds, after_kinds)
    assert after[1] <= base[1] + POOL, f"threads {base[1]} -> {after[1]}"


def test_thread_budget_streams_are_refused_before_health_starves(server_factory):
    """Each SSE follower (and each agent WebSocket) holds one gthread pool thread for its
    life. With `threads = T`, followers are capped at T - agent_threads - rest_threads
    (gpuplane/streams.py); beyond that they get a 503, and health never starves."""
    threads = 8
    server = server_factory({"threads": threads})
    api = server.api
    job = api.submit(["python", "-c", "pass"], "/tmp", gpus=1)     # queued forever: no agent
    url = f"{server.url}/api/v1/jobs/{job['id']}/logs/stream"
    held, admitted, refused = [], 0, 0
    auth = {"Authorization": f"Bearer {server.token}"}
    try:
        for _ in range(threads + 2):
            r = requests.get(url, headers=auth, stream=True, timeout=(3, 3))
            held.append(r)
            if r.status_code == 200:
                admitted += 1
            else:
                assert r.status_code == 503, r.status_code
                refused += 1
            requests.get(server.url + "/api/v1/health", timeout=3).raise_for_status()
    finally:
        for r in held:
            r.close()
    report("thread-budget", threads=threads, followers_admitted=admitted,
           followers_refused=refused)
    assert 0 < admitted < threads - 1 and refused == threads + 2 - admitted
