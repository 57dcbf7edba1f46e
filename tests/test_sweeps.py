"""Sweeps: expansion and checks (pure), the early-stopping rules (pure), and three sweeps
run at once on one real server and agent: a grid within its parallel limit, one under
ASHA made from a TOML file by the CLI, and one whose trials all fail."""
import json
import re
import sys

import pytest

from gpuplane import cli, pruning, sweeps
from procs import AgentProc, ServerProc, kill_leftover_jobs, wait_for

# -- expansion and checks -----------------------------------------------------------------


def test_a_grid_expands_to_every_combination_in_order():
    spec, params = sweeps.parse_spec({"command": "t --a {a} --b {b}",
                                      "parameters": {"a": [1, 2], "b": ["x", "y", "z"]}})
    assert spec["trials"] == 6
    assert params[:4] == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 1, "b": "z"},
                          {"a": 2, "b": "x"}]
    assert sweeps.fill(spec["template"], {**params[5], "trial": 5, "sweep_id": 1}) == \
        ["/bin/sh", "-c", "t --a 2 --b z"]


def test_random_draws_are_seeded_and_in_range():
    body = {"command": ["t", "--lr={lr}", "--wd={wd}", "--opt={opt}", "--n={n}", "--bs={bs}"],
            "trials": 40, "seed": 7,
            "parameters": {"lr": {"type": "log_uniform", "low": 1e-5, "high": 1e-1},
                           "wd": {"type": "uniform", "low": 0, "high": 0.5},
                           "opt": {"type": "choice", "values": ["sgd", "adam"]},
                           "n": {"type": "int_uniform", "low": 1, "high": 3},
                           "bs": [16, 32]}}
    _, a = sweeps.parse_spec(body)
    _, b = sweeps.parse_spec(body)
    _, c = sweeps.parse_spec({**body, "seed": 8})
    assert a == b and a != c and len(a) == 40
    assert all(1e-5 <= p["lr"] <= 1e-1 and 0 <= p["wd"] <= 0.5 and p["n"] in (1, 2, 3)
               for p in a)
    assert {p["opt"] for p in a} == {"sgd", "adam"} and [p["bs"] for p in a[:3]] == [16, 32, 16]
    # log-uniform: about as many draws below the geometric middle (1e-3) as above it
    assert 10 <= sum(p["lr"] < 1e-3 for p in a) <= 30
    argv = sweeps.fill(body["command"], {**a[0], "trial": 0, "sweep_id": 1})
    assert argv[1] == f"--lr={a[0]['lr']!r}"


@pytest.mark.parametrize("body, says", [
    ({"command": "t {lr} {bs}", "parameters": {"lr": [0.1]}},
     "the command uses {bs} but the sweep defines no such parameter"),
    ({"command": "t {lr}", "parameters": {"lr": [0.1], "bs": [1]}},
     "parameter(s) bs are defined but the command never uses them"),
    ({"command": "t {lr}", "parameters": {"lr": []}}, "has an empty grid"),
    ({"command": "t {lr}", "trials": 3,
      "parameters": {"lr": {"type": "uniform", "low": 1, "high": 0}}},
     "low (1) is above high (0); swap them"),
    ({"command": "t {lr}", "trials": 5000,
      "parameters": {"lr": {"type": "uniform", "low": 0, "high": 1}}},
     f"at most {sweeps.MAX_TRIALS} are allowed"),
    ({"command": "t {a} {b}", "parameters": {"a": list(range(50)), "b": list(range(50))}},
     "the sweep has 2500 trials"),
    ({"command": "t {lr}", "parameters": {"lr": {"type": "log_uniform", "low": 1, "high": 2}}},
     "random parameters need 'trials'"),
    ({"command": "t {lr}", "parameters": {"lr": [1]}, "early_stopping": {"rule": "hyper"}},
     "'rule' must be one of median, asha"),
    ({"command": "t {lr}", "parameters": {"lr": [1]},
      "early_stopping": {"rule": "asha", "eta": 1}}, "'eta' must be a whole number >= 2"),
])
def test_bad_specs_are_refused_with_the_fix(body, says):
    with pytest.raises(sweeps.SweepError) as e:
        sweeps.parse_spec(body)
    assert says in str(e.value)


# -- the rules ------------------------------------------------------------------------------

