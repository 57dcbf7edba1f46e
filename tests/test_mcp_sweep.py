"""The agent's loop by MCP tools alone, on real PyTorch training (CPU): from an empty server
to a recommendation, counting the calls. A sweep of four learning rates, one wait for the
sweep, a table of the sweep by epoch, evaluations of the most promising checkpoints, one
wait for them, and the checkpoint to keep with whether its margin is beyond the noise. No
raw series, no logs, no workaround: the goal is at most 30 calls (issue 20)."""
import importlib.util
import os
import shutil
import sys

import pytest

from procs import ROOT
from test_mcp import check_next_actions, mcp_env, session

SCRIPTS = ROOT / "tests" / "data" / "torch_sweep"
LRS = ("1.0", "0.3", "0.05", "0.005")
MOST_CALLS = 30


@pytest.fixture(scope="module", autouse=True)
def need_torch():
    if importlib.util.find_spec("torch") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("torch is not installed; .ci/run installs it (pip install torch==2.13.0)")
        pytest.skip("torch is not installed: `.venv/bin/pip install torch==2.13.0` (CPU)")


def test_a_sweep_to_a_recommendation_in_few_calls(live_server, agent, tmp_path):
    api = live_server.api
    token = api.post("/api/v1/tokens", {"name": "agent", "scope": "write"}, expect=201)["token"]
    work = tmp_path / "project"
    shutil.copytree(SCRIPTS, work)
    calls = []

    async def body(call_raw, client):
        async def call(tool, **args):
            calls.append(tool)
            is_error, data = await call_raw(tool, **args)
            assert not is_error, (tool, data)
            check_next_actions(data)
            return data

        def suggested(result, tool):
            return [a["arguments"] for a in result["next_actions"] if a["tool"] == tool]

        assert "GPUs free" in (await call("get_status"))["summary"]
        # The first thing an agent sets up: the metric that decides, for an experiment that
        # has no run yet (the tool creates the scope).
        await call("set_primary_metric", key="test/acc", direction="max", project="loop",
                   experiment="lr")
        jobs = []
        for lr in LRS:
            j = await call("submit_job", command=[
                sys.executable, "train.py", "--lr", lr, "--logdir", f"tb/{lr}",
                "--checkpoint-dir", f"ckpt/{lr}"], working_dir=str(work), name=f"lr-{lr}",
                cpu_only=True, project="loop", experiment="lr",
                eval_command=[sys.executable, "eval.py"])
            jobs.append(j["id"])

        # One wait for the sweep; it says what to do next with the real run ids.
        w = await call("wait_for_jobs", job_ids=jobs, timeout_s=600)
        assert [j["state"] for j in w["jobs"]] == ["SUCCEEDED"] * 4, w
        run_ids = [j["run_id"] for j in w["jobs"]]
        assert suggested(w, "compare_runs") == [{"run_ids": run_ids}]

        c = await call("compare_runs", run_ids=run_ids, key="val/acc")
        # paths and bookkeeping flags differ between the runs too, but are not settings
        assert set(c["config_diff"]) == {"lr"}, c["config_diff"]
        assert c["winner"] in run_ids

        runs = await call("list_runs", project="loop", experiment="lr")
        assert sorted(r["id"] for r in runs["runs"]) == sorted(run_ids)
        params = {r["id"]: r["params"] for r in runs["runs"]}
        assert {str(params[r]["lr"]) for r in run_ids} == {str(float(x)) for x in LRS}
        assert all("logdir" not in p and "checkpoint_dir" not in p for p in params.values())

        # The sweep epoch by epoch, in one table: a row per eval step, a column per run.
        t = await call("get_metric_table", run_ids=run_ids)       # the eval metrics
        assert t["columns"] == ["step"] + [f"{r}:{k}" for r in run_ids
                                           for k in ("val/acc", "val/loss")], t
        assert [row[0] for row in t["rows"]] == [20, 40, 60, 80], t
        assert all(v is not None for row in t["rows"] for v in row), t

        s = await call("get_metric_summary", run_id=c["winner"])
        assert {k["key"] for k in s["keys"]} >= {"train/loss", "val/loss", "val/acc"}
        assert all(k.get("role") != "system" for k in s["keys"])
        d = await call("diagnose_run", run_id=c["winner"])
        # The winner is often lr=1.0, plain SGD on mini-batches: "healthy" here; one CI run
        # of 2026-12-04 (under load, the same deterministic curve) said "unstable" (spikes
        # it recovers from) — a judgement on the edge, noted for issue 39. Never a verdict
        # that calls the winning run broken.
        assert d["verdict"] in ("healthy", "plateaued", "unstable"), d

        # The candidates by the training-time val/acc, across the experiment; evaluate the
        # last three checkpoints of the two best runs on held-out data.
        best_two = sorted(run_ids, key=lambda r: -next(
            p["best"] for m in c["metrics"] if m["key"] == "val/acc" for p in m["runs"]
            if p["run_id"] == r))[:2]
        cks = [ck for r in best_two
               for ck in (await call("list_checkpoints", run_id=r))["checkpoints"][-3:]]
        evals = []
        for ck in cks:
            e = await call("evaluate_checkpoint", checkpoint_id=ck["id"])
            evals.append(suggested(e, "wait_for_job")[0]["job_id"])
            # it points at the checkpoint's own training run, a real id
            assert suggested(e, "compare_checkpoints") == [{"run_ids": [ck["run_id"]]}]

        # One wait for the evaluations; the next step is the recommendation for the scope.
        w = await call("wait_for_jobs", job_ids=evals, timeout_s=600)
        assert {j["state"] for j in w["jobs"]} == {"SUCCEEDED"}, w
        assert {j["kind"] for j in w["jobs"]} == {"EVALUATE"}
        assert {"project": "loop", "experiment": "lr"} in suggested(w, "get_best_checkpoint")
        assert suggested(w, "compare_checkpoints") == [{"run_ids": sorted(best_two)}], \
            ([(ck["id"], ck["run_id"]) for ck in cks], w["jobs"])

        rec = await call("get_best_checkpoint", project="loop", experiment="lr")
        assert rec["key"] == "test/acc" and rec["source"] == "evaluation", rec
        pick = rec["checkpoint"]
        assert pick["checkpoint_id"] in {ck["id"] for ck in cks}
        # every result of the deciding evaluation, and whether the margin is beyond noise
        assert set(pick["evaluation"]) >= {"test/acc", "test/loss"}, pick
        assert isinstance(rec["significant"], bool) and rec["noise"] is not None, rec
        assert ("beyond the noise" in rec["reason"]) == rec["significant"], rec["reason"]
        # The evaluations stay out of the trainings, and each training shows its best.
        runs = await call("list_runs", project="loop", experiment="lr")
        assert sorted(r["id"] for r in runs["runs"]) == sorted(run_ids)
        scored = {r["id"]: r["best_evaluation"] for r in runs["runs"]}
        assert {r for r, b in scored.items() if b} == set(best_two), scored
        assert max((b["value"], b["checkpoint_id"]) for b in scored.values() if b)[1] \
            == pick["checkpoint_id"]

    session(mcp_env(live_server.url, token, tmp_path), body)
    assert len(calls) <= MOST_CALLS, calls
    assert calls.count("wait_for_jobs") == 2 and "wait_for_job" not in calls
    assert not {"get_metric_series", "get_job_logs"} & set(calls), calls
    print(f"\n{len(calls)} tool calls: {', '.join(calls)}")
