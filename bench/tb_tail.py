"""Scalars/s of TBTailer.poll() against tensorboard's own EventFileLoader, on one file.

    .venv/bin/python bench/tb_tail.py [--scalars 1000000] [--reps 3] [--loader-reps 1]

Writes a v1 (simple_value) event file with several tags, then reads it whole with each
reader. EventFileLoader is the reader LIBRARIES.md names (it converts every v1 value to a
v2 tensor); LegacyEventFileLoader is the same record reader without that conversion.
Results are in docs/tensorboard.md.
"""
import argparse
import os
import pathlib
import statistics
import sys
import socket
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_tailer():
    sys.path.insert(0, str(ROOT))
    from agent import TBTailer
    return TBTailer


def write_file(run_dir, n_scalars, tags):
    """Frames records itself: tensorboard's EventFileWriter computes CRCs in pure Python
    and needs minutes for a million scalars. The loader reading the file back whole
    (asserted in main) shows the framing is right."""
    import struct
    import google_crc32c
    from tensorboard.compat.proto import event_pb2, summary_pb2

    def masked(b):
        c = google_crc32c.value(b)
        return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    def record(data):
        head = struct.pack("<Q", len(data))
        return head + struct.pack("<I", masked(head)) + data + struct.pack("<I", masked(data))

    t0 = time.time()
    # named as torch names it: this host and this process's pid
    path = os.path.join(run_dir, f"events.out.tfevents.{int(t0)}.{socket.gethostname()}."
                                 f"{os.getpid()}.0")
    with open(path, "wb") as fh:
        fh.write(record(event_pb2.Event(wall_time=t0, file_version="brain.Event:2").SerializeToString()))
        out = []
        for i in range(n_scalars // len(tags)):
            # One tag per event, as torch's SummaryWriter.add_scalar and Keras write them.
            for k, tag in enumerate(tags):
                v = summary_pb2.Summary.Value(tag=tag, simple_value=i * 0.001 + k)
                ev = event_pb2.Event(wall_time=t0 + i * 0.01, step=i, summary=summary_pb2.Summary(value=[v]))
                out.append(record(ev.SerializeToString()))
            if len(out) > 10000:
                fh.write(b"".join(out))
                out.clear()
        fh.write(b"".join(out))
    return path


def owner_check(run_dir):
    """Writers.owner as a job's tailer uses it when another job shares the folder (the
    attribution check, docs/tensorboard.md "Whose file is it")."""
    import types
    import agent

    def att(job_id, pid):
        a = types.SimpleNamespace(job_id=job_id, attempt=1, container=None, slurm_id=None,
                                  working_dir=run_dir, tb_dir=None, watch_dir=None,
                                  received_at=(time.time() - 60) * 1000)
        a.resolve = lambda p: p
        a.pid = lambda: {"pid": pid, "create_time": None}
        return a
    mine, other = agent.Writers(att(1, os.getpid())), agent.Writers(att(2, 1))
    mine.neighbours = other.neighbours = lambda: [mine, other]
    return mine.owner


def time_tailer(TBTailer, run_dir, owner=None):
    t = time.perf_counter()
    tailer, n = TBTailer(run_dir, owner=owner), 0
    while points := tailer.poll():   # as the agent does: a backlog comes in batches
        n += len(points)
    return time.perf_counter() - t, n


def time_loader(path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    t = time.perf_counter()
    n = 0
    for ev in EventFileLoader(path).Load():
        for v in ev.summary.value:
            if v.metadata.plugin_data.plugin_name == "scalars":
                tensor_util.make_ndarray(v.tensor).item()
                n += 1
    return time.perf_counter() - t, n


def time_legacy_loader(path):
    """The raw loader: same pure-Python CRC, without EventFileLoader's v1 -> v2 conversion."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    t = time.perf_counter()
    n = 0
    for ev in LegacyEventFileLoader(path).Load():
        for v in ev.summary.value:
            if v.HasField("simple_value"):
                v.simple_value
                n += 1
    return time.perf_counter() - t, n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scalars", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--loader-reps", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where to write the file (default: a temp dir)")
    args = ap.parse_args()

    TBTailer = load_tailer()
    tags = ["loss", "lr", "accuracy", "grad_norm", "val/loss"]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        t = time.perf_counter()
        path = write_file(tmp, args.scalars, tags)
        print(f"wrote {args.scalars} scalars ({os.path.getsize(path) / 1e6:.1f} MB) in "
              f"{time.perf_counter() - t:.1f} s: {path}")

        ours, checked = [], []
        for _ in range(args.reps):
            secs, n = time_tailer(TBTailer, tmp)
            assert n == args.scalars, n
            ours.append(n / secs)
            # the file names this process's pid: the check says it is this job's
            secs, n = time_tailer(TBTailer, tmp, owner_check(tmp))
            assert n == args.scalars, n
            checked.append(n / secs)
        theirs = []
        for _ in range(args.loader_reps):
            secs, n = time_loader(path)
            assert n == args.scalars, n
            theirs.append(n / secs)

        legacy = []
        for _ in range(args.loader_reps):
            secs, n = time_legacy_loader(path)
            assert n == args.scalars, n
            legacy.append(n / secs)

    # which CRC the tailer uses is known once one has been made (it loads on first use)
    crc = getattr(sys.modules[TBTailer.__module__], "TB_CRC32C", "?")
    a, b, c = statistics.median(ours), statistics.median(theirs), statistics.median(legacy)
    print(f"TBTailer.poll (crc32c: {crc}): {a:,.0f} scalars/s  (median of {len(ours)}: "
          + ", ".join(f"{x:,.0f}" for x in ours) + ")")
    print(f"EventFileLoader:              {b:,.0f} scalars/s  (median of {len(theirs)}: "
          + ", ".join(f"{x:,.0f}" for x in theirs) + ")")
    print(f"LegacyEventFileLoader (raw):  {c:,.0f} scalars/s  (median of {len(legacy)}: "
          + ", ".join(f"{x:,.0f}" for x in legacy) + ")")
    print(f"ratio: {a / b:.1f}x EventFileLoader, {a / c:.1f}x LegacyEventFileLoader")
    d = statistics.median(checked)
    print(f"with the attribution check (Writers.owner, a shared folder): {d:,.0f} scalars/s"
          f" (median of {len(checked)}: " + ", ".join(f"{x:,.0f}" for x in checked)
          + f"); {d / a:.3f}x without it")

if __name__ == "__main__":
    main()
