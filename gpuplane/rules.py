"""The detection rules of the event engine: pure, deterministic, no I/O, no clock.

Each rule is a small state machine fed one series at a time (`push`/`extend`), so the
engine (gpuplane/events.py) runs it on points as they arrive and bench/event_corpus.py
runs the very same code on whole labelled curves. A finding is a plain dict:
{"type", "severity", "step", "message", "evidence"}; the engine adds run/job/node,
debounces and stores it. Defaults and their meaning are in docs/events.md.
"""
import math
import operator
import re
from collections import deque
from statistics import median

from . import vocab

INFO, WARNING, CRITICAL = "info", "warning", "critical"
SEVERITIES = (INFO, WARNING, CRITICAL)
# The event types the rules file (docs/events.md, "The rules"): what a job's stop_on and
# a webhook's types may name besides the lifecycle's.
TYPES = ("LOSS_NAN", "OOM", "DISK_LOW", "LOSS_SPIKE", "LOSS_DIVERGED",
         "OVERFITTING_SUSPECTED", "GPU_UNDERUTILIZED", "STALLED")

# Every setting of the rules, with its default; `[events]` in server.toml overrides them.
DEFAULTS = {
    "debounce_s": 600,            # one event per run and type per this many seconds
    "spike_window": 64,           # LOSS_SPIKE: finite points the median/MAD look back on
    "spike_min_points": 128,      # ... and how many it needs first (warm-up is skipped)
    "spike_z": 8.0,               # ... robust z: (x - median) / (1.4826 * MAD)
    "spike_min_ratio": 0.6,       # ... and x at least this much above the median (0.6 = +60%)
    "spike_lr_grace": 50,         # ... no spike this many steps after the logged LR rose;
    "spike_lr_grace_cycles": 1.0, # ... then, until it decays back to its level before the rise
                                  #     (at most this x the steps since the previous rise), the
                                  #     noise test alone (not "above its first values")
    "diverge_window": 16,         # LOSS_DIVERGED: the recent level is the median of this many
    "diverge_ratio": 1.5,         # ... and it is this many times the first level (3 points)
    "diverge_min_points": 32,     # ... once this many finite points are in
    "spike_burst": 3.0,           # ... an LR rise beyond this x its earlier max is a burst, no grace
    "spike_start_ratio": 1.1,     # ... or: x above this x the key's first level (its first 3) ...
    "spike_start_jump": 2.5,      # ... and this x its recent median
    "spike_warmup_points": 64,    # ... in warm-up (from here to spike_min_points) only a jump
    "spike_warmup_jump": 4.0,     # ... above the first level and this x the recent median
    "spike_burst_steps": 20,      # ... within this many steps after an LR burst ...
    "spike_burst_z": 1.5,         # ... this robust z ...
    "spike_burst_ratio": 1.0,     # ... and this much above the median (1.0 = twice) suffice
    "overfit_min_evals": 6,       # OVERFITTING_SUSPECTED: eval points needed first
    "overfit_patience": 3,        # ... evals in a row worse than the best (smoothed)
    "overfit_worse": 0.2,         # ... by at least this fraction of the best
    "overfit_train_better": 0.02, # ... while train improved by at least this fraction
    "gpu_util_below": 15.0,       # GPU_UNDERUTILIZED: mean utilisation under this (%)
    "gpu_window_s": 600,          # ... over this long a window
    "gpu_grace_s": 300,           # ... not in the job's first this-many seconds
    "stall_factor": 10.0,         # STALLED: silent for this many times the usual interval
    "stall_min_s": 120,           # ... and at least this long
    "stall_min_intervals": 5,     # ... once this many intervals are known
    "disk_low_mb": 2048,          # DISK_LOW: free space below this (MiB), warning
    "disk_critical_mb": 512,      # ... below this, critical
}

# What a key means (loss-like, system, eval or train, direction) is gpuplane/vocab.py's.
words = vocab.words
is_system = vocab.is_system
is_loss = vocab.is_loss


def eval_pair(key):
    """(role, base) for OVERFITTING_SUSPECTED: role 'eval' or 'train', base the key without
    its split words, so "train/loss", "loss" and "eval/loss", "val_loss" share base "loss"."""
    if vocab.is_system(key):
        return None, None
    return ("eval" if vocab.is_eval(key) else "train"), vocab.base(key)


