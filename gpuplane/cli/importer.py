"""`gpuplane import-run PATH`: the training logs and checkpoints found under PATH (a
directory, or one log file) become one run with source `import`, sent over REST (the
server may be on another host and cannot read PATH). The run is found again by its path
and host, and points (one per key and step) and checkpoints (one per path) are upserts,
so importing the same path twice adds nothing.

Logs it reads, each with its steps and keys as the source names them:
- TensorBoard event files (`*tfevents*`): their tags at their steps;
- a Hugging Face Trainer's `trainer_state.json` (its `log_history`: `loss`,
  `learning_rate`, `eval_loss`, ... at each entry's `step`); of several (one per
  `checkpoint-N/`), the one that goes furthest;
- a CSV log with an `epoch` or `step` column: Lightning's CSVLogger `metrics.csv` (at
  its `step` column; `epoch` is a key), a Keras CSVLogger file (`training.log`, `*.csv`:
  at its `epoch`), a YOLO `results.csv` (`train/box_loss`, `val/obj_loss`, `metrics/mAP_0.5`
  ... at its `epoch`). Empty cells are no point.
"""
import csv
import json
import math
import os
import re
import socket

from .. import vocab
from .common import CliError

BATCH = 5000
MAX_DEPTH = 12
# Directories that exist once per launch (torch's runs/Nov29_08-46-00_host, Lightning's
# version_3): left out of metric keys, as the agent's TensorBoard tailer does.
_LAUNCH_DIR = re.compile(r"^(?:[A-Z][a-z]{2}\d{2}_\d{2}-\d{2}-\d{2}_.+|version_\d+)$")
_CKPT_FILE = re.compile(r"\.(pt|pth|safetensors|ckpt|keras|h5)$", re.I)
_HF_DIR = re.compile(r"^checkpoint-(\d+)$")
_CSV_LOG = re.compile(r"(\.csv|\.log)$", re.I)
_STEP_COLUMNS = ("step", "global_step")       # the step a CSV row is at, in this order
_EPOCH_COLUMNS = ("epoch",)                   # ... else its epoch


def checkpoint_step(name):
    """(step, epoch) from a checkpoint's file name: the agent's own function, so a watched
    directory and an imported one give a checkpoint the same step. agent.py is the one
    owner (it is copied alone to GPU hosts and imports nothing of the server, so it cannot
    ask gpuplane/); it ships in this package as the module `agent`."""
    from agent import checkpoint_step as agents
    return agents(name)


def _size(path):
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def scan(root):
    """(event files [(path, key prefix)], checkpoints [(path, step, epoch)], other logs
    [(path, key prefix)]: trainer_state.json and CSV logs) under root."""
    events, ckpts, logs = [], [], []
    states = []            # every trainer_state.json: only the one that goes furthest counts
    seen = set()
    stack = [(root, 0)]
    while stack:
        d, depth = stack.pop()
        try:
            real = os.path.realpath(d)
            if real in seen:       # a symlink loop
                continue
            seen.add(real)
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        for e in entries:
            if e.name.startswith("."):
                continue
            m = _HF_DIR.match(e.name)
            if e.is_dir() and m:
                ckpts.append((e.path, int(m.group(1)), None))
                state = os.path.join(e.path, "trainer_state.json")
                if os.path.isfile(state):
                    states.append((state, _prefix(root, d)))
            elif e.is_dir():
                if depth < MAX_DEPTH:
                    stack.append((e.path, depth + 1))
            elif "tfevents" in e.name:
                events.append((e.path, _prefix(root, d)))
            elif _CKPT_FILE.search(e.name):
                ckpts.append((e.path, *checkpoint_step(e.name)))
            elif e.name == "trainer_state.json":
                states.append((e.path, _prefix(root, d)))
            elif _CSV_LOG.search(e.name) and csv_columns(e.path):
                logs.append((e.path, _prefix(root, d)))
    if states:
        logs.append(max(states, key=lambda s: (_state_reach(s[0]), s[0])))
    return sorted(events), sorted(ckpts), sorted(logs)


