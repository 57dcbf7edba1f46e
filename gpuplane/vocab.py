"""What a metric key means: the one place that decides it (docs/metrics.md, "What a key
means").

Every reader of a key asks this module: the event rules (gpuplane/rules.py, events.py),
the semantic layer (semantic.py), the series summaries (series.py, what `run show`, the
metric summary and the dashboard show), recommend.py and the database's system-key
filters (db/checkpoints.py, db/events.py). tests/test_vocab.py fails when a word list, a
system prefix or a non-finite spelling is written down anywhere else.

A key is cut into lower-case words at every character that is not a letter or digit
("eval/val_loss" -> eval, val, loss). Then:
- role: "system" (a SYSTEM_PREFIXES prefix: the agent's sys/* and the usual loggers'),
  "eval" (a word of EVAL_WORDS), "train" (a word of TRAIN_WORDS, or a loss-like key with
  no eval word: a bare `loss` is the training loss), else "other".
- loss-like: not system, and a word of LOSS_WORDS. LOSS_NAN and LOSS_SPIKE watch these.
- direction: a metric definition (`gpuplane metric set KEY --direction min|max`) first;
  then the name: the LAST word that says (MIN_WORDS -> "min", MAX_WORDS -> "max"); a
  counter or schedule (epoch, step, lr, ...) says nothing; else None, "unknown". An
  unknown direction is never judged: no best, no improving/worsening, no winner.
- non-finite values travel as the JSON strings "NaN", "Infinity", "-Infinity" (JSON has
  no spelling for them); a stored NULL is a NaN (SQLite stores a NaN as NULL).

No imports of the project: the database layer, the CLI and the rules all import this.
"""
import math
import re

# -- words ---------------------------------------------------------------------------------

SYSTEM_PREFIXES = ("sys/", "system/", "gpu/", "host/")
EVAL_WORDS = frozenset({"eval", "evaluation", "val", "valid", "validation", "test", "dev",
                        "holdout", "heldout"})
TRAIN_WORDS = frozenset({"train", "training", "tr", "trn"})
LOSS_WORDS = frozenset({"loss", "losses", "nll", "perplexity", "ppl", "mse", "mae", "rmse",
                        "error", "err", "wer", "cer"})
MIN_WORDS = LOSS_WORDS | {"time", "latency", "regret", "distance", "fid"}
MAX_WORDS = frozenset({"acc", "accuracy", "f1", "precision", "recall", "auc", "auroc", "bleu",
                       "rouge", "map", "iou", "miou", "dice", "psnr", "ssim", "ndcg", "mrr",
                       "reward", "rewards", "score", "return", "top1", "top5"})

# Counters and schedules: they move because training moves, not because it goes well.
# Matched on the key's last segment.
_STEP_LIKE = re.compile(r"(^|[/_.\-])(epoch|epochs|step|steps|global_step|iteration|iter|"
                        r"batch|batch_idx|samples|tokens|examples_seen|lr|learning_rate|"
                        r"lr_\w+|momentum|warmup\w*)$")

ROLES = ("train", "eval", "system", "other")
DIRECTIONS = ("min", "max")


def words(key):
    """The key's lower-case words: "eval/val_loss" -> ["eval", "val", "loss"]."""
    return "".join(c if c.isalnum() else " " for c in key.lower()).split()


def is_system(key):
    """A measurement of the machine (the agent's sys/*, a logger's system/, gpu/, host/),
    not of training: never judged, left out of checkpoint values and summaries of results."""
    return key.startswith(SYSTEM_PREFIXES)


def is_eval(key):
    return not is_system(key) and not EVAL_WORDS.isdisjoint(words(key))


def is_loss(key):
    """Loss-like: a word like loss, nll, ppl, mse, error (LOSS_NAN and LOSS_SPIKE watch it)."""
    return not is_system(key) and not LOSS_WORDS.isdisjoint(words(key))


def role(key):
    """"system" | "eval" | "train" | "other" (see the module's docstring)."""
    if is_system(key):
        return "system"
    ws = words(key)
    if not EVAL_WORDS.isdisjoint(ws):
        return "eval"
    if not TRAIN_WORDS.isdisjoint(ws) or not LOSS_WORDS.isdisjoint(ws):
        return "train"
    return "other"


def is_train(key):
    return role(key) == "train"


def base(key):
    """The key without its split words, so "train/loss", "loss", "eval/loss" and
    "val_loss" share the base "loss" (the overfitting rule pairs eval with train by it)."""
    return " ".join(w for w in words(key) if w not in EVAL_WORDS and w not in TRAIN_WORDS)


# Lightning names a metric logged per step and its mean per epoch with these suffixes
# (`train_loss_step`, `train_loss_epoch`): the metric, not a counter.
_AGGREGATE = re.compile(r"[_/.\-](step|epoch)$")


def is_step_like(key):
    """A counter or a schedule (epoch, step, lr, ...), not a result. A metric with
    Lightning's `_step` / `_epoch` suffix (`train_loss_step`) is the metric."""
    low = key.lower()
    if not _STEP_LIKE.search(low):
        return False
    rest = _AGGREGATE.sub("", low)
    return rest == low or not any(w in MIN_WORDS or w in MAX_WORDS for w in words(rest))


def is_lr(key):
    """A learning-rate key (lr, learning_rate, opt/lr_group0): the spike rule's restart
    grace reads it."""
    ws = set(words(key))
    return not is_system(key) and ("lr" in ws or {"learning", "rate"} <= ws
                                   or any(w.startswith("lr") and w[2:].isdigit() for w in ws))


def name_direction(key):
    """"min" | "max" from the key's name (its last word that says), or None."""
    if is_system(key) or is_step_like(key):
        return None
    for w in reversed(words(key)):
        if w in MIN_WORDS:
            return "min"
        if w in MAX_WORDS:
            return "max"
    return None


def direction(key, defined=None):
    """The direction a key is judged by: `defined` (a metric definition's "min" / "max")
    first, then its name, else None (unknown: never judged better or worse)."""
    if defined in DIRECTIONS:
        return defined
    return name_direction(key)


def describe(key, defined=None):
    """What the vocabulary says of a key, as the REST summaries carry it."""
    d = direction(key, defined)
    return {"role": role(key), "loss_like": is_loss(key), "counter": is_step_like(key),
            "direction": d,
            "direction_from": "definition" if defined in DIRECTIONS
            else "name" if d else None}


# -- non-finite values on the wire ---------------------------------------------------------

NAN, INF, NEG_INF = "NaN", "Infinity", "-Infinity"
NONFINITE = {NAN: math.nan, INF: math.inf, NEG_INF: -math.inf}


def encode(v):
    """A value for JSON: NaN and the infinities as their wire strings; None stays None."""
    if isinstance(v, float) and not math.isfinite(v):
        return NAN if v != v else INF if v > 0 else NEG_INF
    return v


def encode_stored(v):
    """A stored value for JSON: NULL is a NaN (SQLite stores NaN as NULL)."""
    return NAN if v is None else encode(v)


def decode(v):
    """A wire or stored value as a float: None and "NaN" are NaN; another string that is
    not a number is NaN too."""
    if v is None:
        return math.nan
    if isinstance(v, str):
        if v in NONFINITE:
            return NONFINITE[v]
        try:
            return float(v)
        except ValueError:
            return math.nan
    return float(v)


def is_wire_nonfinite(v):
    return isinstance(v, str) and v in NONFINITE