def curve(f, steps):
    return [(s, f(s)) for s in steps]


def test_a_pass_counts_the_trials_as_reading_each_would(tmp_path):
    from gpuplane.db import Database, sweeps as db_sweeps
    from gpuplane.lifecycle import Lifecycle
    db = Database(tmp_path / "gpuctl.db")
    lc = Lifecycle(db)
    spec = {"name": "t", "command": ["true"], "working_dir": "/w", "gpus": 1,
            "cpu_only": False, "priority": 0, "max_attempts": 1, "env": {},
            "project": "default", "experiment": ""}
    with lc.transaction() as t:
        sid = db_sweeps.create(t.conn, "s", "default", "", {}, [{"i": i} for i in range(7)])
    trials = db_sweeps.trials(db, sid)
    # 0 queued, 1 running, 2 succeeded, 3 failed, 4 failed and marked for a re-run,
    # 5 stopped early, 6 never launched
    ids = [lc.submit(dict(spec, name=f"j{i}"))["id"] for i in range(6)]
    with lc.transaction() as t:
        for trial, job_id in zip(trials, ids):
            db_sweeps.set_trial_job(t.conn, trial["id"], job_id)
        for n, state in ((1, "RUNNING"), (2, "SUCCEEDED"), (3, "FAILED"), (4, "FAILED"),
                         (5, "CANCELLED")):
            t.conn.execute("UPDATE jobs SET state = ? WHERE id = ?", (state, ids[n]))
        db_sweeps.set_trial_retry(t.conn, trials[4]["id"], True)
        db_sweeps.set_trial_stopped(t.conn, trials[5]["id"], {"rule": "asha"})
    assert db_sweeps.tally(db, sid) == {"trials": 7, "active": 2, "failed": 1,
                                        "succeeded": 2, "todo": 2}
    # the re-run first, then those never launched, up to the room
    assert [t["number"] for t in db_sweeps.next_trials(db, sid, 5)] == [4, 6]
    assert [t["number"] for t in db_sweeps.next_trials(db, sid, 1)] == [4]


def test_median_rule_compares_the_best_so_far_with_the_median_at_that_step():
    good = [curve(lambda s, k=k: 1 / s + k, range(1, 21)) for k in (0.0, 0.1, 0.2)]
    bad = curve(lambda s: 1 / s + 0.5, range(1, 11))
    d = pruning.median_rule(bad, good, "min", warmup_steps=5, min_trials=3, key="loss")
    assert d["rule"] == "median" and d["step"] == 10 and d["threshold"] == pytest.approx(0.2)
    assert "median rule at step 10" in d["message"]
    # warm-up, too few other trials, and a trial better than the median: kept
    assert pruning.median_rule(bad[:4], good, "min", warmup_steps=5) is None
    assert pruning.median_rule(bad, good[:2], "min", min_trials=3) is None
    assert pruning.median_rule(good[0][:10], good[1:] + [bad], "min", min_trials=3) is None
    # steps of other trials that logged at other steps: their last value before it
    sparse = [curve(lambda s, k=k: 1 / s + k, range(3, 21, 4)) for k in (0.0, 0.1, 0.2)]
    assert pruning.median_rule(bad, sparse, "min", min_trials=3)["threshold"] == \
        pytest.approx(1 / 7 + 0.1)


def test_asha_keeps_the_top_one_over_eta_at_each_rung():
    steps = range(1, 40)
    others = [curve(lambda s, k=k: k - s / 100, steps) for k in (1, 2, 3, 4, 5, 6)]
    # rung 0 is step 3 (min_steps); 7 trials there, eta 3: the top 2 go on
    passed, d = pruning.asha(curve(lambda s: 1.5 - s / 100, range(1, 6)), others, "min", 0,
                             min_steps=3, eta=3)
    assert passed == 1 and d is None
    # at step 9 (rung 1) it is still second of 7: on again; a rung is judged once
    assert pruning.asha(curve(lambda s: 1.5 - s / 100, range(1, 10)), others, "min", 1,
                        min_steps=3, eta=3) == (2, None)
    passed, d = pruning.asha(curve(lambda s: 2.5 - s / 100, range(1, 6)), others, "min", 0,
                             min_steps=3, eta=3)
    assert passed == 0 and d["rung"] == 0 and d["step"] == 3
    assert d["threshold"] == pytest.approx(2 - 0.03) and "not in the top 1/3 of 7" in d["message"]
    # fewer than eta trials at a rung: each goes on (Optuna would stop the second of two)
    assert pruning.asha(curve(lambda s: 9 - s / 100, range(1, 6)), others[:1], "min", 0,
                        min_steps=3, eta=3) == (1, None)
    # maximising, and the first trial at a rung always goes on
    assert pruning.asha(curve(lambda s: s, range(1, 30)), [], "max", 0, min_steps=3,
                        eta=3) == (3, None)
    assert pruning.is_best_trial(others[0], others[1:], "min")
    assert not pruning.is_best_trial(others[1], others, "min")