def finding(type, severity, step, message, **evidence):
    return {"type": type, "severity": severity, "step": step, "message": message,
            "evidence": evidence}


def _fmt(x):
    if isinstance(x, float) and math.isfinite(x):
        return f"{x:.4g}"
    return str(x)


# -- LOSS_NAN ---------------------------------------------------------------------------

def nonfinite(key, steps, values):
    """LOSS_NAN for the first NaN or ±inf among a batch of a loss-like key, or None.
    The sum of finite floats is finite, so clean batches cost one C-level pass."""
    if _finite_sum(values):
        return None
    for s, v in zip(steps, values):
        if not math.isfinite(v):
            return finding("LOSS_NAN", CRITICAL, s,
                           f"{key} became {_fmt(v)} at step {s}: training has diverged or "
                           f"hit a numerical error; later updates are likely garbage",
                           key=key, value=str(v))
    return None


def _finite_sum(values):
    try:
        return math.isfinite(sum(values))
    except OverflowError:
        return False


# -- LOSS_SPIKE -------------------------------------------------------------------------

class LrTrack:
    """The run's logged learning rate as the spike rule needs it: a rise of more than a
    fifth marks a restart (warm-up, a warm restart), unless it goes beyond `spike_burst` x
    the highest rate seen before: a burst, whose spikes are the very thing to report. One
    per run, fed before the run's losses of the same batch, so what the rule knows of the
    rate at a step never depends on how the points were batched."""

    def __init__(self, cfg=DEFAULTS):
        self.last = None
        self.max = 0.0
        self.burst = float(cfg.get("spike_burst", DEFAULTS["spike_burst"]))
        self.cycles = float(cfg.get("spike_lr_grace_cycles", DEFAULTS["spike_lr_grace_cycles"]))
        self.rises = deque(maxlen=64)    # steps at which the learning rate went up
        self.bursts = deque(maxlen=16)   # ... beyond `burst` x its earlier max: a burst
        # A restart's allowance: [rise step, last step of it, rate before the rise]. It
        # lasts until the rate has decayed back to where it was before the rise (a warm
        # restart's cosine: the loss rises and comes down with it), at most `cycles` x the
        # steps since the previous rise (or the first logged rate); the rule adds its own
        # fixed `spike_lr_grace` before it. Within it, Spike judges by the noise test alone.
        self.graces = deque(maxlen=64)
        self.open = []                   # graces whose rate has not decayed back yet
        self.first_step = None

    def points(self, steps, values):
        if not values:
            return
        if self.first_step is None:
            self.first_step = steps[0]
        first_ok = self.last is None or not values[0] > 1.2 * self.last
        if self.open:
            self.open = [g for g in self.open if g[1] > steps[0]]   # past their cap
        if self.open and not min(values) > max(g[2] for g in self.open):
            first_ok = False                 # an allowance ends in this batch: step by step
        # a decaying or constant rate (nearly always): one C-level pass, no loop
        if first_ok and not any(map(operator.gt, values[1:],
                                    map((1.2).__mul__, values[:-1]))):
            v = values[-1]
            if math.isfinite(v):
                self.last = v
                self.max = max(self.max, max(filter(math.isfinite, values)))
            return
        for s, v in zip(steps, values):
            if not math.isfinite(v):
                continue
            if self.open and any(v <= g[2] for g in self.open):
                for g in [g for g in self.open if v <= g[2]]:
                    g[1] = min(g[1], s)        # decayed back: the allowance ends here
                    self.open.remove(g)
            if self.last is not None and v > 1.2 * self.last and v > 0:
                if self.max > 0 and v > self.burst * self.max:
                    self.bursts.append(s)
                else:
                    since = s - (self.rises[-1] if self.rises else self.first_step)
                    g = [s, s + self.cycles * since, self.last]
                    self.graces.append(g)
                    self.open = [x for x in self.open if x[1] > s] + [g]
                    self.rises.append(s)
            self.last = v
            self.max = max(self.max, v)


