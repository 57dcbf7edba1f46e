"""Regenerates the event files in this directory (run in a venv with torch and tensorboardX):

    python -m venv .bench/tb-venv && .bench/tb-venv/bin/pip install torch==2.13.0 tensorboardX
    .bench/tb-venv/bin/python tests/data/tb/make_fixtures.py

Each writer gets its own subdirectory. Every scalar series is value = step / 10 + k for the
k-th tag, steps 0..4, so tests can check exact values. Alongside the scalars each writer also
writes a histogram, an image and a text summary, which must not come out as points.
"""
import glob
import os
import shutil

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TAGS = ["loss", "train/acc"]


def fresh(name):
    d = os.path.join(HERE, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    return d


def write(w, **scalar_kw):
    img = np.zeros((3, 4, 4), dtype=np.uint8)
    for step in range(5):
        for k, tag in enumerate(TAGS):
            w.add_scalar(tag, step / 10 + k, step, **scalar_kw)
    w.add_histogram("weights", np.arange(10.0), 0)
    w.add_image("sample", img, 0)
    w.add_text("notes", "hello", 0)
    w.close()


def main():
    from torch.utils.tensorboard import SummaryWriter as TorchWriter
    import tensorboardX

    write(TorchWriter(fresh("torch")))                          # v1 simple_value
    write(TorchWriter(fresh("torch_new_style")), new_style=True)  # v2 tensor + "scalars" metadata
    write(tensorboardX.SummaryWriter(fresh("tensorboardx")))
    for f in glob.glob(os.path.join(HERE, "*", "*tfevents*")):
        print(os.path.getsize(f), os.path.relpath(f, HERE))


if __name__ == "__main__":
    main()