# -- live -----------------------------------------------------------------------------------

TRIAL = """\
import argparse, os, sys, time
from gpuctl import run
ap = argparse.ArgumentParser()
ap.add_argument("--x", type=float, default=0)
ap.add_argument("--fail", type=int, default=0)
ap.add_argument("--out", default="ckpt")
a = ap.parse_args()
if a.fail:
    print("bad flag", file=sys.stderr)
    raise SystemExit(3)
os.makedirs(a.out, exist_ok=True)
for step in range(1, 41):
    run.log({"loss": (a.x - 0.3) ** 2 + 1.0 / step}, step=step)
    if step % 10 == 0:
        path = os.path.join(a.out, f"step{step}.pt")
        open(path, "wb").write(b"w")
        run.log_checkpoint(path, step=step)
    time.sleep(0.04)
"""

ASHA_TOML = """\
name = "asha"
command = "{python} trial.py --x {{x}} --out ckpt/asha-{{trial}}"
experiment = "asha"
parallel = 2
metric = "loss"

[parameters]
x = [0.0, 0.3, 0.9, 1.2, 1.5, 1.8]

[early_stopping]
rule = "asha"
min_steps = 5
eta = 3
"""


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    base = tmp_path_factory.mktemp("sweeps")
    work = base / "work"
    work.mkdir()
    (work / "trial.py").write_text(TRIAL)
    (work / "asha.toml").write_text(ASHA_TOML.format(python=sys.executable))
    server = ServerProc(base / "server").start()
    agent = AgentProc(server, base / "agent", "node1", fake_gpus=4, cpu_slots=2).start()
    api = server.api
    grid = api.post("/api/v1/sweeps", {
        "name": "grid", "experiment": "grid", "working_dir": str(work), "parallel": 2,
        "command": f"{sys.executable} trial.py --x {{x}} --out ckpt/grid-{{trial}}",
        "parameters": {"x": [0.0, 0.1, 0.3, 0.6]}, "metric": "loss", "direction": "min"},
        expect=201)
    failing = api.post("/api/v1/sweeps", {
        "name": "broken", "working_dir": str(work), "cpu_only": True,
        "command": [sys.executable, "trial.py", "--fail", "{fail}"],
        "parameters": {"fail": [1, 2, 3, 4, 5]}}, expect=201)
    yield {"server": server, "api": api, "work": work, "grid": grid, "failing": failing}
    agent.stop()
    server.stop()
    kill_leftover_jobs(agent.home)


def ended(api, sweep_id, timeout=120):
    return wait_for(lambda: (s := api.get(f"/api/v1/sweeps/{sweep_id}"))["state"] != "RUNNING"
                    and s, timeout, what=f"sweep {sweep_id} to end")


def cli_run(box, monkeypatch, capsys, *argv, code=0):
    monkeypatch.setenv("GPUCTL_TOKEN", box["server"].token)
    monkeypatch.chdir(box["work"])
    got = cli.main(["--server", box["server"].url, *argv])
    out = capsys.readouterr()
    assert got == code, (argv, out.err)
    return out