class Spike:
    """A point far above the recent level of a loss-like key: a robust z (the level is the
    median of the latest points, the noise the median step-to-step change of the window)
    and a minimum ratio over the level, both in log space while the window is positive
    (losses are noisy in proportion to their size). Not fooled by warm-up (the first
    `spike_min_points` are only learnt from) nor by a learning-rate restart (no spike
    within `spike_lr_grace` steps after the run's logged learning rate went up; after that,
    until the rate has decayed back to its level before the rise, for at most
    `spike_lr_grace_cycles` x the steps since the previous rise, a loss back above its
    first values is not enough, only the noise test counts: a warm restart's loss rises
    towards its untrained value and comes back down as its schedule decays).
    Statistics are refreshed every REFRESH points pushed, counted over the whole series, so
    the verdict never depends on how the points were batched."""
    REFRESH = 64

    def __init__(self, key, cfg=DEFAULTS, lr=None):
        self.key = key
        self.window = deque(maxlen=int(cfg["spike_window"]))
        self.min_points = int(cfg["spike_min_points"])
        self.z = float(cfg["spike_z"])
        self.ratio = float(cfg["spike_min_ratio"])
        self.lr_grace = int(cfg["spike_lr_grace"])
        self.n = 0
        self.limit = math.inf        # in the original units
        self.med = self.scale = None
        self.log = False
        self.start_ratio = float(cfg.get("spike_start_ratio", DEFAULTS["spike_start_ratio"]))
        self.start_jump = float(cfg.get("spike_start_jump", DEFAULTS["spike_start_jump"]))
        self.first = []                     # the key's first 3 finite values
        self.f0 = None
        self.warm_points = int(cfg.get("spike_warmup_points", DEFAULTS["spike_warmup_points"]))
        self.warm_jump = float(cfg.get("spike_warmup_jump", DEFAULTS["spike_warmup_jump"]))
        self.burst_steps = int(cfg.get("spike_burst_steps", DEFAULTS["spike_burst_steps"]))
        self.burst_z = float(cfg.get("spike_burst_z", DEFAULTS["spike_burst_z"]))
        self.burst_ratio = float(cfg.get("spike_burst_ratio", DEFAULTS["spike_burst_ratio"]))
        self.limit_burst = math.inf     # the limit within burst_steps after an LR burst
        self.limit_z = math.inf         # the noise test alone (within a restart's allowance)
        # the run's learning rate, shared by every loss key of the run (the engine's)
        self.lr = lr if lr is not None else LrTrack(cfg)

    def lr_points(self, steps, values):
        self.lr.points(steps, values)

    def _after_lr_rise(self, s):
        return any(0 <= s - r <= self.lr_grace for r in self.lr.rises)

    def _in_restart(self, s):
        # a restart's own allowance: until the rate decayed back (LrTrack.graces)
        return any(g[0] <= s < g[1] for g in self.lr.graces)

    def _after_burst(self, s):
        return any(0 <= s - r <= self.burst_steps for r in self.lr.bursts)

    def _refresh(self):
        self.limit = self.limit_burst = self.limit_z = math.inf
        warm = self.n < self.min_points
        if (self.n < self.warm_points if warm else False) or \
                len(self.window) < min(self.min_points, 24):
            return
        self.log = min(self.window) > 0
        # C-level map/sorted only: this runs on the ingest's points, every REFRESH of them
        xs = list(map(math.log, self.window)) if self.log else list(self.window)
        # The level: the median of the latest few points, so a falling curve does not drag
        # an old level along. The noise: the median absolute step-to-step change (x 1.049
        # makes it a Gaussian sigma), which a trend, a restart or a few spikes in the window
        # do not inflate the way the MAD around one median would.
        m = median(xs[-9:])
        noise = 1.049 * median(map(abs, map(operator.sub, xs[1:], xs[:-1])))
        if self.log:
            scale = max(noise, 1e-3)
            self.limit = math.exp(m + max(self.z * scale, math.log1p(self.ratio)))
            self.limit_burst = math.exp(m + max(self.burst_z * scale,
                                                math.log1p(self.burst_ratio)))
        else:
            scale = max(noise, 1e-3 * abs(m), 1e-12)
            self.limit = m + max(self.z * scale, self.ratio * abs(m))
            self.limit_burst = m + max(self.burst_z * scale, self.burst_ratio * abs(m))
        self.med, self.scale = m, scale
        # A jump above where the curve started (and well above its recent level) is a spike
        # whatever the curve's noise: near-zero losses are noisy in log space, and a loss
        # back above its untrained value is not noise.
        f0 = min(self.first) if len(self.first) == 3 else None
        lvl = math.exp(m) if self.log else m
        self.f0 = f0
        start = (max(self.start_ratio * f0, (self.warm_jump if warm else self.start_jump) * lvl)
                 if f0 is not None and f0 > 0 and lvl > 0 else math.inf)
        if warm:
            # Early training is volatile (Adam CNNs jump 2-6x in their first 100 steps), so
            # in warm-up only a loss back above its untrained value and 4x its recent level
            # counts: a corrupted batch, not the optimiser finding its feet.
            self.limit = self.limit_z = start
            self.limit_burst = math.inf
            return
        # after a warm restart, until the rate has decayed back, the loss is back near its
        # untrained value by design: there only the noise test (limit_z) counts
        self.limit_z = self.limit
        self.limit = min(self.limit, start)
        # Right after a learning-rate burst (beyond spike_burst x the run's earlier max) an
        # Adam loss rises 2-4x, inside its own noise: the burst itself is the evidence, so a
        # smaller jump suffices there.
        self.limit_burst = min(self.limit_burst, self.limit)

    def _z(self, v):
        return ((math.log(v) if self.log else v) - self.med) / self.scale

    def extend(self, steps, values, every=False):
        """Feed points in step order; returns the findings (at most one per call; `every`:
        all of them, as spikes() does)."""
        out = None
        found = []
        i, n = 0, len(values)
        while i < n:
            if self.n % self.REFRESH == 0:
                self._refresh()
            take = min(n - i, self.REFRESH - self.n % self.REFRESH)
            chunk = values[i:i + take]
            a, b = steps[i], steps[i + take - 1]
            bursts = self.limit_burst < self.limit and \
                any(r <= b and r + self.burst_steps >= a for r in self.lr.bursts)
            if (out is None or every) and _chunk_needs_look(
                    chunk, self.limit_burst if bursts else self.limit):
                for j in range(take):
                    v, s = chunk[j], steps[i + j]
                    if not math.isfinite(v):
                        continue
                    after_burst = bursts and v > self.limit_burst and self._after_burst(s)
                    if not (v > self.limit or after_burst):
                        continue
                    if not after_burst and self.lr.rises and (
                            self._after_lr_rise(s)
                            or (not v > self.limit_z and self._in_restart(s))):
                        continue
                    med = math.exp(self.med) if self.log else self.med
                    z = self._z(v)
                    out = finding(
                        "LOSS_SPIKE", WARNING, s,
                        f"{self.key} jumped to {_fmt(v)} at step {s}, "
                        + (f"{v / med:.1f}x " if med > 0 else "far above ")
                        + f"its recent median {_fmt(med)} ({z:.0f} robust deviations"
                        + (f"; above its first values, {_fmt(self.f0)}" if self.f0 is not None
                           and v > self.start_ratio * self.f0 else "")
                        + ("; right after a learning-rate burst" if after_burst
                           and not v > self.limit else "")
                        + "); look for a bad batch or a too-high learning rate",
                        key=self.key, value=v, median=med, z=round(z, 2),
                        first_level=self.f0,
                        log_scale=self.log, window=len(self.window))
                    found.append(out)
                    if not every:
                        break
            if len(self.first) < 3:
                self.first.extend(list(filter(math.isfinite, chunk))[:3 - len(self.first)])
            self.window.extend(filter(math.isfinite, chunk))
            self.n += take
            i += take
        return found


