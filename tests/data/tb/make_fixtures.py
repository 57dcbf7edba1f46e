"""Regenerates the event files in this directory (run in a venv with torch and tensorboardX):

    python -m venv .bench/tb-venv && .bench/tb-venv/bin/pip install torch==2.13.0 tensorboardX tensorboard
    .bench/tb-venv/bin/python tests/data/tb/make_fixtures.py
    python -m venv .bench/tf-venv && .bench/tf-venv/bin/pip install tensorflow-cpu   # 2.21.0, keras 3.15
    .bench/tf-venv/bin/python tests/data/tb/make_fixtures.py tf

Each writer gets its own subdirectory. Every scalar series is value = step / 10 + k for the
k-th tag, steps 0..4, so tests can check exact values. Alongside the scalars each writer also
writes a histogram, an image and a text summary, which must not come out as points.
"""
import glob
import os
import shutil
import sys

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


def main_tf():
    import tensorflow as tf

    # tf.summary: float32 in tensor_content, "scalars" metadata with a tag's first value only.
    w = tf.summary.create_file_writer(fresh("tf2"))
    with w.as_default():
        for step in range(5):
            for k, tag in enumerate(TAGS):
                tf.summary.scalar(tag, step / 10 + k, step=step)
        tf.summary.histogram("weights", tf.range(10.0), step=0)
        tf.summary.image("sample", tf.zeros((1, 4, 4, 3)), step=0)
        tf.summary.text("notes", "hello", step=0)
    w.close()

    # Keras's callback: logs/train and logs/validation, epoch_loss in each, plus histograms.
    tf.keras.utils.set_random_seed(0)
    x = np.linspace(0, 1, 32, dtype="float32").reshape(-1, 1)
    model = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, 2 * x, validation_data=(x, 2 * x), epochs=3, verbose=0, callbacks=[
        tf.keras.callbacks.TensorBoard(fresh("keras"), histogram_freq=1, write_graph=False,
                                       profile_batch=0)])


def main():
    if sys.argv[1:] == ["tf"]:
        main_tf()
        return
    from torch.utils.tensorboard import SummaryWriter as TorchWriter
    import tensorboardX

    write(TorchWriter(fresh("torch")))                          # v1 simple_value
    write(TorchWriter(fresh("torch_new_style")), new_style=True)  # v2 tensor + "scalars" metadata
    write(tensorboardX.SummaryWriter(fresh("tensorboardx")))


def report():
    for f in glob.glob(os.path.join(HERE, "**", "*tfevents*"), recursive=True):
        print(os.path.getsize(f), os.path.relpath(f, HERE))


if __name__ == "__main__":
    main()
    report()
