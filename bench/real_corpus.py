"""A corpus of REAL training runs, labelled by construction, for scoring GPUPlane's judgements.

Trains small models with torch on CPU — MLPs on Gaussian mixtures, CNNs on small images of
shapes, LSTMs on token sequences with a counting rule, tiny causal transformers on a
sequence whose next token follows from the two before — under Adam and SGD with constant,
step, warm-up + cosine, SGDR (warm restarts) and one-cycle schedules, across learning
rates, batch sizes and seeds. Problems are injected by construction:

  spike         one corrupted batch (labels scrambled, inputs blown up) at a known step
  lr_burst      the learning rate x30 for a few steps, then back
  nan           a batch with a NaN in it: the loss and every weight become NaN
  diverged      a learning rate far too high: the loss ends far above its start, finite
  overfit       a tiny training set and a big model: eval loss turns up while train falls
  not_learning  learning rate 0, far too small, or labels shuffled against the inputs
  stall         the process hangs after some step (see below)
  healthy       everything else: as many as the problem runs together

Each run logs what a training script logs: train/loss (and the learning rate) every step,
eval/loss and eval/acc once per epoch, with the wall-clock time of every point. A stall is
the one thing not trained for real: the run's points stop at a step and its observation
time ("now") is set `hang_s` after the last point (a hang costs no CPU to describe).

Every label is checked against the recorded values (a spike run really has a spike in its
curve, a diverged run really ends far above its start, ...); a run whose check fails is
dropped and counted, never relabelled. The result is one compressed file read by the
benchmark (bench/judgement.py) and the tests without torch:

    .venv/bin/pip install torch==2.13.0      # for this script only, never a runtime dependency
    nice .venv/bin/python bench/real_corpus.py --out bench/data/real_runs.json.gz

Each run gets a half, "tune" or "holdout", fixed by its name (stratified by label), so a
rerun keeps the split. torch runs single-threaded: the machine is shared.
"""
import argparse
import gzip
import hashlib
import json
import math
import pathlib
import sys
import time

SCHEMA = 1


# -- data ---------------------------------------------------------------------------------------

def make_data(torch, task, seed, n_train, n_eval, label_noise=0.0, shuffle_labels=False):
    """(x_train, y_train, x_eval, y_eval, n_classes, kind): all generated, nothing read."""
    g = torch.Generator().manual_seed(1000 + seed)
    n = n_train + n_eval
    if task in ("mlp", "mlp_wide"):
        k, d = 8, 16
        centres = torch.randn(k, d, generator=g) * 0.55
        y = torch.randint(0, k, (n,), generator=g)
        x = centres[y] + torch.randn(n, d, generator=g)
        kind = "class"
    elif task == "cnn":
        k, side = 4, 12
        y = torch.randint(0, k, (n,), generator=g)
        x = torch.randn(n, 1, side, side, generator=g) * 0.6
        ii = torch.arange(side).float()
        for i in range(n):
            cx, cy = torch.randint(3, side - 3, (2,), generator=g).tolist()
            c = int(y[i])
            if c == 0:      # a filled square
                x[i, 0, cy - 2:cy + 2, cx - 2:cx + 2] += 1.5
            elif c == 1:    # a cross
                x[i, 0, cy, :] += 1.2
                x[i, 0, :, cx] += 1.2
            elif c == 2:    # a ring
                r = ((ii[None, :] - cx) ** 2 + (ii[:, None] - cy) ** 2).sqrt()
                x[i, 0] += 1.5 * ((r > 1.5) & (r < 3.0)).float()
            else:           # a diagonal line
                for t in range(-3, 4):
                    if 0 <= cy + t < side and 0 <= cx + t < side:
                        x[i, 0, cy + t, cx + t] += 1.8
        kind = "class"
    elif task == "lstm":
        k, vocab, length = 4, 6, 16
        x = torch.randint(0, vocab, (n, length), generator=g)
        # the label: which of tokens 0..3 occurs most often (ties to the lowest)
        counts = torch.stack([(x == t).sum(1) for t in range(k)], 1)
        y = counts.argmax(1)
        label_noise = max(label_noise, 0.1)     # else it learns to a loss of 0.002
        kind = "class"
    elif task == "transformer":
        vocab, length = 11, 16
        first = torch.randint(0, vocab, (n, 2), generator=g)
        seq = [first[:, 0], first[:, 1]]
        for _ in range(length - 1):
            seq.append((seq[-1] + seq[-2]) % vocab)
        full = torch.stack(seq, 1)
        x, y = full[:, :-1], full[:, 1:]
        k = vocab
        kind = "lm"
    else:
        raise ValueError(task)
    if label_noise and kind == "class":
        flip = torch.rand(n, generator=g) < label_noise
        y = torch.where(flip, torch.randint(0, k, (n,), generator=g), y)
    if shuffle_labels:
        y = y[torch.randperm(n, generator=g)]
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:], k, kind