def spike_watched(key):
    """The keys LOSS_SPIKE watches: a train loss (loss-like, not eval, not system, not a
    learning rate). The engine and diagnose_run ask this same question."""
    return (not vocab.is_system(key) and not vocab.is_lr(key) and vocab.is_loss(key)
            and eval_pair(key)[0] != "eval")


def spikes(key, points, lr_points=(), cfg=DEFAULTS):
    """Every LOSS_SPIKE the rule finds on a curve, judged as the engine judges it (the
    one spike judgement: the event engine feeds the same rule the same raw points, the
    learning rate first): [{"step", "value", "level", "recovered", "finding"}], in step
    order. `recovered`: the curve's median 5-20 points later is within half the jump of
    the level before it. `points`, `lr_points`: raw [step, value] pairs."""
    track = LrTrack(cfg)
    lr = [(p[0], vocab.decode(p[1])) for p in lr_points]
    track.points([s for s, _ in lr], [v for _, v in lr])
    sp = Spike(key, cfg, lr=track)
    pts = [(p[0], vocab.decode(p[1])) for p in points]
    steps, values = [s for s, _ in pts], [v for _, v in pts]
    out = []
    at = {s: i for i, s in enumerate(steps)}
    for f in sp.extend(steps, values, every=True):
        i = at[f["step"]]
        v, lvl = f["evidence"]["value"], f["evidence"]["median"]
        after = [x for x in values[i + 5:i + 21] if math.isfinite(x)]
        if out and i - out[-1]["_i"] <= 2:            # one event: keep its highest point
            if v > out[-1]["value"]:
                out[-1].update(_i=i, step=f["step"], value=v, finding=f)
            continue
        out.append({"_i": i, "step": f["step"], "value": v, "level": lvl,
                    "recovered": bool(after) and median(after) <= lvl + 0.5 * (v - lvl),
                    "finding": f})
    return [{k: v for k, v in s.items() if k != "_i"} for s in out]


