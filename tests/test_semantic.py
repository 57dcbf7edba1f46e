"""The semantic layer on constructed runs whose right answer is known (no server)."""
import math
import random

import pytest

from gpuplane import semantic as A

NOW = 1_764_403_200_000


def key(name, values, direction=None, start=0, ts0=NOW - 600_000, every_ms=1000):
    direction = direction or ("max" if "acc" in name else "min")
    pts = [[start + i, v] for i, v in enumerate(values)]
    finite = [(s, v) for s, v in pts if v is not None and math.isfinite(v)]
    best = (min if direction == "min" else max)(finite, key=lambda p: p[1]) if finite else None
    last = pts[-1] if pts else None
    return {"key": name, "direction": direction, "points": pts, "count": len(pts),
            "latest": last and {"step": last[0], "value": A.wire(float(last[1])),
                                "ts": ts0 + (len(pts) - 1) * every_ms},
            "best": best and {"step": best[0], "value": best[1]}}


def run(state="SUCCEEDED", run_id=1, job_id=7, config=None, **kw):
    job = {"id": job_id, "command": ["python", "train.py"], "working_dir": "/w",
           "cpu_only": False, "project": "p", "experiment": ""} if job_id else None
    return {"id": run_id, "job_id": job_id, "state": state, "config": config or {},
            "started_at": NOW - 600_000, "created_at": NOW - 600_000, "job": job, **kw}


def decaying(n=200, start=2.0, floor=0.2, rate=0.03, noise=0.01, seed=0):
    rng = random.Random(seed)
    return [floor + (start - floor) * math.exp(-rate * i) + rng.gauss(0, noise)
            for i in range(n)]


def tools(result):
    return [a["tool"] for a in result["next_actions"]]


# -- diagnose_run ---------------------------------------------------------------------------

def test_healthy_finished_run():
    r = A.diagnose_run(run(), [key("train/loss", decaying())])
    assert r["verdict"] == "healthy", r
    assert r["primary_key"] == "train/loss"
    assert "get_best_checkpoint" in tools(r)
    assert all(set(a) == {"tool", "arguments", "why"} for a in r["next_actions"])


def test_healthy_running_run_says_wait():
    vals = decaying(n=100, rate=0.01)        # still falling at the end
    r = A.diagnose_run(run("RUNNING"), [key("train/loss", vals, ts0=NOW - 100_000)],
                       now_ms=NOW)
    assert r["verdict"] == "healthy", r
    assert r["next_actions"][0] == {"tool": "wait_for_job", "arguments":
                                    {"job_id": 7, "timeout_s": 600},
                                    "why": r["next_actions"][0]["why"]}


def test_nan_loss_is_diverging():
    vals = decaying(50) + [float("nan")]
    r = A.diagnose_run(run("RUNNING"), [key("train/loss", vals, ts0=NOW - 50_000)],
                       now_ms=NOW)
    assert r["verdict"] == "diverging"
    assert "NaN" in r["evidence"][0]
    assert tools(r)[0] == "cancel_job"


def test_rising_loss_is_diverging():
    vals = decaying(100) + [0.3 + 0.05 * i for i in range(60)]
    r = A.diagnose_run(run(), [key("train/loss", vals)])
    assert r["verdict"] == "diverging", r
    assert "cancel_job" not in tools(r)      # the run has ended already


def test_overfitting_eval_worse_train_better():
    train = decaying(200, rate=0.02)
    val = [0.6 + 1.4 * math.exp(-0.05 * i) + max(0, i - 80) * 0.004 for i in range(200)]
    r = A.diagnose_run(run("RUNNING"), [key("train/loss", train, ts0=NOW - 200_000),
                                        key("val/loss", val, ts0=NOW - 200_000)], now_ms=NOW)
    assert r["verdict"] == "overfitting", r
    assert r["primary_key"] == "val/loss"
    assert {"get_best_checkpoint", "cancel_job"} <= set(tools(r))


