"""Short jobs through GPUPlane to a real Slurm, beside the same jobs sent with sbatch.

    .venv/bin/python bench/slurm.py [--jobs 200] [--rounds 2] [--serial 10]
                                    [--slurm-defaults]

Starts a private single-node Slurm cluster (tests/slurm/cluster.py: munged, slurmctld,
slurmd in a temp dir, the node advertising 16 CPU slots), a real server (gunicorn) and an
agent with `--runner slurm --slurm-max-jobs JOBS` on it, then, alternating the two (G D,
D G, ...) because this VM's speed drifts between minutes:

- GPUPlane: JOBS jobs submitted over REST at once; each job's first act writes the time;
  submit → start is that minus the time its POST was sent, and the drain ends when the
  last job's end is recorded (its `ended_at`: when the agent reported the exit);
- direct: the same JOBS commands with `sbatch --wrap` (the agent's options: --chdir,
  --output, --no-requeue) from as many threads as the agent's sbatch submitters; submit →
  start from each sbatch call; the drain ends when one `squeue` call (every 0.2 s) finds
  none of them left.

Before that, `--serial` jobs one at a time each way: submit → start on an idle cluster.
Prints the medians, p95s, the drains and their ratios with the scheduler settings used
(`--slurm-defaults`: Slurm's built-in ones instead of this repository's test settings).
Needs root and Debian's slurm-wlm + munge.
"""
import argparse
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

sys.path.insert(0, str(ROOT))
import agent  # noqa: E402  (its SLURM_SUBMITTERS)

sys.path.insert(0, str(ROOT / "tests" / "slurm"))
from cluster import SlurmCluster, missing  # noqa: E402


def wait(cond, timeout=600, what="condition", every=0.05):
    return harness.wait(cond, timeout, what, every)


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def stamp_command(marker):
    # the job's first act: the wall time, from a shell builtin-light command
    return f"date +%s.%N > {marker}"


def read_stamp(marker):
    try:
        text = marker.read_text().strip()
        return float(text) if text else None
    except (OSError, ValueError):
        return None


