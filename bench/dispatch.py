"""Dispatch latency and drain throughput, beside starting the same processes directly.

    .venv/bin/python bench/dispatch.py [--jobs 50] [--drain 200] [--slots 4] [--idle 30]
                                       [--rounds 3]

Starts a real server (gunicorn) and a real agent with fake GPUs (default settings: 5 s
heartbeat, 10 s node stats) in a temp home, removed at the end, then:
0. the idle agent's CPU over `--idle` seconds (user + system time of its process, as a
   share of one core), with the machine's load average beside it;
1. submit → process start latency for `--jobs` jobs, one at a time on an idle node
   (the job writes time.time() as its first act; the submit time is taken just before
   the POST), median and p95;
2. the time to drain `--drain` trivial jobs through `--slots` GPU slots, `--rounds`
   times, each beside a direct drain of the same commands (`--slots` subprocess.run at a
   time), the two alternated (G D, D G, ...), with the CPU of each part and the whole
   machine's busy CPU over each drain (/proc/stat: on a machine with fewer cores than
   slots a drain is bound by it, and the ratio of two drains follows the ratio of their
   CPU);
and, as the baselines in the same run, the bare cost of starting the same processes with
subprocess directly, and Debian's task-spooler (`tsp -S SLOTS`, its own server on a socket
of this run, its end awaited with `tsp -w`; skipped, saying so, where `tsp` is not
installed) draining the same commands, and the same commands as one sweep's trials
(parallel = slots: no POST a job, each trial launched by the sweeper as one ends), the
four rotated (G D S T, D S T G, ...).
Prints each, the ratio of each round and their median, each drain's busy CPU a job
beyond the direct one's, and
3. the floor of this stack: the CPU of one keep-alive REST request that touches no
   database (GET /api/v1/health), the server's and the client's, and of one POST
   /api/v1/jobs as the drain sends it; beside each queue's busy CPU a job beyond the
   direct drain's, what GPUPlane's submit and its shim cost a job alone.
The temp home lies in $TMPDIR (docs/benchmarks.md says why that matters on this VM).
"""
import argparse
import concurrent.futures
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import requests

import harness  # noqa: E402
from harness import ROOT, free_port, start_server, stop_server


def wait(cond, timeout=60, what="condition", every=0.01):
    return harness.wait(cond, timeout, what, every)


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
    """CPU seconds so far: server (master + worker), agent, its shim (the process that
    spawns and reaps every job), the jobs (the shim's reaped children, and anything the
    agent reaped itself), this benchmark process."""
    import psutil
    server = psutil.Process(procs[1].pid)
    tree = [server] + server.children(recursive=True)
    ap = psutil.Process(agent.pid)
    a = ap.cpu_times()
    me = psutil.Process().cpu_times()
    shims = [k.cpu_times() for k in ap.children()]
    return {"server": sum(sum(p.cpu_times()[:2]) for p in tree),
            "agent": a.user + a.system,
            "shim": sum(t.user + t.system for t in shims),
            "jobs": a.children_user + a.children_system
            + sum(t.children_user + t.children_system for t in shims),
            "bench client": me.user + me.system}


def turnover(home, done):
    """Medians over the drained jobs of one slot's turnover, in ms: the shim's `exit` →
    the agent's EXITED record (the job's `ended_at`), and that record → the agent holding
    the next start on the same GPU (its spec's `received_at`)."""
    def attempt_file(job, name):
        path = home / "agent" / "jobs" / str(job["id"]) / str(job["attempt"]) / name
        return json.loads(path.read_text())
    by_slot = {}
    for j in done:
        by_slot.setdefault(tuple(j["gpu_indices"] or []), []).append(j)
    reported, next_start = [], []
    for jobs in by_slot.values():
        jobs.sort(key=lambda j: j["started_at"])
        for a, b in zip(jobs, jobs[1:]):
            reported.append(a["ended_at"] - attempt_file(a, "exit")["ended_at"])
            next_start.append(attempt_file(b, "spec.json")["received_at"] - a["ended_at"])
    return statistics.median(reported), statistics.median(next_start)


def drained(s, url, ids):
    """The jobs `ids` once every one has succeeded, else None."""
    jobs = s.get(f"{url}/api/v1/jobs?limit={len(ids) + 10}", timeout=10).json()["jobs"]
    done = [j for j in jobs if j["id"] in set(ids) and j["state"] == "SUCCEEDED"]
    return done if len(done) == len(ids) else None


