"""Judgements about runs and metrics: plain functions of plain data, no SQL, no I/O.

Today: which way a metric should go (`direction`) and where it is going (`trend`). The
analysis functions (diagnose_run, compare_runs, ...) grow here.
"""
import math

_MIN_WORDS = {"loss", "error", "err", "perplexity", "ppl", "mse", "mae", "rmse", "wer", "cer",
              "time", "nll", "latency"}
_MAX_WORDS = {"acc", "accuracy", "f1", "precision", "recall", "auc", "bleu", "rouge", "map",
              "iou", "reward", "score", "return", "top1", "top5"}


def direction(key):
    """'min' or 'max' from the key's name: the last word that says which wins."""
    words = "".join(c if c.isalnum() else " " for c in key.lower()).split()
    for word in reversed(words):
        if word in _MIN_WORDS:
            return "min"
        if word in _MAX_WORDS:
            return "max"
    return "min"


TREND_WINDOW = 0.10      # compare the last 10% of the run with the 10% before it
TREND_TOLERANCE = 0.01   # relative change below this is "flat"


def trend(series_points, d):
    """'improving' | 'worsening' | 'flat' | 'unknown': mean of the last 10% of the run's
    steps against the 10% before. `series_points` are the buckets of a downsampled series
    ([step, min, max, mean, last, count], about 200 of them); `d` is 'min' or 'max'."""
    pts = [p for p in series_points if p[3] is not None and math.isfinite(p[3])]
    if len(pts) < 4 or sum(p[5] for p in pts) < 4:
        return "unknown"
    k = max(1, round(len(pts) * TREND_WINDOW))
    last, prev = pts[-k:], pts[-2 * k:-k]

    def mean(ps):
        n = sum(p[5] for p in ps)
        return sum(p[3] * p[5] for p in ps) / n

    a, b = mean(last), mean(prev)
    if abs(a - b) <= TREND_TOLERANCE * max(abs(a), abs(b)) or a == b:
        return "flat"
    better = a < b if d == "min" else a > b
    return "improving" if better else "worsening"
