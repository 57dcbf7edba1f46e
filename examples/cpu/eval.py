"""Evaluate one checkpoint of examples/cpu/train.py on held-out data.

GPUPlane runs this as an EVALUATE job (`gpuplane ckpt evaluate ID`, or the training job's
`--eval-command`) with $GPUCTL_CHECKPOINT_PATH set to the checkpoint; what it logs
through the SDK becomes that checkpoint's evaluation results. By hand:

    python eval.py checkpoints/epoch_2.json
"""
import argparse
import json
import os
import random

from train import evaluate, make_data

try:
    from gpuctl import run
except ImportError:          # the SDK is optional
    run = None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", nargs="?", default=os.environ.get("GPUCTL_CHECKPOINT_PATH"),
                    help="the checkpoint file (default: $GPUCTL_CHECKPOINT_PATH)")
    ap.add_argument("--seed", type=int, default=0, help="the training run's --seed")
    args = ap.parse_args()
    if not args.checkpoint:
        ap.error("give a checkpoint file, or set GPUCTL_CHECKPOINT_PATH")
    with open(args.checkpoint) as f:
        ckpt = json.load(f)
    # the same true weights as training (same seed), a test set training never saw
    rng = random.Random(args.seed)
    w_true = [rng.uniform(-2, 2) for _ in range(8)]
    test = make_data(1000, w_true, random.Random(args.seed + 1000))
    loss, acc = evaluate(ckpt["w"], ckpt["b"], test)
    print(f"{args.checkpoint}: eval/loss {loss:.4f} eval/acc {acc:.3f}", flush=True)
    if run:
        run.log({"eval/loss": loss, "eval/acc": acc}, step=ckpt.get("step"))
        run.finish()


if __name__ == "__main__":
    main()