def test_plateau_while_running():
    # learnt, then flat for the last two thirds (a flat line from the start does not learn)
    vals = decaying(300, rate=0.08)
    r = A.diagnose_run(run("RUNNING"), [key("train/loss", vals, ts0=NOW - 300_000)],
                       now_ms=NOW)
    assert r["verdict"] == "plateaued", r
    assert tools(r)[0] == "cancel_job"


def test_converged_finished_run_is_healthy_not_plateaued():
    vals = decaying(300, rate=0.08)          # flat for the last two thirds
    r = A.diagnose_run(run("SUCCEEDED"), [key("train/loss", vals)])
    assert r["verdict"] == "healthy"
    assert any("converged" in e for e in r["evidence"])


def test_stalled_running_run():
    vals = decaying(100, rate=0.01)
    # 100 points over 100 s, then nothing for 20 minutes.
    k = key("train/loss", vals, ts0=NOW - 1_300_000, every_ms=1000)
    r = A.diagnose_run(run("RUNNING", started_at=NOW - 1_300_000), [k], now_ms=NOW)
    assert r["verdict"] == "stalled", r
    assert "no metric point for" in r["evidence"][0]


def test_too_early():
    r = A.diagnose_run(run("RUNNING"), [key("train/loss", [1.0, 0.9, 0.8],
                                            ts0=NOW - 3000)], now_ms=NOW)
    assert r["verdict"] == "too early to tell"
    assert tools(r) == ["wait_for_job", "diagnose_run"]
    r = A.diagnose_run(run("RUNNING"), [], now_ms=NOW)
    assert r["verdict"] == "too early to tell"


def test_failed_run_points_to_explain_failure():
    r = A.diagnose_run(run("FAILED", failure_kind="EXIT_CODE", exit_code=1),
                       [key("train/loss", decaying())])
    assert r["verdict"] == "failed"
    assert r["next_actions"][0]["arguments"] == {"job_id": 7}
    assert tools(r)[0] == "explain_failure"


def test_max_direction_accuracy_rising_is_healthy_falling_is_diverging():
    up = [1 - v / 2 for v in decaying()]
    assert A.diagnose_run(run(), [key("acc", up, "max")])["verdict"] == "healthy"
    down = up[:100] + [up[99] - 0.01 * i for i in range(80)]
    assert A.diagnose_run(run(), [key("acc", down, "max")])["verdict"] == "diverging"


def test_noisy_but_healthy_curve_is_not_diverging():
    vals = decaying(400, noise=0.08, seed=3)
    assert A.diagnose_run(run(), [key("train/loss", vals)])["verdict"] == "healthy"


def test_wire_strings_are_read():
    k = key("train/loss", decaying(30))
    k["points"][-1][1] = "Infinity"
    k["latest"]["value"] = "Infinity"
    assert A.diagnose_run(run(), [k])["verdict"] == "diverging"


# -- compare_runs ---------------------------------------------------------------------------

def test_compare_runs_winner_noise_and_config_diff():
    a = {"run": run(run_id=1, config={"lr": 0.1, "epochs": 3}),
         "keys": [key("val/loss", decaying(100, floor=0.5, noise=0.005, seed=1))]}
    b = {"run": run(run_id=2, config={"lr": 0.01, "epochs": 3}),
         "keys": [key("val/loss", decaying(100, floor=0.3, noise=0.005, seed=2))]}
    r = A.compare_runs([a, b])
    assert r["winner"] == 2 and r["significant"] is True
    m = r["metrics"][0]
    assert m["key"] == "val/loss" and m["winner"] == 2 and m["runner_up"] == 1
    assert m["margin"] == pytest.approx(0.2, abs=0.03)
    assert r["config_diff"] == {"lr": {"1": 0.1, "2": 0.01}}
    assert r["next_actions"][0] == {"tool": "get_best_checkpoint",
                                    "arguments": {"run_id": 2},
                                    "why": r["next_actions"][0]["why"]}
    per = {p["run_id"]: p for p in m["runs"]}
    assert per[2]["best_step"] is not None and per[2]["final_step"] == 99