def _chunk_needs_look(chunk, limit):
    if limit == math.inf:
        return False
    try:
        return not (max(chunk) <= limit)      # NaN makes max() unreliable: look then
    except TypeError:
        return True


# -- LOSS_DIVERGED ----------------------------------------------------------------------

class Diverge:
    """A loss that rises far above where it started and stays there, with no NaN: the
    median of the latest `diverge_window` finite points is `diverge_ratio` x the first
    level (the lowest of the key's first 3 points), once `diverge_min_points` are in.
    Losses only (positive: a key whose first level is <= 0 is not judged so). One finding
    per key. After a server restart the first level is that of the points it is rebuilt
    from (the latest ones), so a run that had diverged before is caught only if it goes on
    rising."""

    def __init__(self, key, cfg=DEFAULTS):
        self.key = key
        self.ratio = float(cfg.get("diverge_ratio", DEFAULTS["diverge_ratio"]))
        self.min_points = int(cfg.get("diverge_min_points", DEFAULTS["diverge_min_points"]))
        self.recent = deque(maxlen=int(cfg.get("diverge_window", DEFAULTS["diverge_window"])))
        self.first = []
        self.n = 0
        self.fired = False

    def extend(self, steps, values):
        if self.fired:
            return []
        for s, v in zip(steps, values):
            if not math.isfinite(v):
                continue
            self.n += 1
            if len(self.first) < 3:
                self.first.append(v)
            self.recent.append(v)
            if self.n < self.min_points or self.n % 4:
                continue
            f0 = min(self.first)
            if f0 <= 0:
                continue
            now = median(self.recent)
            if now > self.ratio * f0:
                self.fired = True
                return [finding(
                    "LOSS_DIVERGED", CRITICAL, s,
                    f"{self.key} has risen to {_fmt(now)} (the median of its last "
                    f"{len(self.recent)} points, up to step {s}), {now / f0:.1f}x its first "
                    f"values ({_fmt(f0)}): training is diverging without a NaN; lower the "
                    f"learning rate or clip gradients",
                    key=self.key, level=now, first_level=f0, ratio=round(now / f0, 2),
                    window=len(self.recent))]
        return []


# -- OVERFITTING_SUSPECTED --------------------------------------------------------------

