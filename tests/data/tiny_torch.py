"""A tiny real torch training run for tests/test_mcp_training.py (a second or two of CPU).

An MLP classifies 16-d points into 4 classes (a fixed linear teacher labels them), with
Adam, logging train/loss every step and val/loss, val/acc every 20 steps through the SDK:

  --mode learns        lr 3e-3: the loss falls from ln 4 towards 0
  --mode no-learning   the labels are drawn independently of the input: nothing to learn,
                       the loss stays at chance level (ln 4 = 1.386)
  --mode diverges      the learning rate grows 3 % a step from 0.01 (a range test left
                       running): the loss climbs far above its start and stays there;
                       every value finite (the script fails if one is not)

    python tiny_torch.py --mode learns --steps 300
"""
import argparse
import math

import torch
from torch import nn

try:
    from gpuctl import run
except ImportError:          # the SDK is optional
    run = None

LR = {"learns": 3e-3, "no-learning": 3e-3, "diverges": 1e-2}
GROWTH = {"diverges": 1.03}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=sorted(LR), required=True)
    ap.add_argument("--lr", type=float, default=None, help="default: the mode's")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lr = args.lr if args.lr is not None else LR[args.mode]
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    d, classes = 16, 4
    teacher = torch.randn(d, classes)

    def batch(n):
        x = torch.randn(n, d)
        if args.mode == "no-learning":
            return x, torch.randint(0, classes, (n,))
        return x, (x @ teacher).argmax(1)

    model = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, classes))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    xv, yv = batch(512)
    for step in range(args.steps):
        x, y = batch(64)
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        for g in opt.param_groups:
            g["lr"] *= GROWTH.get(args.mode, 1.0)
        value = loss.item()
        if not math.isfinite(value):
            raise SystemExit(f"train/loss became {value} at step {step}")
        logs = {"train/loss": value, "lr": opt.param_groups[0]["lr"]}
        if step % 20 == 19:
            with torch.no_grad():
                out = model(xv)
                logs["val/loss"] = loss_fn(out, yv).item()
                logs["val/acc"] = (out.argmax(1) == yv).float().mean().item()
            print(f"step {step} train/loss {value:.4g} val/loss {logs['val/loss']:.4g} "
                  f"val/acc {logs['val/acc']:.3f}", flush=True)
        if run:
            run.log(logs, step=step)
    if run:
        run.finish()


if __name__ == "__main__":
    main()
