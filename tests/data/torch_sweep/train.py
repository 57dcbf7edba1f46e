"""A tiny PyTorch training for the MCP loop test (tests/test_mcp_sweep.py): an MLP on a
synthetic two-moons-like problem, a few seconds of CPU. Logs train/loss per step and
val/loss, val/acc per epoch through the SDK, and saves a checkpoint per epoch at the step
where the val metrics were logged.

    python train.py --lr 0.3 --epochs 4 --logdir tb/a --checkpoint-dir ckpt/a
"""
import argparse
import math
import os

import torch

from gpuctl import run


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g) * math.pi
    side = (torch.rand(n, generator=g) < 0.5).long()
    x = torch.stack([torch.cos(t) + side.float(), torch.sin(t) * (1 - 2 * side.float())
                     + 0.4 * side.float()], 1)
    return x + 0.15 * torch.randn(n, 2, generator=g), side


def model():
    return torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))


def score(net, x, y):
    with torch.no_grad():
        out = net(x)
        return (torch.nn.functional.cross_entropy(out, y).item(),
                (out.argmax(1) == y).float().mean().item())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--steps-per-epoch", type=int, default=20)
    ap.add_argument("--logdir", default="tb")
    ap.add_argument("--checkpoint-dir", default="ckpt")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    x, y = data(512, 1)
    vx, vy = data(256, 2)
    net = model()
    params = list(net.parameters())     # plain SGD by hand: torch.optim costs seconds to import
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    run.init(config={"optimizer": "sgd", "hidden": 32})
    step = 0
    for epoch in range(args.epochs):
        for _ in range(args.steps_per_epoch):
            idx = torch.randint(0, len(x), (64,))
            loss = torch.nn.functional.cross_entropy(net(x[idx]), y[idx])
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p -= args.lr * g
            step += 1
            run.log({"train/loss": loss.item()}, step=step)
        val_loss, val_acc = score(net, vx, vy)
        run.log({"val/loss": val_loss, "val/acc": val_acc}, step=step, epoch=epoch)
        path = os.path.join(args.checkpoint_dir, f"epoch_{epoch}.pt")
        torch.save(net.state_dict(), path)
        run.log_checkpoint(path, step=step, epoch=epoch)
        print(f"epoch {epoch} step {step} val/loss {val_loss:.4f} val/acc {val_acc:.3f}",
              flush=True)
    run.finish()


if __name__ == "__main__":
    main()