def test_compare_runs_within_noise_is_not_significant():
    a = {"run": run(run_id=1), "keys": [key("loss", decaying(100, floor=0.5, noise=0.05,
                                                               seed=1))]}
    b = {"run": run(run_id=2), "keys": [key("loss", decaying(100, floor=0.49, noise=0.05,
                                                               seed=2))]}
    r = A.compare_runs([a, b])
    assert r["significant"] is False
    again = next(a for a in r["next_actions"] if a["tool"] == "submit_job")
    assert again["arguments"] == {"command": ["python", "train.py"], "working_dir": "/w",
                                  "project": "p"}, again
    assert "within the runs' noise" in r["summary"]


def test_compare_runs_max_direction_and_missing_key():
    a = {"run": run(run_id=1), "keys": [key("val/acc", [0.5, 0.7, 0.8], "max")]}
    b = {"run": run(run_id=2), "keys": [key("val/acc", [0.5, 0.6, 0.65], "max"),
                                        key("train/loss", [1, 0.5])]}
    r = A.compare_runs([a, b])
    acc = next(m for m in r["metrics"] if m["key"] == "val/acc")
    assert acc["winner"] == 1
    loss = next(m for m in r["metrics"] if m["key"] == "train/loss")
    assert loss["winner"] == 2 and loss["runner_up"] is None
    with pytest.raises(ValueError, match="no run has the metric"):
        A.compare_runs([a, b], keys=["nope"])
    with pytest.raises(ValueError):
        A.compare_runs([a])


# -- checkpoints ----------------------------------------------------------------------------

def ckpt(cid, step, train=None, ev=None, run_id=1):
    return {"id": cid, "run_id": run_id, "step": step, "path": f"/c/{cid}.pt",
            "training": {"val/loss": train} if train is not None else {},
            "evaluation": {"val/loss": ev} if ev is not None else None}


def test_best_checkpoint_prefers_evaluations():
    cks = [ckpt(1, 100, train=0.5), ckpt(2, 200, train=0.1),       # best training value
           ckpt(3, 300, train=0.4, ev=0.35), ckpt(4, 400, train=0.3, ev=0.32)]
    r = A.get_best_checkpoint(cks, "val/loss", "min")
    assert r["checkpoint"]["checkpoint_id"] == 4 and r["source"] == "evaluation"
    assert r["runner_up"]["checkpoint_id"] == 3
    assert r["margin"] == pytest.approx(0.03)
    assert "lowest evaluation val/loss" in r["reason"]


def test_best_checkpoint_by_training_value_suggests_evaluation():
    cks = [ckpt(i, i * 100, train=v) for i, v in enumerate([0.9, 0.4, 0.2, 0.3], 1)]
    r = A.get_best_checkpoint(cks, "val/loss", "min")
    assert r["checkpoint"]["checkpoint_id"] == 3 and r["source"] == "training"
    assert r["runner_up"]["checkpoint_id"] == 4
    assert tools(r)[0] == "evaluate_checkpoint"
    r = A.get_best_checkpoint(cks, "val/loss", "max")
    assert r["checkpoint"]["checkpoint_id"] == 1


def test_best_checkpoint_with_nothing_to_rank():
    r = A.get_best_checkpoint([ckpt(1, 10)], "val/loss", "min")
    assert r["checkpoint"] is None and tools(r) == ["evaluate_checkpoint"]
    assert A.get_best_checkpoint([], "val/loss", "min")["reason"] == "there are no checkpoints"


def test_compare_checkpoints_ranks_and_leaves_nan_unranked():
    cks = [ckpt(1, 1, train=float("nan")), ckpt(2, 2, train=0.2), ckpt(3, 3, ev=0.5)]
    r = A.compare_checkpoints(cks, "val/loss", "min")
    assert [x["checkpoint_id"] for x in r["ranked"]] == [3, 2]
    assert [x["rank"] for x in r["ranked"]] == [1, 2]
    assert [x["checkpoint_id"] for x in r["unranked"]] == [1]


def test_nearest_value():
    assert A.nearest_value([(0, 1.0), (10, 2.0), (20, 3.0)], 12) == 2.0
    assert A.nearest_value([], 5) is None


# -- explain_failure ------------------------------------------------------------------------