def test_a_grid_sweep_keeps_its_parallel_limit_and_finds_the_best(box):
    api = box["api"]
    s = ended(api, box["grid"]["id"])
    assert s["state"] == "DONE", s
    trials = s["trials_detail"]
    assert [t["state"] for t in trials] == ["SUCCEEDED"] * 4
    assert s["best"]["params"] == {"x": 0.3} and s["best"]["trial"] == 2
    jobs = [api.job(t["job_id"]) for t in trials]
    assert all(j["max_attempts"] == 1 for j in jobs)
    assert jobs[2]["name"] == "grid #2 x=0.3"
    run = api.get(f"/api/v1/runs/{jobs[2]['run_id']}")
    assert run["config"]["x"] == 0.3 and run["config"]["sweep"] == {"id": s["id"], "trial": 2}
    # 4 GPUs free, parallel 2: never more than 2 trials between start and end at once
    spans = sorted((j["started_at"], j["ended_at"]) for j in jobs)
    for i, (start, _) in enumerate(spans):
        assert sum(1 for a, b in spans if a <= start < b) <= 2
    rec = api.get(f"/api/v1/checkpoints:recommend?sweep={s['id']}")
    assert rec["checkpoint"]["run_id"] == jobs[2]["run_id"]
    assert rec["checkpoint"]["path"].endswith("grid-2/step40.pt")
    # next actions that can work: never the same question again; with no evaluation
    # command on the trials, the evaluation says how to give one
    acts = rec["next_actions"]
    assert not [a for a in acts if a["tool"] == "get_best_checkpoint"]
    assert not [a for a in acts if a["tool"] == "evaluate_checkpoint"]
    assert "their jobs have no evaluation command" in rec["reason"]
    assert "--eval-command 'python eval.py'" in rec["reason"]


def test_asha_from_a_toml_file_stops_the_worst_and_never_the_best(box, monkeypatch, capsys):
    out = cli_run(box, monkeypatch, capsys, "sweep", "create", "asha.toml", "--seed", "3")
    sweep_id = int(out.out.split()[1])
    api = box["api"]
    s = ended(api, sweep_id)
    states = {t["params"]["x"]: t["state"] for t in s["trials_detail"]}
    assert states[0.3] == "SUCCEEDED" and s["best"]["params"] == {"x": 0.3}
    stopped = [t for t in s["trials_detail"] if t["state"] == "EARLY_STOPPED"]
    assert stopped and all(t["params"]["x"] >= 0.9 for t in stopped)
    t = stopped[0]
    job = api.job(t["job_id"])
    assert job["state"] == "CANCELLED" and job["stop_reason"]["reason"] == "EARLY_STOPPED"
    [ev] = [e for e in api.get(f"/api/v1/events?job={t['job_id']}&limit=50")["events"]
            if e["type"] == "CANCELLED"]
    assert ev["data"]["reason"] == "EARLY_STOPPED" and ev["data"]["rule"] == "asha"
    assert ev["data"]["rung"] == 0 and ev["data"]["threshold"] < ev["data"]["value"]
    assert "ASHA rung 0 (step 5)" in ev["message"]
    # what the stopped trial saved stays registered
    ck = api.get(f"/api/v1/runs/{job['run_id']}/checkpoints")["checkpoints"]
    assert all(c.get("deleted_at") is None for c in ck)
    shown = cli_run(box, monkeypatch, capsys, "sweep", "show", str(sweep_id)).out
    assert "best: trial 1" in shown and "EARLY_STOPPED" in shown and "ASHA rung" in shown
    # the experiment's runs: a stopped trial says so, and which sweep trial each run is
    table = cli_run(box, monkeypatch, capsys, "exp", "runs", "asha").out
    row = next(line for line in table.splitlines() if f"asha #{t['number']} " in line)
    assert "EARLY_STOPPED" in row and f"{sweep_id} #{t['number']}" in row
    assert "{'id'" not in table and "CANCELLED" not in table
    assert "asha" in cli_run(box, monkeypatch, capsys, "sweep", "list").out
    rec = cli_run(box, monkeypatch, capsys, "ckpt", "recommend", "--sweep", str(sweep_id)).out
    assert "asha-1/step40.pt" in rec
    # each suggested evaluation names its own checkpoint (it once printed one line thrice)
    evals = [line for line in rec.splitlines() if "gpuplane ckpt evaluate" in line]
    assert evals and len(set(evals)) == len(evals)
    assert all(re.search(r"gpuplane ckpt evaluate \d+", line) for line in evals)


