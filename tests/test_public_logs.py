"""Published training logs (bench/data/public_logs/: trainer_state.json, Keras and
Lightning CSV logs, YOLO results.csv from public repositories, labelled by reading their
numbers): the importer reads each as its source names its steps and keys, and
`gpuplane import-run` brings them into a real server."""
import json
import pathlib
import re

import pytest

from gpuplane import cli
from gpuplane.cli import importer

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOGS = ROOT / "bench" / "data" / "public_logs"
CORPUS = json.loads((LOGS / "corpus.json").read_text())
KINDS = {"hf_trainer_state", "keras_csv", "lightning_csv", "yolo_results", "text_log"}


def run(run_id):
    return next(r for r in CORPUS["runs"] if r["id"] == run_id)


def points(run_id):
    out = {}
    for key, step, value in importer.read_log(str(LOGS / run(run_id)["file"])):
        out.setdefault(key, []).append((step, value))
    return out


def test_every_run_has_its_source_a_label_and_a_half():
    ids = set()
    for r in CORPUS["runs"]:
        assert r["id"] not in ids
        ids.add(r["id"])
        assert r["kind"] in KINDS, r["id"]
        assert re.fullmatch(r"[0-9a-f]{40}", r["commit"]), r["id"]
        assert r["repo"].count("/") == 1 and r["path"], r["id"]
        assert (LOGS / r["file"]).is_file(), r["id"]
        assert r["label"] in CORPUS["labels"] or r["label"] == "ambiguous", r["id"]
        assert r["why"] and r["half"] in ("tune", "holdout"), r["id"]
        assert points(r["id"]), r["id"]


def test_trainer_state_keys_and_steps_as_logged():
    p = points("anitha1406-telugu")
    assert p["loss"][0] == (50, 4.3588) and p["loss"][-1] == (900, 0.1022)
    assert [s for s, _ in p["eval_loss"]] == [187, 374, 561, 748, 935]
    assert "learning_rate" in p and "step" not in p


def test_keras_log_appended_by_a_second_fit_keeps_every_epoch():
    """The CatClassifier log restarts its epochs at 0 after two: the second fit's rows
    come after the first's instead of overwriting them."""
    p = points("brandtkaufmann-cat")
    assert [s for s, _ in p["loss"]] == list(range(50))
    assert p["loss"][0][1] > p["loss"][2][1] > p["loss"][-1][1]
    assert set(p) == {"accuracy", "loss", "val_accuracy", "val_loss"}


def test_lightning_rows_at_their_step_empty_cells_no_point():
    p = points("hcdescamps-cv")
    assert [s for s, _ in p["val_loss"]][:2] == [1718, 3437] and len(p["val_loss"]) == 6
    assert len(p["train_loss"]) == 171 and p["train_loss"][0][0] == 49
    assert "step" not in p and "epoch" in p


def test_yolo_results_keys_as_named_at_their_epoch():
    p = points("alyssajz-berry-exp")
    assert {"train/box_loss", "val/obj_loss", "metrics/mAP_0.5:0.95", "x/lr0"} <= set(p)
    assert [s for s, _ in p["val/box_loss"]] == list(range(10))


def test_a_csv_that_is_no_training_log_is_not_one(tmp_path):
    data = tmp_path / "iris.csv"
    data.write_text("sepal_length,sepal_width,species\n5.1,3.5,setosa\n")
    assert importer.csv_columns(str(data)) is None
    prices = tmp_path / "prices.csv"
    prices.write_text("epoch,price\n1,3.5\n")        # no metric named
    assert importer.csv_columns(str(prices)) is None


