"""What knowing a file's writer costs (agent.py Writers, docs/tensorboard.md "Whose file
is it"), against the tailer and the sampling it adds, in the same run:

    .venv/bin/python bench/writers.py [--files 200] [--fds 1000] [--reps 5]

1. A walk over a folder of `--files` event files (each a few points) shared by two
   attempts: TBTailer with no owner check (the previous approach) and with
   Writers.owner, both reading every file whole; seconds per walk and the ratio.
2. Writers.sample() -- the process tree and its open files, from /proc -- for a process
   holding `--fds` files open under the watched folder: milliseconds per sample, and the
   share of one core at the agent's once-a-second rate while a folder is shared.
"""
import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import agent  # noqa: E402


def event_file(path, n_points):
    from tensorboard.summary import Writer
    w = Writer(str(path))
    for step in range(n_points):
        w.add_scalar("loss", 1.0 / (step + 1), step=step)
    w.close()


def fake_attempt(job_id, root, pid_info, received_at):
    att = types.SimpleNamespace(job_id=job_id, attempt=1, container=None, slurm_id=None,
                                working_dir=root, tb_dir=None, watch_dir=None,
                                received_at=received_at)
    att.resolve = lambda p: p
    att.pid = lambda: pid_info
    return att


def walk(root, owner):
    """-> (seconds of the first walk, reading everything; seconds of the next walk, with
    every file known; points read)."""
    t = time.perf_counter()
    tailer, n = agent.TBTailer(root, 0, owner=owner), 0
    while points := tailer.poll(rescan=True):
        n += len(points)
    first = time.perf_counter() - t
    t = time.perf_counter()
    tailer.poll(rescan=True)
    return first, time.perf_counter() - t, n


def spread(label, xs):
    return (f"{label} {statistics.median(xs) * 1e3:.1f} ms (min {min(xs) * 1e3:.1f}, max "
            f"{max(xs) * 1e3:.1f})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--fds", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print(f"load: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        started = time.time() - 5
        for i in range(args.files):
            event_file(pathlib.Path(tmp) / f"run{i}", 20)
        me = {"pid": os.getpid(), "create_time": None}
        mine = agent.Writers(fake_attempt(1, tmp, me, started * 1000))
        other = agent.Writers(fake_attempt(2, tmp, {"pid": 1, "create_time": None},
                                           started * 1000))
        mine.neighbours = other.neighbours = lambda: [mine, other]
        plain, checked, plain2, checked2 = [], [], [], []
        for _ in range(args.reps):
            s, s2, n0 = walk(tmp, None)
            plain.append(s)
            plain2.append(s2)
            mine.sampled = 0.0
            s, s2, n1 = walk(tmp, mine.owner)
            checked.append(s)
            checked2.append(s2)
        assert n1 == n0       # their names carry this process's pid: all this attempt's
        for what, a, b in (("first walk (every file new, read whole)", plain, checked),
                           ("next walk (every file known)", plain2, checked2)):
            print(f"{what}, {args.files} event files, {n0} points: "
                  f"{spread('no owner check', a)}; {spread('Writers.owner', b)}; ratio "
                  f"{statistics.median(b) / statistics.median(a):.2f}")

        # a process holding --fds files open for writing under the folder
        holder = subprocess.Popen(
            [sys.executable, "-c", "import sys, time\n"
             f"fs = [open(f'{tmp}/held{{i}}.bin', 'wb') for i in range({args.fds})]\n"
             "print('ready', flush=True); time.sleep(600)"], stdout=subprocess.PIPE,
            text=True)
        try:
            assert holder.stdout.readline().strip() == "ready"
            w = agent.Writers(fake_attempt(3, tmp, {"pid": holder.pid, "create_time": None},
                                           started * 1000))
            times = []
            for _ in range(args.reps * 4):
                t = time.perf_counter()
                w.sample(force=True)
                times.append(time.perf_counter() - t)
            assert len(w.open) >= args.fds, len(w.open)
            med = statistics.median(times)
            print(f"Writers.sample() of a process holding {args.fds} files: median "
                  f"{med * 1e3:.2f} ms (min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f})"
                  f" = {med * 100:.2f} % of a core at one sample a second (only while "
                  "another attempt shares the folder); baseline: 0 (no sampling)")
        finally:
            holder.kill()
            holder.wait()


if __name__ == "__main__":
    main()