class Platform:
    def __init__(self, home, cluster, max_jobs):
        self.home = home
        self.server, self.url, token = start_server(home / "server", free_port())
        env = cluster.env({k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")})
        env["GPUCTL_HOME"] = str(home / "agent")
        self.agent = subprocess.Popen(
            [sys.executable, str(ROOT / "agent.py"), "--server", self.url, "--token", token,
             "--name", "login", "--home", str(home / "agent"), "--runner", "slurm",
             "--slurm-partition", cluster.partition, "--slurm-max-jobs", str(max_jobs)],
            cwd=ROOT, env=env, stdout=open(home / "agent.log", "ab"),
            stderr=subprocess.STDOUT, start_new_session=True)
        self.s = requests.Session()
        self.s.headers["Authorization"] = f"Bearer {token}"

        def ready():
            nodes = self.s.get(self.url + "/api/v1/nodes", timeout=2).json()["nodes"]
            return nodes and nodes[0]["state"] == "connected" and nodes[0]["synced"]
        wait(ready, 60, "the agent")

    def submit(self, command, workdir):
        r = self.s.post(self.url + "/api/v1/jobs", timeout=30, json={
            "command": command, "working_dir": str(workdir), "gpus": 0, "name": "bench"})
        r.raise_for_status()
        return r.json()["id"]

    def job(self, job_id):
        return self.s.get(f"{self.url}/api/v1/jobs/{job_id}", timeout=10).json()

    def drained(self, ids):
        jobs = self.s.get(f"{self.url}/api/v1/jobs?limit={len(ids) + 50}", timeout=30).json()
        done = [j for j in jobs["jobs"] if j["id"] in ids and j["state"] == "SUCCEEDED"]
        return done if len(done) == len(ids) else None

    def stop(self):
        self.agent.terminate()
        try:
            self.agent.wait(15)
        except subprocess.TimeoutExpired:
            self.agent.kill()
        stop_server(self.server)


def cpu_seconds(pids):
    """User + system CPU seconds of these processes, their live children and the
    children they reaped, so far."""
    import psutil
    total = 0.0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            t = p.cpu_times()     # with its reaped children: the sbatch and squeue calls
            total += t.user + t.system + t.children_user + t.children_system
            for q in p.children(recursive=True):
                t = q.cpu_times()
                total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def gpuplane_round(plat, work, n, tag):
    # one working dir per round, shared by its jobs as a project's is (an agent tails each
    # job's working dir for TensorBoard files: the other round's files would weigh on it)
    work = work / f"g{tag}"
    work.mkdir()
    markers = [work / f"g{tag}-{i}" for i in range(n)]
    sent = []
    cpu0 = cpu_seconds([plat.agent.pid, plat.server.pid])
    t0 = time.time()
    ids = []
    for m in markers:
        sent.append(time.time())
        ids.append(plat.submit(stamp_command(m), work))
    wait(lambda: plat.job(ids[-1])["state"] in ("SUCCEEDED", "FAILED"), what="the last job",
         every=0.2)
    done = wait(lambda: plat.drained(set(ids)), what=f"{n} jobs drained", every=0.5)
    drain = max(j["ended_at"] for j in done) / 1000 - t0
    lat = [read_stamp(m) - s for m, s in zip(markers, sent)]
    parts = breakdown(plat, done, markers, sent)
    parts["GPUPlane CPU (agent + server)"] = cpu_seconds([plat.agent.pid, plat.server.pid]) - cpu0
    return lat, drain, parts


def breakdown(plat, done, markers, sent):
    """Medians, in seconds, of where a job's submit → start goes: POST sent → the job's
    row (created_at), → the agent holding the start (spec.json's received_at), → sbatch
    answered (slurm.json's submitted_at), → the job's first act."""
    import json
    by_id = {j["id"]: j for j in done}
    parts = {"server": [], "to agent": [], "agent → sbatch done": [], "Slurm": []}
    for job_id, m, s in zip(sorted(by_id), markers, sent):
        j = by_id[job_id]
        d = plat.home / "agent" / "agent" / "jobs" / str(job_id) / str(j["attempt"])
        try:
            received = json.loads((d / "spec.json").read_text())["received_at"] / 1000
            submitted = json.loads((d / "slurm.json").read_text())["submitted_at"] / 1000
        except (OSError, ValueError, KeyError):
            continue
        parts["server"].append(j["created_at"] / 1000 - s)
        parts["to agent"].append(received - j["created_at"] / 1000)
        parts["agent → sbatch done"].append(submitted - received)
        parts["Slurm"].append(read_stamp(m) - submitted)
    return {k: statistics.median(v) for k, v in parts.items() if v}


def direct_round(cluster, work, n, tag, submitters):
    """sbatch from `submitters` threads, as many as the agent's (SLURM_SUBMITTERS)."""
    import concurrent.futures
    work = work / f"d{tag}"
    work.mkdir()
    markers = [work / f"d{tag}-{i}" for i in range(n)]
    sent = [0.0] * n
    t0 = time.time()
    env = cluster.env()

    def one(i):
        sent[i] = time.time()
        r = subprocess.run(["sbatch", "--parsable", f"--chdir={work}",
                            f"--output={work}/d{tag}-{i}.log", "--no-requeue",
                            "--wrap", stamp_command(markers[i])], capture_output=True,
                           text=True, env=env, check=True)
        return r.stdout.strip()
    with concurrent.futures.ThreadPoolExecutor(submitters) as pool:
        ids = list(pool.map(one, range(n)))
    idset = set(ids)

    def gone():
        r = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True,
                           env=env)
        return r.returncode == 0 and not (idset & set(r.stdout.split()))
    wait(gone, what=f"{n} sbatch jobs drained", every=0.2)
    drain = time.time() - t0
    lat = [read_stamp(m) - s for m, s in zip(markers, sent)]
    return lat, drain, None


def serial(plat, cluster, work, n):
    work = work / "serial"
    work.mkdir()
    g, d = [], []
    for i in range(n):
        m = work / f"gs-{i}"
        t = time.time()
        job_id = plat.submit(stamp_command(m), work)
        wait(lambda: read_stamp(m), what=f"job {job_id} start")
        g.append(read_stamp(m) - t)
        wait(lambda: plat.job(job_id)["state"] == "SUCCEEDED", what=f"job {job_id} end")
        m = work / f"ds-{i}"
        t = time.time()
        subprocess.run(["sbatch", "--parsable", f"--chdir={work}", f"--output={work}/ds.log",
                        "--no-requeue", "--wrap", stamp_command(m)], capture_output=True,
                       env=cluster.env(), check=True)
        wait(lambda: read_stamp(m), what="direct job start")
        d.append(read_stamp(m) - t)
    return g, d


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2, help="drains each way, alternated")
    ap.add_argument("--serial", type=int, default=10, help="one-at-a-time jobs each way")
    ap.add_argument("--submitters", type=int, default=agent.SLURM_SUBMITTERS,
                    help="sbatch calls at once for the direct side (default: the agent's)")
    ap.add_argument("--slurm-defaults", action="store_true",
                    help="Slurm's built-in scheduler settings instead of the tests' ones")
    args = ap.parse_args()
    problem = missing()
    if problem:
        raise SystemExit(problem)
    home = pathlib.Path(tempfile.mkdtemp(prefix="gpuplane-bench-slurm-"))
    work = home / "work"
    work.mkdir()
    cluster = SlurmCluster(home / "slurm", scheduler="" if args.slurm_defaults else None)
    cluster.start()
    plat = None
    try:
        plat = Platform(home, cluster, args.jobs)
        load0 = os.getloadavg()[0]
        gs, ds = serial(plat, cluster, work, args.serial) if args.serial else ([], [])
        rounds = []
        for i in range(args.rounds):
            order = ("G", "D") if i % 2 == 0 else ("D", "G")
            res = {}
            for which in order:
                if which == "G":
                    res["G"] = gpuplane_round(plat, work, args.jobs, i)
                else:
                    res["D"] = direct_round(cluster, work, args.jobs, i, args.submitters)
            rounds.append(res)
        load = (load0 + os.getloadavg()[0]) / 2
        version = cluster.run("sinfo", "-V").stdout.strip()
    finally:
        if plat is not None:
            plat.stop()
        cluster.stop()

    print(f"{version}, one node advertising {cluster.cpus} CPU slots ({os.cpu_count()} real cores), "
          f"{cluster.gpus} fake GPUs; {args.submitters} sbatch calls at once each way; "
          f"SchedulerParameters="
          f"{cluster.scheduler or '(Slurm defaults)'}; agent --slurm-max-jobs {args.jobs}; "
          f"load average {load:.2f}")
    if gs:
        print(f"one job at a time ({args.serial} each): submit → start median "
              f"GPUPlane {statistics.median(gs):.3f} s, sbatch {statistics.median(ds):.3f} s, "
              f"ratio {statistics.median(gs) / statistics.median(ds):.2f}")
    print(f"{'round':>5} {'':>3} {'start med':>10} {'start p95':>10} {'drain':>8}")
    ratios = []
    for i, r in enumerate(rounds, 1):
        for which, label in (("G", "GPUPlane"), ("D", "sbatch")):
            lat, drain, _ = r[which]
            print(f"{i:>5} {label:>8} {statistics.median(lat):>9.2f}s {pct(lat, 95):>9.2f}s "
                  f"{drain:>7.2f}s")
        ratios.append((statistics.median(r["G"][0]) / statistics.median(r["D"][0]),
                       r["G"][1] / r["D"][1]))
        print(f"{'':>5} {'ratio':>8} {ratios[-1][0]:>10.2f} {'':>10} {ratios[-1][1]:>8.2f}")
        print(f"{'':>5} GPUPlane's start, medians: " + ", ".join(
            f"{k} {v:.3f}s" for k, v in r["G"][2].items()))
    print(f"drain ratio GPUPlane / sbatch: median {statistics.median(r[1] for r in ratios):.2f}"
          f" (rounds {', '.join(f'{r[1]:.2f}' for r in ratios)}); start median ratio "
          f"{statistics.median(r[0] for r in ratios):.2f}")
    shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
