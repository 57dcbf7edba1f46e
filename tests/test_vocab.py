"""gpuplane/vocab.py is the one owner of what a metric key means, and nothing else in the
tree decides it a second time."""
import ast
import math
import pathlib
import re

import agent
from gpuplane import vocab
from gpuplane.cli import importer

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_roles():
    assert vocab.role("train/loss") == "train"
    assert vocab.role("tr_loss") == "train"          # `tr`: rules.py knew it, semantic did not
    assert vocab.role("loss") == "train"             # a bare loss is the training loss
    assert vocab.role("val_loss") == "eval"
    assert vocab.role("eval/accuracy") == "eval"
    assert vocab.role("test/acc") == "eval"
    for k in ("sys/gpu0/util", "system/cpu", "gpu/mem", "host/rss_mb"):
        assert vocab.role(k) == "system" and vocab.is_system(k)
        assert not vocab.is_loss(k) and vocab.direction(k) is None
    assert vocab.role("compare/a") == "other"
    assert vocab.role("epoch") == "other"


def test_loss_like():
    for k in ("train/loss", "val_nll", "ppl", "eval/perplexity", "mse", "val/mae",
              "train/rmse", "val/error"):
        assert vocab.is_loss(k), k
    for k in ("train/acc", "eval/f1", "lr", "compare/a", "sys/loss"):
        assert not vocab.is_loss(k), k


def test_direction_definition_then_name_then_unknown():
    assert vocab.direction("val/mse") == "min"         # semantic.py did not count mse
    assert vocab.direction("eval/accuracy") == "max"
    assert vocab.direction("val_loss_acc") == "max"    # the last word that says
    assert vocab.direction("eval/accuracy", "min") == "min"    # a definition wins
    assert vocab.direction("compare/a") is None        # tensorboardX add_scalars series
    assert vocab.direction("compare/a", "max") == "max"
    for k in ("epoch", "train/lr", "global_step", "momentum"):
        assert vocab.direction(k) is None, k           # counters and schedules
    assert vocab.describe("compare/b")["direction_from"] is None
    assert vocab.describe("compare/b", "max")["direction_from"] == "definition"
    assert vocab.describe("val/loss")["direction_from"] == "name"


def test_base_pairs_eval_with_train():
    assert vocab.base("train/loss") == vocab.base("val_loss") == vocab.base("loss") == "loss"
    assert vocab.base("tr_acc") == vocab.base("eval/acc")


def test_lr_keys():
    for k in ("lr", "train/lr", "learning_rate", "opt/lr_group0", "lr0"):
        assert vocab.is_lr(k), k
    assert not vocab.is_lr("train/loss") and not vocab.is_lr("sys/lr")


def test_nonfinite_encoding_round_trips():
    for v, w in ((math.nan, "NaN"), (math.inf, "Infinity"), (-math.inf, "-Infinity")):
        assert vocab.encode(v) == w
        d = vocab.decode(w)
        assert (math.isnan(d) and math.isnan(v)) or d == v
    assert vocab.encode(1.5) == 1.5 and vocab.encode(None) is None
    assert vocab.encode_stored(None) == "NaN"     # SQLite stores NaN as NULL
    assert math.isnan(vocab.decode(None)) and vocab.decode("2.5") == 2.5


def test_checkpoint_step_is_the_agents():
    """One checkpoint_step: agent.py's (it is copied alone to GPU hosts and imports nothing
    of the server), and the importer calls it, so a watched directory and an imported one
    give a checkpoint the same step."""
    for name, want in (("epoch=2-val_loss=0.12.ckpt", (None, 2.0)),
                       ("val_loss=0.12.ckpt", (None, None)),
                       ("model_v2.safetensors", (None, None)),
                       ("epoch=3-step=1200.ckpt", (1200, 3.0)),
                       ("ckpt-1500.pt", (1500, None)),
                       ("checkpoint-500", (500, None))):
        assert agent.checkpoint_step(name) == want, name
        assert importer.checkpoint_step(name) == want, name


# -- no second copy ------------------------------------------------------------------------

def _sources():
    files = [ROOT / "mcp_server.py", *sorted((ROOT / "gpuplane").rglob("*.py"))]
    return [f for f in files if f.name != "vocab.py"]


