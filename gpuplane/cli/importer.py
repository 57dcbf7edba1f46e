"""`gpuplane import-run DIR`: TensorBoard event files and checkpoints found under DIR
become one run with source `import`, sent over REST (the server may be on another host
and cannot read DIR). The run is found again by its directory and host, and points
(one per key and step) and checkpoints (one per path) are upserts, so importing the same
directory twice adds nothing."""
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
    """(event files [(path, key prefix)], checkpoints [(path, step, epoch)]) under root."""
    events, ckpts = [], []
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
            elif e.is_dir():
                if depth < MAX_DEPTH:
                    stack.append((e.path, depth + 1))
            elif "tfevents" in e.name:
                rel = os.path.relpath(d, root)
                parts = [p for p in rel.split(os.sep)
                         if p not in ("", ".") and not _LAUNCH_DIR.match(p)]
                events.append((e.path, "/".join(parts) + "/" if parts else ""))
            elif _CKPT_FILE.search(e.name):
                ckpts.append((e.path, *checkpoint_step(e.name)))
    return sorted(events), sorted(ckpts)


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
    if not os.path.isdir(root):
        raise CliError(f"{directory} is not a directory on this host")
    host = socket.gethostname()
    events, ckpts = scan(root)
    if not events and not ckpts:
        raise CliError(f"found no TensorBoard event files (*tfevents*) and no checkpoints "
                       f"under {root}")
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
                 f"{points} points from {len(events)} event files, {len(ckpts)} checkpoints "
                 f"({added} new)")
    return {"run_id": run_id, "created": created, "points": points,
            "event_files": len(events), "checkpoints": len(ckpts), "new_checkpoints": added}


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
