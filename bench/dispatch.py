"""Dispatch latency and drain throughput, beside starting the same processes directly.

    .venv/bin/python bench/dispatch.py [--jobs 50] [--drain 200] [--slots 4] [--idle 30]

Starts a real server (gunicorn) and a real agent with fake GPUs (default settings: 5 s
heartbeat, 10 s node stats) in a temp home, removed at the end, then:
0. the idle agent's CPU over `--idle` seconds (user + system time of its process, as a
   share of one core), with the machine's load average beside it;
1. submit → process start latency for `--jobs` jobs, one at a time on an idle node
   (the job writes time.time() as its first act; the submit time is taken just before
   the POST), median and p95;
2. the time to drain `--drain` trivial jobs through `--slots` GPU slots;
and, as the baseline in the same run, the bare cost of starting the same processes with
subprocess directly, `--slots` at a time. Prints both and the ratio.
"""
import argparse
import concurrent.futures
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import requests

from harness import ROOT, free_port, start_server, stop_server


def wait(cond, timeout=60, what="condition", every=0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except requests.RequestException:
            pass
        time.sleep(every)
    raise SystemExit(f"timed out waiting for {what}")


def start_platform(home, slots):
    server, url, token = start_server(home, free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
    env["GPUCTL_HOME"] = str(home)
    agent = subprocess.Popen(
        [sys.executable, str(ROOT / "agent.py"), "--server", url, "--token", token,
         "--name", "bench", "--home", str(home), "--fake-gpus", str(slots)],
        cwd=ROOT, env=env, stdout=open(home / "agent.log", "ab"), stderr=subprocess.STDOUT,
        start_new_session=True)
    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {token}"

    def node_ready():
        nodes = s.get(url + "/api/v1/nodes", timeout=2).json()["nodes"]
        return nodes and nodes[0]["state"] == "connected" and nodes[0]["synced"]
    wait(node_ready, what="agent")
    return url, s, [agent, server], agent


def submit(s, url, command, workdir):
    r = s.post(url + "/api/v1/jobs", json={"command": command, "working_dir": str(workdir),
                                           "gpus": 1, "name": "bench"}, timeout=30)
    r.raise_for_status()
    return r.json()["id"]


def cpu_split(procs, agent):
    """CPU seconds so far: server (master + worker), agent, the agent's children (its fork
    server and the shims it forked and reaped, with the jobs under them), this benchmark
    process."""
    import psutil
    server = psutil.Process(procs[1].pid)
    tree = [server] + server.children(recursive=True)
    ap = psutil.Process(agent.pid)
    a = ap.cpu_times()
    me = psutil.Process().cpu_times()
    return {"server": sum(sum(p.cpu_times()[:2]) for p in tree),
            "agent": a.user + a.system,
            "shims+jobs": a.children_user + a.children_system
            + sum(sum(k.cpu_times()[:4]) for k in ap.children()),
            "bench client": me.user + me.system}


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=50)
    ap.add_argument("--drain", type=int, default=200)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--idle", type=float, default=30.0, help="seconds of idle measurement")
    args = ap.parse_args()

    home = pathlib.Path(tempfile.mkdtemp(prefix="gpuplane-bench-"))
    work = home / "work"
    work.mkdir()
    url, s, procs, agent = start_platform(home, args.slots)
    try:
        # 0. the idle agent
        import psutil
        ap_ = psutil.Process(agent.pid)
        time.sleep(2)               # past the connect and first node stats
        c0, t0, load0 = sum(ap_.cpu_times()[:2]), time.monotonic(), os.getloadavg()[0]
        time.sleep(args.idle)
        idle_cpu = (sum(ap_.cpu_times()[:2]) - c0) / (time.monotonic() - t0)
        load = (load0 + os.getloadavg()[0]) / 2

        # 1. submit → start latency, one job at a time on an idle node
        stamp = ("import sys, time; open(sys.argv[1], 'w').write(repr(time.time()))")
        lat = []
        for i in range(args.jobs):
            marker = work / f"start-{i}"
            t0 = time.time()
            job_id = submit(s, url, [sys.executable, "-c", stamp, str(marker)], work)
            wait(lambda: marker.exists() and marker.read_text(), what=f"job {job_id} start")
            lat.append(float(marker.read_text()) - t0)
            wait(lambda: s.get(f"{url}/api/v1/jobs/{job_id}", timeout=5).json()["state"]
                 == "SUCCEEDED", what=f"job {job_id} end")
        # the same start, directly: process creation up to the first statement
        direct = []
        for i in range(args.jobs):
            marker = work / f"direct-{i}"
            t0 = time.time()
            subprocess.run([sys.executable, "-c", stamp, str(marker)], cwd=work, check=True)
            direct.append(float(marker.read_text()) - t0)

        # 2. drain N trivial jobs through the slots
        trivial = [sys.executable, "-c", "pass"]
        cpu0 = cpu_split(procs, agent)
        t0 = time.monotonic()
        ids = [submit(s, url, trivial, work) for _ in range(args.drain)]
        last = ids[-1]

        def drained():
            jobs = s.get(f"{url}/api/v1/jobs?limit={args.drain + 10}", timeout=10).json()["jobs"]
            done = [j for j in jobs if j["id"] in set(ids) and j["state"] == "SUCCEEDED"]
            return len(done) == len(ids)
        # the last job's state every 50 ms, then the whole list once: polling the list
        # every 10 ms cost the server more CPU than the jobs' dispatch on 2 cores
        wait(lambda: s.get(f"{url}/api/v1/jobs/{last}", timeout=5).json()["state"]
             in ("SUCCEEDED", "FAILED"), timeout=600, what=f"job {last}", every=0.05)
        wait(drained, timeout=600, what=f"{args.drain} jobs drained (last {last})", every=0.05)
        drain_s = time.monotonic() - t0
        cpu1 = cpu_split(procs, agent)

        import resource
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.slots) as pool:
            list(pool.map(lambda _: subprocess.run(trivial, cwd=work, check=True),
                          range(args.drain)))
        direct_drain_s = time.monotonic() - t0
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        direct_cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    finally:
        for p in procs:
            stop_server(p)          # both run as their own process group
        shutil.rmtree(home, ignore_errors=True)

    ms = lambda v: f"{v * 1000:.1f} ms"
    print(f"idle agent over {args.idle:.0f} s: {idle_cpu * 100:.3f} % of a core "
          f"(load average {load:.1f} on {os.cpu_count()} cores)")
    print(f"submit → process start over {args.jobs} jobs, idle node with {args.slots} fake GPUs")
    print(f"  gpuplane : median {ms(statistics.median(lat))}, p95 {ms(pct(lat, 95))}")
    print(f"  direct   : median {ms(statistics.median(direct))}, p95 {ms(pct(direct, 95))}"
          "   (subprocess.run of the same command)")
    print(f"  ratio    : {statistics.median(lat) / statistics.median(direct):.1f}x (median)")
    print(f"drain {args.drain} trivial jobs through {args.slots} slots")
    print(f"  gpuplane : {drain_s:.2f} s ({args.drain / drain_s:.1f} jobs/s)")
    print(f"  direct   : {direct_drain_s:.2f} s ({args.drain / direct_drain_s:.1f} jobs/s)"
          f"   ({args.slots} subprocess.run at a time)")
    print(f"  ratio    : {drain_s / direct_drain_s:.1f}x")
    print("  CPU      : gpuplane " + ", ".join(f"{k} {cpu1[k] - cpu0[k]:.2f} s" for k in cpu0)
          + f"; direct: the jobs {direct_cpu:.2f} s")


if __name__ == "__main__":
    main()