def _prefix(root, d):
    """The key prefix of a log in directory d: its path under root, less launch dirs."""
    rel = os.path.relpath(d, root)
    parts = [p for p in rel.split(os.sep) if p not in ("", ".") and not _LAUNCH_DIR.match(p)]
    return "/".join(parts) + "/" if parts else ""


def _state_reach(path):
    """How far a trainer_state.json goes: (its global step, its log entries); (-1, 0) for
    one that is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        return (int(state.get("global_step") or 0), len(state.get("log_history") or ()))
    except (OSError, ValueError, TypeError, AttributeError):
        return (-1, 0)


def _number(text):
    """A log's cell as a float, or None for an empty or non-numeric one ('nan', 'inf' are
    numbers: a NaN loss is a point)."""
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        return float(text)
    try:
        return float(str(text).strip())
    except ValueError:
        return None


def csv_columns(path):
    """The columns of a CSV training log — a header with an `epoch` or `step` column and a
    column that names a metric (loss, acc, mAP, ...), over rows of numbers — or None for
    any other file (a data set's CSV is not a training log)."""
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            rows = csv.reader(f)
            header = [h.strip() for h in next(rows, [])]
            first = next(rows, None)
    except (OSError, csv.Error):
        return None
    if not header or first is None or len(set(header)) != len(header):
        return None
    names = {h.lower() for h in header}
    if not (names & set(_STEP_COLUMNS + _EPOCH_COLUMNS)):
        return None
    if not any(vocab.name_direction(h) or vocab.is_lr(h) for h in header):
        return None
    cells = [c for c in first if c.strip()]
    if not cells or any(_number(c) is None for c in cells):
        return None
    return header


def read_log(path):
    """[(key, step, value)] of a trainer_state.json or a CSV training log (module doc)."""
    if os.path.basename(path) == "trainer_state.json":
        return read_trainer_state(path)
    return read_csv_log(path)


def read_trainer_state(path):
    """A Hugging Face Trainer's log_history: every numeric field of an entry but `step`
    itself, at the entry's step."""
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise CliError(f"{path} is not a trainer_state.json: {e}")
    out = []
    for entry in (state.get("log_history") or []) if isinstance(state, dict) else []:
        step = entry.get("step") if isinstance(entry, dict) else None
        if not isinstance(step, int):
            continue
        for key, v in entry.items():
            value = _number(v) if key != "step" else None
            if value is not None:
                out.append((key, step, value))
    return out


def read_csv_log(path):
    """A CSV log's cells: each row at its `step` (Lightning), else at its `epoch` (Keras,
    YOLO), else at its row number; the step column itself is no key. Where the steps go
    back (a second fit() appended to the file), the rows after continue from the last."""
    header = csv_columns(path)
    if header is None:
        return []
    lower = [h.lower() for h in header]
    at = next((lower.index(c) for c in _STEP_COLUMNS if c in lower), None)
    if at is None:
        at = next((lower.index(c) for c in _EPOCH_COLUMNS if c in lower), None)
    out = []
    offset, last = 0, None
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        rows = csv.reader(f)
        next(rows, None)
        for i, row in enumerate(rows):
            step = _number(row[at]) if at is not None and at < len(row) else float(i)
            if step is None or not math.isfinite(step) or step < 0:
                continue
            # A log a second fit() appended to starts its epochs at 0 again: its rows come
            # after the first part's, not on top of them.
            if last is not None and int(step) + offset < last:
                offset = last + 1 - int(step)
            last = int(step) + offset
            for j, cell in enumerate(row[:len(header)]):
                value = _number(cell) if j != at and cell.strip() else None
                if value is not None:
                    out.append((header[j], last, value))
    return out


def read_scalars(path):
    """[(tag, step, value, wall_time_ms)] of one event file (tensorboard's own reader)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util
    out = []
    for event in EventFileLoader(path).Load():
        if not event.HasField("summary"):
            continue
        for v in event.summary.value:
            if v.HasField("simple_value"):
                value = float(v.simple_value)
            elif v.HasField("tensor"):
                try:
                    arr = tensor_util.make_ndarray(v.tensor)
                except Exception:
                    continue
                if arr.size != 1 or arr.dtype.kind not in "fiu":
                    continue
                value = float(arr.item())
            else:
                continue
            out.append((v.tag, int(event.step), value, int(event.wall_time * 1000)))
    return out


_wire = vocab.encode        # NaN and infinities as the wire's strings


def import_dir(client, directory, project, experiment="", name=None, progress=None):
    root = os.path.abspath(os.path.expanduser(directory))
    host = socket.gethostname()
    if os.path.isfile(root):
        if not (os.path.basename(root) == "trainer_state.json" or csv_columns(root)):
            raise CliError(f"{directory} is not a training log GPUPlane reads (a "
                           "trainer_state.json, or a CSV log with an epoch or step column)")
        events, ckpts, logs = [], [], [(root, "")]
    elif os.path.isdir(root):
        events, ckpts, logs = scan(root)
    else:
        raise CliError(f"{directory} is not a directory or a file on this host")
    if not events and not ckpts and not logs:
        raise CliError(f"found no TensorBoard event files (*tfevents*), training logs "
                       f"(trainer_state.json, CSV logs) and no checkpoints under {root}")
    run = _find_run(client, root, host, project, experiment)
    created = run is None
    if created:
        run = client.create_run(project=project, experiment=experiment,
                                name=name or os.path.basename(root),
                                config={"imported_from": root, "host": host},
                                source="import")
    run_id = run["id"]
    points = 0
    keys, batch = {}, []
    for path, prefix in events:
        for tag, step, value, ts in read_scalars(path):
            key = prefix + tag
            idx = keys.setdefault(key, len(keys))
            batch.append([idx, step, _wire(value), ts])
            if len(batch) >= BATCH:
                points += _send(client, run_id, keys, batch)
                batch = []
    for path, prefix in logs:
        ts = int(os.path.getmtime(path) * 1000)      # the logs keep no time of their own
        for key, step, value in read_log(path):
            idx = keys.setdefault(prefix + key, len(keys))
            batch.append([idx, step, _wire(value), ts])
            if len(batch) >= BATCH:
                points += _send(client, run_id, keys, batch)
                batch = []
    if batch:
        points += _send(client, run_id, keys, batch)
    added = 0
    for path, step, epoch in ckpts:
        c = client.create_checkpoint(run_id, path, step=step, epoch=epoch,
                                     size_bytes=_size(path), source="import")
        added += bool(c.get("created"))
    if created:
        client.finish_run(run_id, "SUCCEEDED")
    if progress:
        progress(f"{'imported' if created else 'already imported:'} run {run_id}: "
                 f"{points} points from {len(events)} event files and {len(logs)} logs, "
                 f"{len(ckpts)} checkpoints ({added} new)")
    return {"run_id": run_id, "created": created, "points": points,
            "event_files": len(events), "logs": [p for p, _ in logs],
            "checkpoints": len(ckpts), "new_checkpoints": added}


def _send(client, run_id, keys, batch):
    # the batch's keys only, re-indexed: the wire format wants no unused names
    used = sorted({p[0] for p in batch})
    names = {i: k for k, i in keys.items()}
    remap = {old: new for new, old in enumerate(used)}
    client.log_run_metrics(run_id, [names[i] for i in used],
                       [[remap[p[0]], p[1], p[2], p[3]] for p in batch])
    return len(batch)


def _find_run(client, root, host, project, experiment):
    for r in client.list_runs(project=project, experiment=experiment, limit=10000):
        cfg = r.get("config") or {}
        if r["source"] == "import" and cfg.get("imported_from") == root \
                and cfg.get("host") == host:
            return r
    return None