class Overfit:
    """Eval worsens for `patience` evals in a row (3-point running median, against its best)
    while the train metric of the same name kept improving over the same steps, and is
    better than where it started."""

    def __init__(self, eval_key, train_key, cfg=DEFAULTS, direction=None):
        self.eval_key, self.train_key = eval_key, train_key
        # the metric definition's direction, else the name's (None: the rule is not run)
        self.direction = vocab.direction(eval_key, direction)
        self.sign = -1.0 if self.direction == "max" else 1.0    # lower is better after
        self.min_evals = int(cfg["overfit_min_evals"])
        self.patience = int(cfg["overfit_patience"])
        self.worse = float(cfg["overfit_worse"])
        self.train_better = float(cfg["overfit_train_better"])
        self.evals = deque(maxlen=512)        # (step, signed value)
        self.train = deque(maxlen=4096)       # (step, signed value)
        self.train_first = []                 # its first 3 signed values
        self.fired = False

    def train_points(self, steps, values):
        for s, v in zip(steps, values):
            if math.isfinite(v):
                self.train.append((s, self.sign * v))
                if len(self.train_first) < 3:
                    self.train_first.append(self.sign * v)

    def eval_points(self, steps, values):
        out = []
        if self.direction is None:      # unknown: neither worse nor better (gpuplane/vocab.py)
            return out
        for s, v in zip(steps, values):
            if math.isfinite(v):
                self.evals.append((s, self.sign * v))
                f = self._check()
                if f:
                    out.append(f)
        return out

    def _smoothed(self):
        vals = [v for _, v in self.evals]
        return [median(vals[max(0, i - 1):i + 2]) if 0 < i < len(vals) - 1 else vals[i]
                for i in range(len(vals))][:-1] + [median(vals[-3:])]

    def _check(self):
        if len(self.evals) < self.min_evals or not self.train:
            return None
        sm = self._smoothed()
        best_i = min(range(len(sm)), key=sm.__getitem__)
        best = sm[best_i]
        tol = self.worse * max(abs(best), 1e-9)
        recent = sm[-self.patience:]
        if len(sm) - 1 - best_i < self.patience or not all(x > best + tol for x in recent):
            return None
        # and still rising: the last raw eval is no better than the smoothed ones before
        if self.evals[-1][1] < best + tol:
            return None
        best_step, now_step = self.evals[best_i][0], self.evals[-1][0]
        before = [v for s, v in self.train if s <= best_step][-16:]
        after = [v for s, v in self.train if best_step < s <= now_step][-16:]
        if len(before) < 3 or len(after) < 3:
            return None
        t0, t1 = median(before), median(after)
        if not t1 < t0 - self.train_better * max(abs(t0), 1e-9):
            return None
        # a train metric worse than where it started is diverging, not overfitting
        if self.train_first and not t1 < min(self.train_first):
            return None
        s = self.sign
        return finding(
            "OVERFITTING_SUSPECTED", WARNING, now_step,
            f"{self.eval_key} got worse since step {best_step} ({_fmt(s * best)} -> "
            f"{_fmt(s * sm[-1])}) while {self.train_key} kept improving ({_fmt(s * t0)} -> "
            f"{_fmt(s * t1)}): the model is likely overfitting; consider the checkpoint "
            f"near step {best_step}, more regularisation or early stopping",
            eval_key=self.eval_key, train_key=self.train_key, best_step=best_step,
            best_eval=s * best, eval_now=s * sm[-1], train_then=s * t0, train_now=s * t1)


# -- GPU_UNDERUTILIZED ------------------------------------------------------------------

class GpuIdle:
    """A job's GPU stays under `gpu_util_below` % on average over `gpu_window_s` seconds,
    the window fully covered, and not within `gpu_grace_s` of the job's first sample."""

    def __init__(self, key, cfg=DEFAULTS):
        self.key = key
        self.below = float(cfg["gpu_util_below"])
        self.window_ms = float(cfg["gpu_window_s"]) * 1000
        self.grace_ms = float(cfg["gpu_grace_s"]) * 1000
        self.samples = deque()
        self.first_ts = None

    def push(self, step, util, ts):
        if not math.isfinite(util):
            return None
        if self.first_ts is None:
            self.first_ts = ts
        if ts < self.first_ts + self.grace_ms:
            return None
        self.samples.append((ts, util))
        while self.samples and self.samples[0][0] < ts - self.window_ms:
            self.samples.popleft()
        # covered: the oldest sample in the window is near its start
        if self.samples[0][0] > ts - 0.8 * self.window_ms or len(self.samples) < 3:
            return None
        mean = sum(u for _, u in self.samples) / len(self.samples)
        if mean >= self.below:
            return None
        mins = self.window_ms / 60000
        return finding("GPU_UNDERUTILIZED", WARNING, step,
                       f"{self.key} averaged {mean:.0f}% over the last {mins:.0f} min "
                       f"(below {self.below:.0f}%): the GPU mostly waits; look at data "
                       f"loading, a CPU bottleneck, or a too-small batch",
                       key=self.key, mean_util=round(mean, 1), samples=len(self.samples),
                       window_s=self.window_ms / 1000, threshold=self.below)


