"""A run's parameters: its hyperparameters, told apart from paths and bookkeeping flags.

The one place that reads them: from the command line a job ran (`--lr 0.5`, `--lr=0.5`,
Hydra-style `lr=0.5` / `+model.depth=4`, a bare `--amp` is true) and from the config
`run.init(config=...)` gave (which wins where both name a key). Every view of a run
(REST, MCP, `gpuplane exp runs`, the dashboard) and compare_runs' settings that differ
show `params`; `--logdir runs/a`, `--checkpoint-dir ckpt`, a value that is a path, and
flags such as `--workers` or `--device` go to `bookkeeping` instead, so they never count
as a setting that differs.
"""
import re

# Flag names (words of) that say where things go or how the run is housed, not what it
# learns: directories, files, logging, resuming, hardware, reporting.
_BOOKKEEPING_WORDS = {"dir", "path", "file", "logdir", "log", "logs", "logging", "output",
                      "out", "outdir", "save", "ckpt", "checkpoint", "checkpoints", "resume",
                      "root", "data", "dataset", "cache", "tb", "tensorboard", "wandb",
                      "device", "devices", "gpu", "gpus", "workers", "worker", "port", "host",
                      "verbose", "quiet", "print", "every", "interval", "name", "tag",
                      "project", "experiment", "config", "delay",
                      "sweep"}    # {"id", "trial"}: where a sweep's trial came from
_PATH_LIKE = re.compile(r"^(/|\./|\.\./|~/)|/|\.(py|pt|pth|ckpt|bin|json|ya?ml|toml|txt|csv|"
                        r"npz|safetensors)$")
_HYDRA = re.compile(r"^[+~]{0,2}([A-Za-z_][\w.-]*)=(.*)$", re.S)


def _scalar(v):
    if not isinstance(v, str):
        return v
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def from_argv(argv):
    """{name: value} of a command line's flags and Hydra-style overrides, names with `-`
    as `_` (`--weight-decay` is `weight_decay`); the program and script are left out."""
    out = {}
    if not isinstance(argv, list):
        return out
    args = [a if isinstance(a, str) else str(a) for a in argv]
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--") and len(a) > 2:
            name, eq, value = a[2:].partition("=")
            if not eq:
                nxt = args[i + 1] if i + 1 < len(args) else None
                if nxt is not None and not nxt.startswith("--") and not _HYDRA.match(nxt):
                    value, i = nxt, i + 1
                else:
                    value = True
            out.setdefault(name.replace("-", "_"), _scalar(value))
        else:
            m = _HYDRA.match(a) if not a.startswith("-") else None
            if m:
                out.setdefault(m.group(1).replace("-", "_"), _scalar(m.group(2)))
        i += 1
    return out


def is_bookkeeping(name, value):
    """Whether a flag says where things go or how the run is housed rather than what it
    learns: a value that is a path, or a name made of bookkeeping words."""
    if isinstance(value, str) and _PATH_LIKE.search(value):
        return True
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    return bool(words) and any(w in _BOOKKEEPING_WORDS for w in words) and not any(
        w in ("lr", "rate", "decay", "size", "dropout") for w in words)


def split(config):
    """(params, bookkeeping): a run's config (with its job's `command`, if any) as
    hyperparameters and the rest, each {name: scalar or JSON value}."""
    config = config or {}
    merged = from_argv(config.get("command"))
    merged.update({k: v for k, v in config.items() if k != "command"})
    params, other = {}, {}
    for k, v in merged.items():
        (other if is_bookkeeping(k, v) else params)[k] = v
    return params, other
