"""CPU of the agent's checkpoint watcher on a big watch dir, beside a bare os.walk.

    .venv/bin/python bench/ckpt_scan.py [--files 10000] [--scans 20]

Builds a watch dir of `--files` files in a temp dir (removed at the end): a tenth are
checkpoints (`*.pt`, Lightning `epoch=E-step=S.ckpt`, `*.safetensors`), the rest logs
and small files, in 100 subdirectories, plus Hugging Face `checkpoint-N/` directories of
7 files each. Then times CheckpointHook.scan (process CPU time, the figure that matters
for a shared host) over `--scans` scans, and as the baseline in the same run a bare
`os.walk` + `os.stat` of every file (what the watcher did before it was bounded and
filtered). Prints CPU per scan, the share of one core at the default interval
(CKPT_INTERVAL_S) and the share the watcher's own pacing allows (it never scans more
often than 100× its last scan's cost).
"""
import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import agent  # noqa: E402


def build(root, n_files):
    per_dir = max(1, n_files // 100)
    made = 0
    for d in range(100):
        sub = root / f"run{d:02d}"
        sub.mkdir()
        for i in range(per_dir):
            if made >= n_files:
                break
            k = made % 10
            name = (f"model_{made}.pt" if k == 0 else
                    f"epoch={made % 50}-step={made}.ckpt" if k == 1 and made % 20 == 1 else
                    f"weights_{made}.safetensors" if k == 1 else
                    f"events_{made}.log")
            (sub / name).write_bytes(b"x" * (made % 512))
            made += 1
    hf = root / "hf"
    hf.mkdir()
    for step in range(500, 500 * 21, 500):
        d = hf / f"checkpoint-{step}"
        d.mkdir()
        for name in ("config.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
                     "rng_state.pth", "trainer_state.json", "training_args.bin"):
            (d / name).write_bytes(b"y" * 64)
            made += 1
    return made


def cpu_per_call(fn, reps):
    out = []
    for _ in range(reps):
        t = time.process_time()
        fn()
        out.append(time.process_time() - t)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--scans", type=int, default=20)
    args = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="gpuplane-ckpt-scan-"))
    try:
        total = build(tmp, args.files)
        hook = agent.CheckpointHook(agent.Attempt(1, 1, str(tmp)))
        found = hook.scan(str(tmp))

        def walk():
            for dirpath, _dirs, files in os.walk(tmp):
                for f in files:
                    os.stat(os.path.join(dirpath, f))

        ours = cpu_per_call(lambda: hook.scan(str(tmp)), args.scans)
        base = cpu_per_call(walk, args.scans)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    a, b = statistics.median(ours), statistics.median(base)
    interval = agent.CKPT_INTERVAL_S
    print(f"watch dir: {total} files ({len(found)} checkpoints found, "
          f"{sum(1 for v in found.values() if v[1] == 'hf')} of them HF directories); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"  CheckpointHook.scan : {a * 1000:.1f} ms CPU per scan (median of {len(ours)}; "
          f"min {min(ours) * 1000:.1f}, max {max(ours) * 1000:.1f})")
    print(f"  os.walk + stat all  : {b * 1000:.1f} ms CPU per scan (median of {len(base)})")
    print(f"  ratio               : {a / b:.2f}x the bare walk")
    print(f"  share of one core at the default {interval:.0f} s interval: "
          f"{a / interval * 100:.3f} %  (pacing caps it at 1 % whatever the tree)")


if __name__ == "__main__":
    main()
