"""Evaluate one checkpoint of train.py on held-out data (an EVALUATE job: the checkpoint
is $GPUCTL_CHECKPOINT_PATH); test/loss and test/acc become its evaluation results."""
import os

import torch

from gpuctl import run
from train import data, model, score


def main():
    torch.set_num_threads(1)
    net = model()
    net.load_state_dict(torch.load(os.environ["GPUCTL_CHECKPOINT_PATH"]))
    loss, acc = score(net, *data(1024, 3))
    step = os.environ.get("GPUCTL_CHECKPOINT_STEP")
    run.log({"test/loss": loss, "test/acc": acc}, step=int(step) if step else 0)
    print(f"test/loss {loss:.4f} test/acc {acc:.3f}", flush=True)
    run.finish()


if __name__ == "__main__":
    main()