def _strings(path):
    """Every string constant of a Python file (f-string pieces included)."""
    tree = ast.parse(path.read_text())
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


# The importer's checkpoint_step only calls the agent's (the test above proves they agree).
_ALLOWED_DEFS = {"gpuplane/cli/importer.py": ("checkpoint_step",)}
_WORD_SETS = [vocab.LOSS_WORDS, vocab.EVAL_WORDS, vocab.TRAIN_WORDS, vocab.MAX_WORDS]


def _copies(path, rel):
    """What in one Python file decides a key's meaning a second time."""
    bad = []
    text = path.read_text()
    for s in _strings(path):
        if s in (vocab.NAN, vocab.INF, vocab.NEG_INF):
            bad.append(f"{rel}: the wire spelling {s!r} (use vocab.encode/decode)")
        if s in vocab.SYSTEM_PREFIXES or s in {p + "%" for p in vocab.SYSTEM_PREFIXES}:
            bad.append(f"{rel}: the system prefix {s!r} (use vocab.is_system)")
        if re.search(r"NOT LIKE '(sys|system|gpu|host)/%'", s):
            bad.append(f"{rel}: a system-key filter in SQL (use gpuplane.db.not_system)")
    for node in ast.walk(ast.parse(text)):
        # a set/tuple/list literal holding three or more words of one vocabulary list
        if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
            elts = {e.value for e in node.elts if isinstance(e, ast.Constant)
                    and isinstance(e.value, str)}
            for ws in _WORD_SETS:
                if len(elts & ws) >= 3:
                    bad.append(f"{rel}:{node.lineno}: a word list {sorted(elts & ws)}")
        if isinstance(node, ast.FunctionDef) and node.name in (
                "checkpoint_step", "direction", "is_system", "is_loss", "words") \
                and node.name not in _ALLOWED_DEFS.get(str(rel), ()):
            bad.append(f"{rel}:{node.lineno}: def {node.name} (ask gpuplane/vocab.py)")
    if re.search(r"startswith\(\s*\(?\s*[\"'](sys|system|gpu|host)/[\"']", text):
        bad.append(f"{rel}: startswith a system prefix (use vocab.is_system)")
    return bad


def test_no_second_copy_of_the_vocabulary():
    """A word list, a system prefix, a non-finite spelling or a checkpoint_step outside
    gpuplane/vocab.py (agent.py for checkpoint_step) is a second owner: this fails."""
    bad = [b for f in _sources() for b in _copies(f, f.relative_to(ROOT))]
    assert not bad, "second copies of the vocabulary:\n" + "\n".join(bad)


def test_the_guard_catches_the_old_copies(tmp_path):
    """The guard finds each kind of copy this issue found, so it is not vacuous."""
    f = tmp_path / "copy.py"
    f.write_text('_LOSS_WORDS = {"loss", "nll", "perplexity", "ppl"}\n'
                 'def is_system(key):\n    return key.startswith(("sys/", "system/"))\n'
                 'def _wire(v):\n    return "Infinity" if v > 0 else "-Infinity"\n'
                 'Q = "SELECT id FROM metric_keys WHERE key NOT LIKE \'sys/%\'"\n'
                 'def checkpoint_step(name):\n    return None, None\n')
    found = "\n".join(_copies(f, "copy.py"))
    for what in ("word list", "def is_system", "startswith a system prefix",
                 "wire spelling 'Infinity'", "system-key filter in SQL",
                 "def checkpoint_step"):
        assert what in found, what


def test_agent_has_the_only_checkpoint_step_body():
    src = (ROOT / "gpuplane" / "cli" / "importer.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(src))
              if isinstance(n, ast.FunctionDef) and n.name == "checkpoint_step")
    body = ast.unparse(fn)
    assert "from agent import checkpoint_step" in body and "re." not in body


def test_dashboard_asks_the_server():
    """The JS decides no key's meaning: roles and directions come in the summaries."""
    bad = []
    for f in sorted((ROOT / "static" / "js").rglob("*.js")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r"startsWith\([\"'](sys|system|gpu|host)/", line) or \
                    re.search(r"/\(?[a-z|]*\b(val|eval|loss|acc)\b[a-z|]*\)?/\.test", line):
                bad.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not bad, "the dashboard decides a key's meaning itself:\n" + "\n".join(bad)