def test_a_sweep_whose_trials_all_fail_stops_and_retries_keep_the_parameters(
        box, monkeypatch, capsys):
    api = box["api"]
    s = ended(api, box["failing"]["id"])
    assert s["state"] == "STOPPED"
    assert "the first 3 trials failed and none succeeded" in s["stop_reason"]
    assert "gpuplane sweep retry-failed" in s["stop_reason"]
    assert [t["state"] for t in s["trials_detail"]][3:] == ["PENDING", "PENDING"]
    first = s["trials_detail"][0]
    out = cli_run(box, monkeypatch, capsys, "sweep", "retry-failed", str(s["id"])).out
    assert "trials 0, 1, 2 will run again" in out
    again = ended(api, s["id"])
    job = api.job(first["job_id"])
    assert job["attempt"] == 2 and job["command"][-1] == "1"
    assert again["state"] == "STOPPED"
    # no more retries to give: the answer says so
    cli_run(box, monkeypatch, capsys, "sweep", "cancel", str(s["id"]))
    err = cli_run(box, monkeypatch, capsys, "sweep", "retry-failed", str(s["id"]), code=1).err
    assert "was cancelled" in err


def test_bad_sweeps_are_refused_over_rest_and_the_cli(box, monkeypatch, capsys):
    api = box["api"]
    body = {"command": "python t.py --lr {lr}", "working_dir": str(box["work"]),
            "parameters": {"lr": [0.1]}}
    r = api.post("/api/v1/sweeps", {**body, "command": "python t.py --lr {rate}"})
    assert api.last.status_code == 400 and "{rate}" in r["error"]["message"]
    r = api.post("/api/v1/sweeps", {**body, "early_stopping": {"rule": "median"}})
    assert api.last.status_code == 400 and "early stopping needs the metric" in \
        r["error"]["message"]
    r = api.post("/api/v1/sweeps", {**body, "working_dir": "rel"})
    assert api.last.status_code == 400 and "absolute path" in r["error"]["message"]
    assert api.get("/api/v1/sweeps/999", expect=404)["error"]["message"].startswith(
        "sweep 999 does not exist")
    err = cli_run(box, monkeypatch, capsys, "sweep", "create", "--command", "t {a}",
                  "--param", "a=uniform:3:1", "--trials", "2", code=1).err
    assert "low (3) is above high (1)" in err
    listed = json.loads(cli_run(box, monkeypatch, capsys, "sweep", "list", "--json").out)
    assert {s["name"] for s in listed} >= {"grid", "broken"}


def test_mcp_creates_watches_and_judges_a_sweep(box):
    from test_mcp import check_next_actions, err, mcp_env, session
    api, work = box["api"], box["work"]
    reader = api.post("/api/v1/tokens", {"name": "reader", "scope": "read"}, expect=201)["token"]
    args = {"name": "mcp", "experiment": "mcp", "working_dir": str(work), "parallel": 2,
            "command": f"{sys.executable} trial.py --x {{x}} --out ckpt/mcp-{{trial}}",
            "parameters": {"x": [0.2, 0.7]}, "metric": "loss"}

    async def as_writer(call, client):
        bad, text = await call("create_sweep", **{**args, "command": "t {nope}"})
        assert bad and "{nope}" in text
        bad, s = await call("create_sweep", **args)
        assert not bad, s
        assert [a["tool"] for a in s["next_actions"]] == ["wait_for_sweep"]
        bad, done = await call("wait_for_sweep", sweep_id=s["id"], timeout_s=120)
        assert not bad and done["reached"] and done["state"] == "DONE", done
        check_next_actions(done)
        tools = [a["tool"] for a in done["next_actions"]]
        assert tools == ["get_best_checkpoint", "compare_runs", "diagnose_run"]
        assert done["best"]["params"] == {"x": 0.2}
        bad, best = await call("get_best_checkpoint", sweep_id=s["id"])
        assert not bad and best["checkpoint"]["path"].endswith("mcp-0/step40.pt"), best
        bad, listed = await call("list_sweeps", state="DONE")
        assert not bad and s["id"] in [x["id"] for x in listed["sweeps"]]
    session(mcp_env(box["server"].url, box["server"].token, work), as_writer, in_process=True)

    async def as_reader(call, client):
        assert err(await call("create_sweep", **args)).startswith("WriteScopeError")
        bad, s = await call("get_sweep", sweep_id=box["grid"]["id"])
        assert not bad and s["trials_detail"]
    session(mcp_env(box["server"].url, reader, work), as_reader, in_process=True)
