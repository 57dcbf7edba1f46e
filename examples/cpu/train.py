"""A CPU training example for GPUPlane: seconds, no downloads, no framework.

Fits a small logistic-regression model on synthetic data with plain Python and reports
its curves the three ways GPUPlane reads them: printed log lines, TensorBoard event files
(when the `tensorboard` package is importable; the agent tails them), and the SDK
(`from gpuctl import run`). It runs the same with or without the platform:

    python train.py --epochs 3
"""
import argparse
import json
import math
import os
import random
import time

try:
    from gpuctl import run
except ImportError:          # the SDK is optional
    run = None

try:
    from tensorboard.summary import Writer as TBWriter
except ImportError:
    TBWriter = None


def make_data(n, w_true, rng):
    dim = len(w_true)
    data = []
    for _ in range(n):
        x = [rng.gauss(0, 1) for _ in range(dim)]
        z = sum(a * b for a, b in zip(w_true, x))
        data.append((x, 1.0 if rng.random() < 1 / (1 + math.exp(-z)) else 0.0))
    return data


def evaluate(w, b, data):
    loss = correct = 0.0
    for x, y in data:
        p = 1 / (1 + math.exp(-(sum(a * c for a, c in zip(w, x)) + b)))
        p = min(max(p, 1e-7), 1 - 1e-7)
        loss -= y * math.log(p) + (1 - y) * math.log(1 - p)
        correct += (p > 0.5) == (y > 0.5)
    return loss / len(data), correct / len(data)


def sdk_line(s):
    """One sentence of what the SDK sent (run.summary() has the whole dict)."""
    where = {"attached": f"run {s['run_id']} of this job", "registered": f"run {s['run_id']}",
             "local": "this host's spool only (no server)"}.get(s["mode"], s["mode"])
    text = f"sdk: {s['sent']} records sent to {where}"
    trouble = [f"{s[k]} {k}" for k in ("dropped", "errors", "refused") if s.get(k)]
    if s.get("queued"):
        trouble.append(f"{s['queued']} still queued")
    return text + (f" ({', '.join(trouble)}: see run.summary())" if trouble else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--steps-per-epoch", type=int, default=50)
    ap.add_argument("--step-delay", type=float, default=0.01,
                    help="seconds per step, so the curves can be watched live")
    ap.add_argument("--logdir", default="tb")
    # a folder of each run's own: jobs of this folder never overwrite each other's
    # checkpoints (docs/checkpoints.md, "A checkpoint is its content")
    run_id = os.environ.get("GPUCTL_RUN_ID")
    ap.add_argument("--checkpoint-dir",
                    default=f"checkpoints/run-{run_id}" if run_id else "checkpoints",
                    help="where epoch_N.json goes (default: checkpoints/run-ID in a job)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    w_true = [rng.uniform(-2, 2) for _ in range(8)]
    train, val = make_data(2000, w_true, rng), make_data(400, w_true, rng)
    w, b = [0.0] * 8, 0.0
    if run:
        run.init(project="examples", experiment="cpu-logreg", name="train",
                 config=vars(args))
    tb = TBWriter(args.logdir) if TBWriter else None
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    step, first_epoch = 0, 0
    # A retried attempt (after a lost node, `job retry --resume`, `sweep retry-failed`)
    # gets the last checkpoint; without it the script starts from scratch (docs/sdk.md).
    if os.environ.get("GPUCTL_RESUME_FROM"):
        with open(os.environ["GPUCTL_RESUME_FROM"]) as f:
            saved = json.load(f)
        w, b, step, first_epoch = saved["w"], saved["b"], saved["step"], saved["epoch"] + 1
        print(f"resumed from {os.environ['GPUCTL_RESUME_FROM']} at step {step}", flush=True)
    for epoch in range(first_epoch, args.epochs):
        for _ in range(args.steps_per_epoch):
            batch = rng.sample(train, 32)
            gw, gb, loss = [0.0] * 8, 0.0, 0.0
            for x, y in batch:
                p = 1 / (1 + math.exp(-(sum(a * c for a, c in zip(w, x)) + b)))
                p = min(max(p, 1e-7), 1 - 1e-7)
                loss -= y * math.log(p) + (1 - y) * math.log(1 - p)
                for i in range(8):
                    gw[i] += (p - y) * x[i]
                gb += p - y
            w = [wi - args.lr * g / len(batch) for wi, g in zip(w, gw)]
            b -= args.lr * gb / len(batch)
            step += 1
            loss /= len(batch)
            if run:
                run.log({"train/loss": loss}, step=step, epoch=epoch)
            if tb:
                tb.add_scalar("train/loss", loss, step=step)
            if step % 10 == 0:
                print(f"epoch {epoch} step {step} train/loss {loss:.4f}", flush=True)
            time.sleep(args.step_delay)
        val_loss, val_acc = evaluate(w, b, val)
        print(f"epoch {epoch} done: val/loss {val_loss:.4f} val/acc {val_acc:.3f}", flush=True)
        if run:
            run.log({"val/loss": val_loss, "val/acc": val_acc}, step=step, epoch=epoch)
        if tb:
            tb.add_scalar("val/loss", val_loss, step=step)
            tb.add_scalar("val/acc", val_acc, step=step)
            tb.flush()
        path = os.path.join(args.checkpoint_dir, f"epoch_{epoch}.json")
        with open(path, "w") as f:
            json.dump({"w": w, "b": b, "epoch": epoch, "step": step}, f)
        if run:
            run.log_checkpoint(path, step=step, epoch=epoch)
    if tb:
        tb.close()
    if run:
        run.finish()
        print(sdk_line(run.summary()), flush=True)
    print("training finished", flush=True)


if __name__ == "__main__":
    main()