# -- STALLED ----------------------------------------------------------------------------

class Activity:
    """When a running job last showed progress (a log line, a metric that is not sys/*, a
    new step) and its usual interval between such moments. Stalled: silent for
    `stall_factor` x the median interval and at least `stall_min_s`."""

    def __init__(self, cfg=DEFAULTS):
        self.factor = float(cfg["stall_factor"])
        self.min_ms = float(cfg["stall_min_s"]) * 1000
        self.min_intervals = int(cfg["stall_min_intervals"])
        self.intervals = deque(maxlen=64)
        self.last = None
        self.last_step = None

    def seen(self, ts, step=None):
        if self.last is not None:
            gap = ts - self.last
            if gap < 200:          # one burst (a batch, a few lines at once) is one moment
                if step is not None:
                    self.last_step = max(step, self.last_step or step)
                return
            self.intervals.append(gap)
        self.last = ts if self.last is None else max(self.last, ts)
        if step is not None:
            self.last_step = max(step, self.last_step or step)

    def threshold_ms(self):
        if len(self.intervals) < self.min_intervals:
            return None
        return max(self.factor * median(self.intervals), self.min_ms)

    def check(self, now):
        limit = self.threshold_ms()
        if limit is None or self.last is None or now - self.last < limit:
            return None
        silent = (now - self.last) / 1000
        usual = median(self.intervals) / 1000
        return finding("STALLED", CRITICAL, self.last_step,
                       f"no log line, metric or step for {silent:.0f} s, {silent / usual:.0f}x "
                       f"its usual {usual:.1f} s: the job may be hung (a stuck data loader, a "
                       f"deadlocked collective); check its logs and py-spy dump it",
                       silent_s=round(silent, 1), usual_interval_s=round(usual, 2),
                       last_step=self.last_step, threshold_s=round(limit / 1000, 1))


def find_stall(timestamps, now, cfg=DEFAULTS, check_every_ms=1000):
    """The first STALLED finding over a whole history of activity times (ms) up to `now`,
    checking as the engine does every `check_every_ms`; None when there is none."""
    act = Activity(cfg)
    for t in sorted(timestamps):
        if act.last is not None:
            limit = act.threshold_ms()
            if limit is not None and t - act.last >= limit:
                return act.check(act.last + limit + check_every_ms)
        act.seen(t)
    return act.check(now)


# -- DISK_LOW ---------------------------------------------------------------------------

def disk_low(free_mb, where, cfg=DEFAULTS, step=None):
    if free_mb is None or not math.isfinite(free_mb) or free_mb >= cfg["disk_low_mb"]:
        return None
    sev = CRITICAL if free_mb < cfg["disk_critical_mb"] else WARNING
    return finding("DISK_LOW", sev, step,
                   f"only {free_mb:,.0f} MiB free on {where} (threshold "
                   f"{cfg['disk_low_mb']:,} MiB): checkpoints and logs will fail when it is "
                   f"full; free space (`gpuplane ckpt prune --job JOB --dry-run` lists the "
                   f"checkpoints a retention policy would delete) or move the run's output",
                   free_mb=free_mb, threshold_mb=cfg["disk_low_mb"], where=where)


# -- OOM in the log ---------------------------------------------------------------------

OOM_RE = re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|"
                    r"RESOURCE_EXHAUSTED: OOM|out of memory", re.IGNORECASE)


def oom_line(lines):
    """OOM for the first log line that reports an out-of-memory error, or None."""
    for line in lines:
        if OOM_RE.search(line):
            return finding("OOM", CRITICAL, None,
                           "the job's log reports an out-of-memory error while it keeps "
                           "running: it may be skipping batches or retrying; lower the batch "
                           "size or enable gradient checkpointing",
                           line=line[:500])
    return None