def machine_busy():
    """CPU seconds the whole machine has spent busy, from /proc/stat's first line (user,
    nice, system, irq and softirq; not idle, iowait, nor steal: time a VM wanted and did
    not get): what a drain cost in all, its client and any daemon included."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


FLOOR_REQUESTS = 1000   # CPU times come in 10 ms ticks: enough requests to read ~1 ms each


def rest_floor(s, url, procs, agent, n=FLOOR_REQUESTS):
    """CPU ms of one keep-alive GET /api/v1/health (no auth, no database), over `n`:
    (server, this client)."""
    s.get(url + "/api/v1/health", timeout=5)
    cpu0 = cpu_split(procs, agent)
    for _ in range(n):
        s.get(url + "/api/v1/health", timeout=5).raise_for_status()
    cpu1 = cpu_split(procs, agent)
    return tuple((cpu1[k] - cpu0[k]) / n * 1000 for k in ("server", "bench client"))


def submit_cost(s, url, procs, agent, workdir, slots, n=FLOOR_REQUESTS):
    """CPU ms of one POST /api/v1/jobs as the drain sends it, over `n` jobs that wait (one
    GPU more than the node has: queued with their reason in the submit, as the drain's
    are while the slots are busy, and never started; cancelled after): (server, this
    client). The rest of a drained job's cost is what comes after its submit."""
    ids = []
    cpu0 = cpu_split(procs, agent)
    for _ in range(n):
        r = s.post(url + "/api/v1/jobs", json={"command": [sys.executable, "-c", "pass"],
                                               "working_dir": str(workdir),
                                               "gpus": slots + 1, "name": "bench"}, timeout=30)
        r.raise_for_status()
        ids.append(r.json()["id"])
    cpu1 = cpu_split(procs, agent)
    for job_id in ids:
        s.post(f"{url}/api/v1/jobs/{job_id}/cancel", timeout=30).raise_for_status()
    return tuple((cpu1[k] - cpu0[k]) / n * 1000 for k in ("server", "bench client"))


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=50)
    ap.add_argument("--drain", type=int, default=200)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="drains, alternated with direct ones")
    ap.add_argument("--idle", type=float, default=30.0, help="seconds of idle measurement")
    args = ap.parse_args()

    home = pathlib.Path(tempfile.mkdtemp(prefix="gpuplane-bench-"))
    work = home / "work"
    work.mkdir()
    url, s, procs, agent = start_platform(home, args.slots)
    tsp_kill = []               # how to stop task-spooler's server, once it runs
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

        # 2. drain N trivial jobs through the slots, alternated with the direct drain
        # (G D, D G, G D, ...): this VM's speed drifts by a third between minutes, and a
        # ratio of two phases run back to back reads that drift
        trivial = [sys.executable, "-c", "pass"]

        def gpuplane_drain():
            cpu0 = cpu_split(procs, agent)
            t0 = time.time()
            ids = [submit(s, url, trivial, work) for _ in range(args.drain)]
            # The drain ends when the last job's end is recorded (`ended_at`: when the
            # agent reported the exit; the server applies it milliseconds later). Waiting
            # for it polls the last job every 0.5 s, then lists them all once: polling
            # every 50 ms, or following the job on the stream, cost 1-2 ms of CPU per
            # drained job, as much as a tenth of the dispatch being measured.
            wait(lambda: s.get(f"{url}/api/v1/jobs/{ids[-1]}", timeout=5).json()["state"]
                 in ("SUCCEEDED", "FAILED"), timeout=600, what=f"job {ids[-1]}", every=0.5)
            done = wait(lambda: drained(s, url, ids), timeout=600,
                        what=f"{args.drain} jobs drained (last {ids[-1]})", every=0.5)
            seconds = max(j["ended_at"] for j in done) / 1000 - t0
            cpu1 = cpu_split(procs, agent)
            return seconds, {k: cpu1[k] - cpu0[k] for k in cpu0}, turnover(home, done)

        def sweep_drain():
            # The same commands as a sweep's trials (parallel = slots): no POST per job,
            # and each trial is launched by the sweeper when one ends. Ends at the last
            # trial's `ended_at`, once the sweep is DONE (polled every 0.5 s).
            t0 = time.time()
            r = s.post(url + "/api/v1/sweeps", json={
                "name": "drain", "command": trivial + ["{i}"], "gpus": 1,
                "working_dir": str(work), "parameters": {"i": list(range(args.drain))},
                "parallel": args.slots}, timeout=30)
            r.raise_for_status()
            sweep_id = r.json()["id"]
            def ended():        # the list, newest first: lighter than the sweep's view
                sw = s.get(f"{url}/api/v1/sweeps?limit=1", timeout=5).json()["sweeps"][0]
                return sw["id"] == sweep_id and sw["state"] in ("DONE", "STOPPED", "CANCELLED")
            wait(ended, timeout=600, what=f"sweep {sweep_id} done", every=0.5)
            state = s.get(f"{url}/api/v1/sweeps/{sweep_id}", timeout=30).json()
            ends = [t["ended_at"] for t in state["trials_detail"]
                    if t["job_state"] == "SUCCEEDED"]
            if len(ends) != args.drain:
                raise SystemExit(f"sweep {sweep_id} ended {state['state']} with "
                                 f"{len(ends)} of {args.drain} trials succeeded")
            return max(ends) / 1000 - t0

        def direct_drain():
            import resource
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(args.slots) as pool:
                list(pool.map(lambda _: subprocess.run(trivial, cwd=work, check=True),
                              range(args.drain)))
            seconds = time.monotonic() - t0
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            return seconds, r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime

        # Debian's task-spooler as a peer: its own server on a socket of this run, `-S`
        # slots, one `tsp CMD` client per job (as GPUPlane has one POST per job); the
        # drain ends when `tsp -w` (a blocking wait, no polling) has seen the last one end
        # and `tsp -l` lists every job finished.
        # Its output files (one per job, in TMPDIR) go beside the jobs' working dir, not in
        # it: the agent walks a job's working dir for TensorBoard files, and 200 more
        # files there each round made GPUPlane's later rounds slower.
        tsp = shutil.which("tsp") or shutil.which("ts")
        tsp_dir = home / "tsp"
        tsp_dir.mkdir()
        tsp_env = dict(os.environ, TS_SOCKET=str(tsp_dir / "tsp.socket"),
                       TS_MAXFINISHED="100000", TS_SLOTS=str(args.slots), TMPDIR=str(tsp_dir))

        def tsp_run(*argv):
            return subprocess.run([tsp, *argv], env=tsp_env, cwd=work, check=True,
                                  capture_output=True, text=True).stdout

        def tsp_drain():
            tsp_run("-C")                         # forget the last round's finished jobs
            t0 = time.monotonic()
            for _ in range(args.drain):
                tsp_run(*trivial)
            # `tsp -w ID` blocks until the server says the job ended (no polling): the
            # last one added, then any listed as not finished yet. Not tsp_run: its exit
            # status is the job's, which the list below checks.
            wait_for = [[]]                       # [] : the last one added
            while True:
                for job in wait_for:
                    subprocess.run([tsp, "-w", *job], env=tsp_env, capture_output=True)
                listed = [line.split() for line in tsp_run("-l").splitlines()[1:]
                          if line.strip()]
                wait_for = [[f[0]] for f in listed if f[1] != "finished"]
                if len(listed) >= args.drain and not wait_for:
                    break
            seconds = time.monotonic() - t0
            bad = [f for f in listed if f[3] != "0"]
            if bad:
                raise SystemExit(f"task-spooler: {len(bad)} jobs failed: {bad[:3]}")
            # its jobs' CPU, as `tsp -l` lists it (user/system of each; its server is
            # not this process's child, so getrusage cannot see them)
            return seconds, sum(float(x) for f in listed for x in f[4].split("/")[1:])

        if tsp:
            tsp_run("-S", str(args.slots))        # starts its server with that many slots
            tsp_kill[:] = [[tsp, "-K"], tsp_env]
        peers = [("gpuplane", gpuplane_drain), ("direct", direct_drain),
                 ("sweep", sweep_drain)] + (
            [("tsp", tsp_drain)] if tsp else [])
        rounds = []
        for i in range(args.rounds):
            # each round starts with another of them (G D T, D T G, T G D, ...)
            order = peers[i % len(peers):] + peers[:i % len(peers)]
            got, busy = {}, {}
            for name, fn in order:
                b0 = machine_busy()
                got[name] = fn()
                busy[name] = machine_busy() - b0
            rounds.append((got["gpuplane"], got["direct"], got.get("tsp"), busy, got["sweep"]))

        # 3. the floor of one REST request on this stack: what any job submitted through
        # the API pays before GPUPlane does anything (gunicorn + Flask + requests)
        floor = rest_floor(s, url, procs, agent)
        posting = submit_cost(s, url, procs, agent, work, args.slots)
    finally:
        if tsp_kill:                # its server outlives us otherwise, even on a failure
            subprocess.run(tsp_kill[0], env=tsp_kill[1], capture_output=True)
        for p in procs:
            stop_server(p)          # both run as their own process group
        shutil.rmtree(home, ignore_errors=True)

    ms = lambda v: f"{v * 1000:.1f} ms"

    def beyond(busy, name):
        """ms of the machine's busy CPU a job, over the direct drain's in the same round"""
        return (busy[name] - busy["direct"]) / args.drain * 1000
    print(f"idle agent over {args.idle:.0f} s: {idle_cpu * 100:.3f} % of a core "
          f"(load average {load:.1f} on {os.cpu_count()} cores)")
    print(f"submit → process start over {args.jobs} jobs, idle node with {args.slots} fake GPUs")
    print(f"  gpuplane : median {ms(statistics.median(lat))}, p95 {ms(pct(lat, 95))}")
    print(f"  direct   : median {ms(statistics.median(direct))}, p95 {ms(pct(direct, 95))}"
          "   (subprocess.run of the same command)")
    print(f"  ratio    : {statistics.median(lat) / statistics.median(direct):.1f}x (median)")
    print(f"drain {args.drain} trivial jobs through {args.slots} slots, {args.rounds} rounds "
          "alternated with the direct drain")
    for i, ((g_s, g_cpu, (reported, next_start)), (d_s, d_cpu), t, busy, sw) in enumerate(
            rounds, 1):
        print(f"  round {i}  : gpuplane {g_s:.2f} s, direct {d_s:.2f} s "
              f"({args.slots} subprocess.run at a time): {g_s / d_s:.2f}x"
              + (f"; task-spooler {t[0]:.2f} s (tsp -S {args.slots}): gpuplane "
                 f"{g_s / t[0]:.2f}x it, it {t[0] / d_s:.2f}x direct" if t else ""))
        print(f"             the same commands as a sweep's trials (parallel {args.slots}): "
              f"{sw:.2f} s, {sw / g_s:.2f}x the queue's drain"
              + (f", {sw / t[0]:.2f}x task-spooler" if t else ""))
        print("             CPU: gpuplane " + ", ".join(f"{k} {v:.2f} s" for k, v in g_cpu.items())
              + f"; direct: the jobs {d_cpu:.2f} s"
              + (f"; task-spooler: the jobs {t[1]:.2f} s" if t else ""))
        print("             the machine's busy CPU over each drain: "
              + ", ".join(f"{k} {v:.2f} s" for k, v in busy.items()))
        print(f"             a slot's turnover (medians): exit → EXITED record {reported:.0f} ms,"
              f" → the next start at the agent {next_start:.0f} ms")
        print("             the machine's busy CPU a job beyond the direct drain's: gpuplane "
              f"{beyond(busy, 'gpuplane'):.1f} ms"
              + (f", task-spooler {beyond(busy, 'tsp'):.1f} ms (its clients included)"
                 if t else ""))
    ratios = [g[0] / d[0] for g, d, *_ in rounds]
    if ratios:
        print(f"  ratio    : median {statistics.median(ratios):.2f}x "
              f"(range {min(ratios):.2f}-{max(ratios):.2f}x)")
    if not tsp:
        print("  task-spooler: skipped (no `tsp` on PATH: apt-get install task-spooler)")
    elif rounds:
        vs = [g[0] / t[0] for g, _, t, *_ in rounds]
        tr = [t[0] / d[0] for _, d, t, *_ in rounds]
        sv = [sw / t[0] for _, _, t, _, sw in rounds]
        print(f"  vs tsp   : gpuplane median {statistics.median(vs):.2f}x task-spooler "
              f"(range {min(vs):.2f}-{max(vs):.2f}x); task-spooler median "
              f"{statistics.median(tr):.2f}x direct; the sweep median "
              f"{statistics.median(sv):.2f}x task-spooler (range {min(sv):.2f}-{max(sv):.2f}x)")
    if rounds:
        sq = [sw / g[0] for g, *_, sw in rounds]
        print(f"  sweep    : its trials drain in {statistics.median(sq):.2f}x the queue's time "
              f"(median; range {min(sq):.2f}-{max(sq):.2f}x)")
    print(f"the stack's floor: one keep-alive REST request (GET /api/v1/health, {FLOOR_REQUESTS} "
          f"times) costs {floor[0]:.2f} ms of the server's CPU and {floor[1]:.2f} ms of the "
          f"client's; one POST /api/v1/jobs as the drain sends it (a job that waits, "
          f"{FLOOR_REQUESTS} times) {posting[0]:.2f} ms of the server's and "
          f"{posting[1]:.2f} ms of the client's")
    if rounds:
        shim = statistics.median(g[1]["shim"] for g, *_ in rounds) / args.drain * 1000
        mine = statistics.median(beyond(r[3], "gpuplane") for r in rounds)
        print(f"per job beyond the direct drain (medians of the rounds): gpuplane {mine:.1f} ms of "
              "the machine's busy CPU"
              + (f", task-spooler {statistics.median(beyond(r[3], 'tsp') for r in rounds):.1f} "
                 "ms" if tsp else "")
              + f"; of GPUPlane's, its submit (the POST above, both sides) and its shim's spawn "
              f"and reaping ({shim:.2f} ms) alone come to {sum(posting) + shim:.1f} ms")

if __name__ == "__main__":
    main()