@pytest.fixture
def run_cli(live_server, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("GPUCTL_TOKEN", live_server.token)
    monkeypatch.setenv("GPUCTL_HOME", str(tmp_path / "home"))

    def go(*argv, code=0):
        got = cli.main(["--server", live_server.url, *argv])
        out = capsys.readouterr()
        assert got == code, (argv, out.err)
        return out
    return go


def test_import_run_reads_a_log_file_and_a_directory_of_logs(run_cli, live_server, tmp_path):
    api = live_server.api
    one = LOGS / run("tashu014-lora-imdb")["file"]
    first = json.loads(run_cli("import-run", str(one), "--project", "pub", "--json").out)
    again = json.loads(run_cli("import-run", str(one), "--project", "pub", "--json").out)
    assert first["created"] and not again["created"] and again["run_id"] == first["run_id"]
    keys = {k["key"]: k for k in api.get(f"/api/v1/runs/{first['run_id']}/metrics")["keys"]}
    assert keys["loss"]["count"] == 18 and keys["eval_loss"]["count"] == 3
    # a Lightning directory: the launch dir (version_0) is no part of the keys
    d = tmp_path / "lightning_logs" / "version_0"
    d.mkdir(parents=True)
    (d / "metrics.csv").write_text((LOGS / run("hcdescamps-cv")["file"]).read_text())
    out = json.loads(run_cli("import-run", str(tmp_path / "lightning_logs"), "--project",
                             "pub", "--json").out)
    keys = {k["key"]: k for k in api.get(f"/api/v1/runs/{out['run_id']}/metrics")["keys"]}
    assert keys["val_loss"]["count"] == 6 and keys["train_loss"]["count"] == 171
    bad = tmp_path / "notes.csv"
    bad.write_text("a,b\n1,2\n")
    assert "not a training log" in run_cli("import-run", str(bad), "--project", "pub",
                                           code=1).err


# -- the judgement on them ----------------------------------------------------------------

def keys_of(run_id):
    """The run's keys as the semantic layer gets them (raw points: the logs are short)."""
    from gpuplane import vocab
    out = []
    for key, pts in points(run_id).items():
        d = vocab.name_direction(key)
        best = (min if d == "min" else max)(pts, key=lambda p: p[1]) if d else None
        out.append({"key": key, "direction": d, "points": [list(p) for p in pts],
                    "count": len(pts), "latest": {"step": pts[-1][0], "value": pts[-1][1],
                                                  "ts": None},
                    "best": best and {"step": best[0], "value": best[1]}})
    return out


def diagnose(run_id, state="SUCCEEDED", events=()):
    from gpuplane import semantic
    return semantic.diagnose_run({"id": 1, "job_id": None, "state": state},
                                 keys_of(run_id), events)


def test_five_evals_rising_while_the_loss_falls_is_overfitting():
    """Whisper fine-tune: eval_loss 0.307 -> 0.468 over its 5 evals (once every 1000
    steps) while the 4-decimal loss falls to 0.0002: judged from the evals there are, with
    the confidence saying how few."""
    d = diagnose("merlinmy-whisper-hi")
    assert d["verdict"] == "overfitting" and d["primary_key"] == "eval_loss", d
    assert d["confidence"]["level"] == "low"


def test_a_loss_that_creeps_towards_the_mean_is_not_learning():
    d = diagnose("diogo-lstm-v3")
    assert d["verdict"] == "not learning", d
    assert "under 2%" in d["confidence"]["why"]


def test_a_sparse_ended_run_is_judged_a_running_one_waits():
    """4 evals and 8 train logs: an ended run is judged from them; the same points while
    it runs are too early."""
    assert diagnose("jimmymendez-canine")["verdict"] == "healthy"
    assert diagnose("jimmymendez-canine", state="RUNNING")["verdict"] == "too early to tell"


def test_an_ended_run_without_points_has_no_data_and_says_why():
    from gpuplane import semantic
    d = semantic.diagnose_run({"id": 1, "job_id": None, "state": "CANCELLED"}, [])
    assert d["verdict"] == "no data" and "without logging a metric" in d["evidence"][0]
    assert "import-run" in d["advice"] and "wait" not in d["advice"]


def test_a_divergence_that_recovered_is_unstable_beside_its_event():
    """A LOSS_DIVERGED event standing on a run whose loss came back down (the Telugu
    fine-tune's loss, 4.36 -> 0.10, against an event that saw it at 2.5x a first level of
    1.5): the verdict is not calm beside the critical event, and says when it came back."""
    ev = {"type": "LOSS_DIVERGED", "severity": "critical", "step": 100,
          "message": "loss has risen", "data": {"key": "loss", "first_level": 1.5}}
    d = diagnose("anitha1406-telugu", events=[ev])
    assert d["verdict"] == "unstable", d
    assert d["summary"] == "loss diverged at step 100 and recovered by step 250"
    assert diagnose("anitha1406-telugu")["verdict"] == "healthy"