def make_model(torch, task, k, seed, width=1.0):
    nn = torch.nn
    torch.manual_seed(seed)
    if task == "mlp":
        h = int(64 * width)
        return nn.Sequential(nn.Linear(16, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
                             nn.Linear(h, k))
    if task == "mlp_wide":
        h = int(256 * width)
        return nn.Sequential(nn.Linear(16, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
                             nn.Linear(h, h), nn.ReLU(), nn.Linear(h, k))
    if task == "cnn":
        c = int(8 * width)
        return nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(2 * c * 9, k))
    if task == "lstm":
        return LSTMClassifier(torch, 6, int(32 * width), k)
    if task == "transformer":
        return TinyTransformer(torch, k, int(32 * width))
    raise ValueError(task)


def LSTMClassifier(torch, vocab, h, k):
    nn = torch.nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, 16)
            self.rnn = nn.LSTM(16, h, batch_first=True)
            self.out = nn.Linear(h, k)

        def forward(self, x):
            o, _ = self.rnn(self.emb(x))
            return self.out(o[:, -1])
    return M()


def TinyTransformer(torch, vocab, d):
    nn = torch.nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.randn(1, 32, d) * 0.1)
            layer = nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
            self.out = nn.Linear(d, vocab)

        def forward(self, x):
            n = x.shape[1]
            mask = torch.triu(torch.full((n, n), float("-inf")), 1)
            return self.out(self.enc(self.emb(x) + self.pos[:, :n], mask=mask))
    return M()


# -- schedules ----------------------------------------------------------------------------------

def lr_at(sched, lr, t, total):
    """The learning rate at step t (0-based) of `total` under the named schedule."""
    if sched == "constant":
        return lr
    if sched == "step":
        return lr * 0.1 ** (t >= total // 2) * 0.1 ** (t >= 3 * total // 4)
    if sched == "cosine":        # linear warm-up for 10%, then cosine to 0
        w = max(1, total // 10)
        if t < w:
            return lr * (t + 1) / w
        return lr * 0.5 * (1 + math.cos(math.pi * (t - w) / max(1, total - w)))
    if sched == "sgdr":          # cosine with warm restarts, cycles doubling
        c, start = max(1, total // 7), 0
        while t >= start + c:
            start += c
            c *= 2
        return lr * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * (t - start) / c)))
    if sched == "onecycle":      # up for 30%, down to 1/1000 after
        up = max(1, int(0.3 * total))
        if t < up:
            return lr * (0.04 + 0.96 * t / up)
        return lr * (0.001 + 0.999 * 0.5 * (1 + math.cos(math.pi * (t - up) / (total - up))))
    raise ValueError(sched)


# -- one run ------------------------------------------------------------------------------------