def lines(*texts):
    return [{"line_no": i, "text": t} for i, t in enumerate(texts, 1)]


def job(state="FAILED", **kw):
    return {"id": 5, "state": state, "working_dir": "/w", "failure_kind": "EXIT_CODE",
            "exit_code": 1, **kw}


TRACE = ("Traceback (most recent call last):", '  File "train.py", line 3, in <module>')


def test_explain_cuda_oom():
    r = A.explain_failure(job(failure_kind="OOM"), lines(
        "step 1", *TRACE, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert r["kind"] == "CUDA_OOM"
    assert r["exception"].startswith("torch.OutOfMemoryError")
    assert any("batch size" in s for s in r["suggestions"])
    assert r["lines"][0]["text"].startswith("Traceback")


def test_explain_missing_module():
    r = A.explain_failure(job(), lines(*TRACE, "ModuleNotFoundError: No module named 'torch'"))
    assert r["kind"] == "MISSING_MODULE"
    assert r["exception"] == "ModuleNotFoundError: No module named 'torch'"
    assert "import" in r["summary"]


def test_explain_missing_file():
    r = A.explain_failure(job(exit_code=2), lines(
        "python: can't open file '/w/trian.py': [Errno 2] No such file or directory"))
    assert r["kind"] == "MISSING_FILE"


def test_explain_nccl_suggests_retry():
    r = A.explain_failure(job(), lines("ok", "NCCL error in: ProcessGroupNCCL.cpp:1191, "
                                             "unhandled system error"))
    assert r["kind"] == "NCCL" and tools(r)[0] == "retry_job"


def test_explain_killed_by_signal():
    r = A.explain_failure(job(exit_code=-9), lines("epoch 1", "epoch 2"))
    assert r["kind"] == "KILLED" and "SIGKILL" in r["suggestions"][0]
    r = A.explain_failure(job(exit_code=137), lines("epoch 1"))
    assert r["kind"] == "KILLED"


def test_explain_plain_exception_and_exit_code():
    r = A.explain_failure(job(), lines(*TRACE, "ValueError: bad shape (3, 4)"))
    assert r["kind"] == "PYTHON_EXCEPTION"
    assert r["exception"] == "ValueError: bad shape (3, 4)"
    assert "bad shape" in r["summary"]
    r = A.explain_failure(job(exit_code=3), lines("nothing useful"))
    assert r["kind"] == "EXIT_CODE" and "code 3" in r["summary"]


def test_explain_dispatch_failed_and_not_failed():
    r = A.explain_failure(job(failure_kind="DISPATCH_FAILED", exit_code=None), [])
    assert r["kind"] == "DISPATCH_FAILED"
    r = A.explain_failure(job(state="SUCCEEDED", run_id=3), [])
    assert r["kind"] == "NOT_FAILED" and tools(r) == ["diagnose_run"]


def test_short_eval_curve_falls_back_to_train_curve():
    r = A.diagnose_run(run(), [key("train/loss", decaying()), key("val/loss", [0.9, 0.5, 0.4])])
    assert r["verdict"] == "healthy" and r["primary_key"] == "train/loss"
    assert any("judged train/loss instead" in e for e in r["evidence"])


def test_config_diff_reads_the_command_line():
    a = run(run_id=1, config={"command": ["python", "t.py", "--lr", "0.1", "--epochs=3",
                                          "--fast"]})
    b = run(run_id=2, config={"command": ["python", "t.py", "--lr", "0.01", "--epochs=3"]})
    d = A.config_diff([a, b])
    assert d["lr"] == {"1": 0.1, "2": 0.01}
    assert d["fast"] == {"1": True, "2": None}
    assert "epochs" not in d


def test_a_long_raw_curve_is_judged_from_bucket_means():
    vals = decaying(100_000, rate=0.0001, noise=0.01)
    f = A.curve_facts([[i, v] for i, v in enumerate(vals)], "min")
    assert f["points"] == 1000 and f["best"]["step"] > 80_000
    assert A.diagnose_run(run(), [key("train/loss", vals)])["verdict"] == "healthy"