def train(torch, spec):
    """Train one run from its spec; the recorded curves as plain lists."""
    task, seed = spec["task"], spec["seed"]
    xtr, ytr, xev, yev, k, kind = make_data(
        torch, task, seed, spec["n_train"], spec.get("n_eval", 512),
        label_noise=spec.get("label_noise", 0.0),
        shuffle_labels=spec.get("shuffle_labels", False))
    model = make_model(torch, task, k, seed, spec.get("width", 1.0))
    params = list(model.parameters())
    if spec["opt"] == "adam":
        opt = torch.optim.Adam(params, lr=spec["lr"], weight_decay=spec.get("wd", 0.0))
    else:
        opt = torch.optim.SGD(params, lr=spec["lr"], momentum=0.9,
                              weight_decay=spec.get("wd", 0.0))
    lossf = torch.nn.CrossEntropyLoss()
    bs, epochs = spec["batch"], spec["epochs"]
    per_epoch = max(1, math.ceil(len(xtr) / bs))
    total = per_epoch * epochs
    g = torch.Generator().manual_seed(seed)
    inj = spec.get("inject") or {}
    train_loss, lrs, ts = [], [], []
    ev_steps, ev_loss, ev_acc, ev_ts = [], [], [], []
    t0 = time.monotonic()
    step = 0

    def logits_loss(xb, yb):
        out = model(xb)
        if kind == "lm":
            return out, lossf(out.reshape(-1, k), yb.reshape(-1))
        return out, lossf(out, yb)

    for epoch in range(epochs):
        model.train()
        perm = torch.randperm(len(xtr), generator=g)
        for b in range(per_epoch):
            idx = perm[b * bs:(b + 1) * bs]
            if len(idx) == 0:
                continue
            xb, yb = xtr[idx], ytr[idx]
            step += 1
            cur = lr_at(spec["sched"], spec["lr"], step - 1, total)
            if inj.get("kind") == "lr_burst" and inj["step"] <= step < inj["step"] + inj["len"]:
                cur = cur * inj["factor"]
            for group in opt.param_groups:
                group["lr"] = cur
            if inj.get("kind") == "spike" and step == inj["step"]:
                # a corrupted batch: scrambled labels and inputs blown up
                yb = yb[torch.randperm(len(yb), generator=g)]
                if xb.is_floating_point():
                    xb = xb * inj.get("scale", 8.0)
                else:
                    yb = torch.randint(0, k, yb.shape, generator=g)
            if inj.get("kind") == "nan" and step == inj["step"]:
                if xb.is_floating_point():
                    xb = xb.clone()
                    xb.view(-1)[0] = float("nan")
                else:
                    with torch.no_grad():
                        model.emb.weight[0, 0] = float("nan")
            _, loss = logits_loss(xb, yb)
            opt.zero_grad()
            loss.backward()
            if spec.get("clip"):
                torch.nn.utils.clip_grad_norm_(params, spec["clip"])
            opt.step()
            train_loss.append(loss.item())
            lrs.append(cur)
            ts.append(round((time.monotonic() - t0) * 1000, 1))
        model.eval()
        with torch.no_grad():
            out, loss = logits_loss(xev, yev)
            pred = out.argmax(-1)
            acc = float((pred == yev).float().mean())
        ev_steps.append(step)
        ev_loss.append(float(loss))
        ev_acc.append(acc)
        ev_ts.append(round((time.monotonic() - t0) * 1000, 1))
    return {"train_loss": train_loss, "lr": lrs, "ts": ts, "eval_steps": ev_steps,
            "eval_loss": ev_loss, "eval_acc": ev_acc, "eval_ts": ev_ts,
            "chance_loss": math.log(k), "chance_acc": 1.0 / k,
            "wall_s": round(time.monotonic() - t0, 2)}


# -- the label checks ---------------------------------------------------------------------------

def _med(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def check(spec, rec):
    """(ok, why): the label as the recorded values show it."""
    label = spec["label"]
    tl = rec["train_loss"]
    fin = [v for v in tl if math.isfinite(v)]
    n = len(tl)
    start = _med(tl[:3]) if all(map(math.isfinite, tl[:3])) else None
    if label == "nan":
        bad = [i for i, v in enumerate(tl) if not math.isfinite(v)]
        return (bool(bad), f"first non-finite train loss at step {bad[0] + 1}" if bad
                else "no non-finite train loss")
    if len(fin) != n or not all(map(math.isfinite, rec["eval_loss"])):
        return False, "a non-finite value in a run not labelled nan"
    end = _med(tl[-max(3, n // 10):])
    ev = rec["eval_loss"]
    if label == "diverged":
        first = tl[0]      # the loss before any update
        ok = end > 3 * first and end > first + 2.0
        return ok, f"train loss {first:.3g} at step 1, {end:.3g} at the end"
    if label == "not_learning":
        chance = rec["chance_loss"]
        ok = end > 0.93 * start and end > 0.9 * chance and max(rec["eval_acc"]) < \
            rec["chance_acc"] + 0.12
        return ok, (f"train loss {start:.3g} at first, {end:.3g} at the end (chance "
                    f"{chance:.3g}); best eval acc {max(rec['eval_acc']):.3f}")
    learned = end < 0.7 * start
    if not learned:
        return False, f"did not learn: train loss {start:.3g} at first, {end:.3g} at the end"
    if label in ("spike", "lr_burst"):
        s = spec["inject"]["step"]
        i0 = s - 1
        span = range(i0, min(n, i0 + (spec["inject"].get("len", 1) + 6)))
        before = tl[max(0, i0 - 20):i0]
        lvl = _med(before)
        top = max(tl[j] for j in span)
        ok = top > 2.5 * lvl and top > lvl + 0.5
        after = _med(tl[-max(3, n // 10):])
        ok = ok and after < 1.5 * lvl + 0.05 or (ok and after < 0.7 * start)
        return ok, (f"train loss {top:.3g} after step {s} against {lvl:.3g} in the 20 steps "
                    f"before; {after:.3g} at the end")
    if label == "overfit":
        i = min(range(len(ev)), key=ev.__getitem__)
        ok = ev[-1] > 1.25 * ev[i] and i < len(ev) - 3 and end < 0.5 * start
        return ok, (f"eval loss best {ev[i]:.3g} after epoch {i + 1}, {ev[-1]:.3g} at the "
                    f"end (epoch {len(ev)}); train loss {start:.3g} -> {end:.3g}")
    if label == "stall":
        return True, f"points stop at step {spec['stop_step']}; observed {spec['hang_s']} s later"
    if label == "healthy":
        i = min(range(len(ev)), key=ev.__getitem__)
        ok = ev[-1] < 1.15 * ev[i] + 0.02 and ev[-1] < 0.85 * rec["chance_loss"]
        # no accidental spike: no point 3x the median of the 20 before it, after warm-up
        spikes = [j for j in range(30, n) if tl[j] > 3 * _med(tl[j - 20:j]) + 0.3]
        ok = ok and not spikes
        return ok, (f"train loss {start:.3g} -> {end:.3g}; eval loss best {ev[i]:.3g}, end "
                    f"{ev[-1]:.3g}" + (f"; an accidental spike at step {spikes[0] + 1}"
                                       if spikes else ""))
    return False, f"unknown label {label}"


# -- the specs ----------------------------------------------------------------------------------

# a learning rate that trains well per (task, optimiser)
GOOD_LR = {("mlp", "adam"): 3e-3, ("mlp", "sgd"): 0.05, ("cnn", "adam"): 3e-3,
           ("cnn", "sgd"): 0.05, ("lstm", "adam"): 1e-2, ("lstm", "sgd"): 0.5,
           ("transformer", "adam"): 3e-3, ("transformer", "sgd"): 0.1,
           ("mlp_wide", "adam"): 1e-3, ("mlp_wide", "sgd"): 0.05}
N_TRAIN = {"mlp": 4096, "cnn": 1536, "lstm": 3072, "transformer": 1536, "mlp_wide": 4096}
EPOCHS = {"mlp": 10, "cnn": 8, "lstm": 10, "transformer": 8, "mlp_wide": 8}
TASKS = ("mlp", "cnn", "lstm", "transformer")
SCHEDS = ("constant", "step", "cosine", "sgdr", "onecycle")


def specs():
    out = []

    def add(label, task, opt, sched, lr_mult=1.0, batch=32, seed=0, **kw):
        base = GOOD_LR[(task, opt)]
        s = {"label": label, "task": task, "opt": opt, "sched": sched,
             "lr": base * lr_mult, "batch": batch, "seed": seed,
             "n_train": N_TRAIN[task], "epochs": EPOCHS[task]}
        s.update(kw)
        s["name"] = (f"{label}-{task}-{opt}-{sched}-lr{s['lr']:.3g}-b{batch}-s{seed}"
                     + "".join(f"-{k}" for k in sorted(kw) if k not in ("inject",)))
        out.append(s)

    # healthy: every task x optimiser x schedule, a spread of good learning rates and batches
    i = 0
    for task in TASKS:
        for opt in ("adam", "sgd"):
            for sched in SCHEDS:
                mult = (0.3, 1.0, 2.0)[i % 3]
                batch = (32, 64, 16)[(i // 3) % 3]
                add("healthy", task, opt, sched, mult, batch, seed=i % 5)
                i += 1
    # more healthy runs: other seeds, a wide MLP, gradient clipping, weight decay
    for j, (task, opt, sched) in enumerate((
            ("mlp_wide", "adam", "cosine"), ("mlp_wide", "sgd", "step"),
            ("mlp_wide", "adam", "onecycle"), ("mlp", "adam", "sgdr"), ("cnn", "adam", "cosine"),
            ("lstm", "adam", "onecycle"), ("transformer", "adam", "step"),
            ("mlp", "sgd", "cosine"), ("cnn", "sgd", "sgdr"), ("lstm", "sgd", "constant"),
            ("transformer", "adam", "onecycle"), ("mlp", "adam", "constant"))):
        extra = ({"clip": 1.0}, {"wd": 1e-4}, {})[j % 3]
        add("healthy", task, opt, sched, (0.5, 1.0, 1.5)[j % 3], (32, 128, 64)[j % 3],
            seed=100 + j, **extra)
    # a third set of healthy runs (made after the first pass dropped 10 of its healthy runs)
    for j, (task, opt, sched, mult, batch) in enumerate((
            ("mlp", "adam", "cosine", 1.0, 64), ("mlp", "adam", "step", 0.5, 32),
            ("mlp", "sgd", "onecycle", 1.0, 32), ("cnn", "adam", "step", 1.0, 64),
            ("cnn", "adam", "sgdr", 0.5, 32), ("cnn", "adam", "onecycle", 1.0, 64),
            ("transformer", "adam", "constant", 1.0, 32), ("transformer", "adam", "cosine", 1.5, 64),
            ("transformer", "adam", "sgdr", 1.0, 32), ("lstm", "adam", "cosine", 0.5, 32),
            ("lstm", "adam", "step", 0.5, 64), ("lstm", "adam", "sgdr", 0.3, 32),
            ("mlp_wide", "adam", "constant", 0.5, 64), ("mlp_wide", "adam", "sgdr", 1.0, 64),
            ("mlp", "sgd", "cosine", 0.5, 64), ("cnn", "sgd", "cosine", 0.5, 64),
            ("mlp", "adam", "onecycle", 2.0, 32), ("transformer", "adam", "onecycle", 1.0, 32))):
        add("healthy", task, opt, sched, mult, batch, seed=200 + j, extra=1)
    # spikes: a corrupted batch at a step from early to late
    i = 0
    for task in TASKS:
        for opt, sched in (("adam", "cosine"), ("sgd", "step"), ("adam", "sgdr")):
            frac = (0.3, 0.55, 0.8)[i % 3]
            steps = math.ceil(N_TRAIN[task] / 32) * EPOCHS[task]
            add("spike", task, opt, sched, 1.0, 32, seed=10 + i,
                inject={"kind": "spike", "step": int(frac * steps), "scale": 10.0})
            i += 1
    # learning-rate bursts: x30 for 4 steps
    for j, (task, opt, sched) in enumerate((("mlp", "sgd", "constant"), ("cnn", "sgd", "cosine"),
                                            ("lstm", "sgd", "step"), ("mlp", "adam", "onecycle"),
                                            ("cnn", "adam", "constant"),
                                            ("transformer", "sgd", "cosine"))):
        steps = math.ceil(N_TRAIN[task] / 32) * EPOCHS[task]
        add("lr_burst", task, opt, sched, 1.0, 32, seed=20 + j,
            inject={"kind": "lr_burst", "step": int((0.4 + 0.08 * j) * steps), "len": 4,
                    "factor": 30.0})
    # NaN
    for j, (task, opt, sched) in enumerate((("mlp", "adam", "constant"), ("cnn", "sgd", "cosine"),
                                            ("lstm", "adam", "sgdr"),
                                            ("transformer", "adam", "cosine"),
                                            ("mlp", "sgd", "step"), ("cnn", "adam", "onecycle"))):
        steps = math.ceil(N_TRAIN[task] / 32) * EPOCHS[task]
        add("nan", task, opt, sched, 1.0, 32, seed=30 + j,
            inject={"kind": "nan", "step": int((0.2 + 0.1 * j) * steps)})
    # finite divergence: the learning rate far too high
    for j, (task, opt, sched, mult, clip) in enumerate((
            ("mlp", "sgd", "constant", 400.0, 1.0), ("cnn", "sgd", "constant", 400.0, 1.0),
            ("lstm", "sgd", "constant", 20.0, None), ("lstm", "sgd", "step", 20.0, None),
            ("cnn", "sgd", "cosine", 400.0, 1.0), ("transformer", "sgd", "constant", 200.0, 1.0),
            ("cnn", "sgd", "onecycle", 600.0, 1.0), ("lstm", "sgd", "onecycle", 30.0, None),
            ("mlp_wide", "sgd", "constant", 200.0, 1.0), ("mlp", "sgd", "sgdr", 400.0, 1.0))):
        add("diverged", task, opt, sched, mult, 32, seed=40 + j, **({"clip": clip} if clip else {}))
    # a second pass (the first dropped half of its diverged and learning-rate burst runs)
    for j, (task, opt, sched, mult, clip) in enumerate((
            ("cnn", "sgd", "step", 400.0, 1.0), ("transformer", "sgd", "cosine", 200.0, 1.0),
            ("mlp", "sgd", "cosine", 400.0, 1.0), ("mlp_wide", "sgd", "step", 200.0, 1.0),
            ("lstm", "sgd", "constant", 20.0, None), ("transformer", "sgd", "step", 200.0, 1.0))):
        add("diverged", task, opt, sched, mult, 32, seed=140 + j,
            **({"clip": clip} if clip else {}))
    for j, (task, opt, sched) in enumerate((("mlp", "sgd", "cosine"),
                                            ("transformer", "adam", "constant"),
                                            ("mlp", "adam", "constant"), ("lstm", "adam", "cosine"),
                                            ("transformer", "sgd", "step"))):
        steps = math.ceil(N_TRAIN[task] / 32) * EPOCHS[task]
        add("lr_burst", task, opt, sched, 1.0, 32, seed=150 + j,
            inject={"kind": "lr_burst", "step": int((0.35 + 0.1 * j) * steps), "len": 4,
                    "factor": 30.0})
    # overfitting: a tiny training set, a wide model, many epochs
    for j, (opt, sched, n_train) in enumerate((("adam", "constant", 64), ("adam", "cosine", 96),
                                               ("sgd", "constant", 64), ("adam", "step", 128),
                                               ("sgd", "sgdr", 96), ("adam", "onecycle", 64))):
        add("overfit", "mlp_wide", opt, sched, 1.0, 16, seed=50 + j,
            n_train=n_train, epochs=60, label_noise=0.3)
    # not learning: lr 0, far too small, labels shuffled
    for j, (task, opt, sched, mult, shuf) in enumerate((
            ("mlp", "adam", "constant", 0.0, False), ("cnn", "sgd", "cosine", 1e-4, False),
            ("lstm", "adam", "constant", 1.0, True), ("transformer", "sgd", "constant", 0.0, False),
            ("mlp", "sgd", "step", 1.0, True), ("cnn", "adam", "constant", 1e-4, False),
            ("lstm", "sgd", "cosine", 1e-4, False))):
        add("not_learning", task, opt, sched, mult, 64, seed=60 + j,
            **({"shuffle_labels": True} if shuf else {}))
    # stalls: a healthy run whose points stop
    for j, (task, opt, sched) in enumerate((("mlp", "adam", "cosine"), ("cnn", "sgd", "step"),
                                            ("lstm", "adam", "constant"),
                                            ("transformer", "adam", "sgdr"))):
        add("stall", task, opt, sched, 1.0, 32, seed=70 + j, stop_frac=0.5 + 0.1 * j,
            hang_s=900)
    return out


def fresh_specs(k):
    """The same generator with new seeds (+1000*k): a fresh part, never seen while tuning.
    Every 2nd healthy spec and every 3rd problem spec of each label, so at least as many
    healthy runs as problem runs and about 50 in all."""
    out, seen = [], {}
    for s in specs():
        i = seen.get(s["label"], 0)
        seen[s["label"]] = i + 1
        if i % (2 if s["label"] == "healthy" else 3):
            continue
        s = dict(s)
        s["name"] = s["name"].replace(f"-s{s['seed']}", f"-s{s['seed'] + 1000 * k}", 1)
        s["seed"] += 1000 * k
        out.append(s)
    return out


def half_of(name, label, names_of_label):
    """'tune' or 'holdout': within a label, runs sorted by a hash of their name alternate."""
    order = sorted(names_of_label, key=lambda n: hashlib.sha256(n.encode()).hexdigest())
    return "tune" if order.index(name) % 2 == 0 else "holdout"


def _round(v):
    if not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    return float(f"{v:.5g}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "data" /
                                         "real_runs.json.gz"))
    ap.add_argument("--only", help="run only specs whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the specs and exit")
    ap.add_argument("--merge", help="add the runs to this corpus file (those not in it yet)")
    ap.add_argument("--fresh", type=int, metavar="K",
                    help="a fresh part: every seed + 1000*K, every 2nd healthy spec and every "
                         "3rd problem spec of each label, all in half 'fresh' (a part nobody "
                         "tuned on: bench/data/real_runs_fresh.json.gz is K=1, "
                         "real_runs_fresh2.json.gz K=2)")
    args = ap.parse_args()
    todo = [s for s in (fresh_specs(args.fresh) if args.fresh else specs())
            if not args.only or args.only in s["name"]]
    if args.list:
        for s in todo:
            print(s["name"])
        print(len(todo), "runs")
        return 0
    import torch
    torch.set_num_threads(1)
    runs, dropped = [], []
    if args.merge:
        with gzip.open(args.merge, "rt") as f:
            old = json.load(f)
        runs, dropped = old["runs"], old["dropped"]
        seen = {r["name"] for r in runs} | {d["name"] for d in dropped}
        todo = [s for s in todo if s["name"] not in seen]
    t_all = time.monotonic()
    for i, spec in enumerate(todo):
        rec = train(torch, spec)
        if spec["label"] == "stall":
            stop = int(spec.pop("stop_frac") * len(rec["train_loss"]))
            spec["stop_step"] = stop
            last_ts = rec["ts"][stop - 1]
            rec["train_loss"], rec["lr"], rec["ts"] = (rec["train_loss"][:stop],
                                                      rec["lr"][:stop], rec["ts"][:stop])
            keep = [j for j, s in enumerate(rec["eval_steps"]) if s <= stop]
            for key in ("eval_steps", "eval_loss", "eval_acc", "eval_ts"):
                rec[key] = [rec[key][j] for j in keep]
            spec["now_ms"] = last_ts + spec["hang_s"] * 1000
        ok, why = check(spec, rec)
        print(f"[{i + 1}/{len(todo)}] {spec['name']}: {'ok' if ok else 'DROPPED'} — {why} "
              f"({rec['wall_s']} s)", flush=True)
        if not ok:
            dropped.append({"name": spec["name"], "why": why})
            continue
        run = dict(spec)
        run["check"] = why
        run.update({k: v for k, v in rec.items() if k not in ("train_loss", "eval_loss",
                                                              "eval_acc")})
        run["train_loss"] = [_round(v) for v in rec["train_loss"]]
        run["eval_loss"] = [_round(v) for v in rec["eval_loss"]]
        run["eval_acc"] = [_round(v) for v in rec["eval_acc"]]
        run["lr"] = [float(f"{v:.4g}") for v in rec["lr"]]
        runs.append(run)
    by_label = {}
    for r in runs:
        by_label.setdefault(r["label"], []).append(r["name"])
    for r in runs:
        r["half"] = ("fresh" if args.fresh else
                     half_of(r["name"], r["label"], by_label[r["label"]]))
    data = {"schema": SCHEMA, "generator": "bench/real_corpus.py",
            "torch": torch.__version__, "runs": runs, "dropped": dropped,
            "wall_s": round(time.monotonic() - t_all, 1)}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with gzip.open(tmp, "wt", compresslevel=9) as f:
        json.dump(data, f, separators=(",", ":"))
    tmp.replace(out)
    counts = {k: len(v) for k, v in sorted(by_label.items())}
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB): {len(runs)} runs {counts}, "
          f"{len(dropped)} dropped, {data['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
