"""Stops that land right (issue 35): an early stop or a stop on an event ends a job as
what it is — EARLY_STOPPED / STOPPED_ON_EVENT, not a cancel — and only a job still
running when the stop reaches it; one that ended first keeps its own end. A job (and a
sweep's trials, by default) can stop at once on LOSS_NAN / LOSS_DIVERGED, and
`job wait --until-event` / wait_for_jobs(until="event") return on the first critical
event. Real server, real agent, real child processes."""
import json
import sys

import pytest

import agent as agent_py
from gpuplane import cli, states
from gpuplane.client import Client, wait_for_jobs
from gpuplane.db import jobs
from procs import wait_for

from test_lifecycle import World, running_job, spec  # noqa: F401  (the unit world)


# -- the agent: who ended the program --------------------------------------------------

def test_an_exit_0_before_the_stop_reached_the_program_is_its_own_end(tmp_path):
    log = tmp_path / "log"
    log.write_text("done\n")
    cancel = {"requested_at": 100, "term_at": 105}
    # exited 0 after the cancel arrived but before SIGTERM went to a live program
    assert agent_py.classify_exit({"exit_code": 0, "signal": None, "ended_at": 103}, str(log),
                               cancel) == (None, None)
    # the program was gone when the agent looked: no SIGTERM went anywhere
    assert agent_py.classify_exit({"exit_code": 0, "signal": None, "ended_at": 103}, str(log),
                               {"requested_at": 100}) == (None, None)
    # it obeyed the stop: a handler that exits 0 after SIGTERM, or death by the signal
    assert agent_py.classify_exit({"exit_code": 0, "signal": None, "ended_at": 110}, str(log),
                               cancel)[0] == "CANCELLED"
    assert agent_py.classify_exit({"exit_code": None, "signal": 15, "ended_at": 110}, str(log),
                               cancel)[0] == "CANCELLED"
    # an exit before the cancel was asked for is untouched
    assert agent_py.classify_exit({"exit_code": 0, "signal": None, "ended_at": 90}, str(log),
                               cancel) == (None, None)


# -- the lifecycle: a stop that came late ------------------------------------------------

def test_a_stop_that_came_late_leaves_the_job_its_own_end(tmp_path):
    w = World(tmp_path)
    job = running_job(w)
    stop = {"reason": states.EARLY_STOPPED, "rule": "asha", "rung": 0, "step": 20,
            "message": "ASHA rung 0 (step 20): loss 2 is not in the top 1/3"}
    w.lc.cancel(job["id"], stop_reason=stop)
    state, evs = w.new_events(w.lc.finished, job["id"], 1, exit_code=0)
    assert state == "SUCCEEDED"
    got = jobs.get(w.db, job["id"])
    assert got["stop_reason"] is None and got["end"] == "succeeded"
    [ev] = evs
    assert ev["data"]["stop_came_late"]["rule"] == "asha"
    assert "ended before its stop reached it" in ev["message"]


def test_a_stop_that_landed_is_named_by_its_reason(tmp_path):
    w = World(tmp_path)
    job = running_job(w)
    stop = {"reason": states.EARLY_STOPPED, "rule": "asha", "rung": 0, "step": 20,
            "message": "ASHA rung 0 (step 20): ..."}
    w.lc.cancel(job["id"], stop_reason=stop)
    assert w.lc.finished(job["id"], 1, exit_code=None, failure_kind="CANCELLED") == "CANCELLED"
    got = jobs.get(w.db, job["id"])
    assert got["failure_kind"] == "EARLY_STOPPED"
    assert got["end"] == "early-stopped (ASHA rung 0, step 20)"
    # a queued job stopped on an event says so too; a cancel by hand stays a cancel
    queued = w.lc.submit(spec())
    w.lc.cancel(queued["id"], stop_reason={"reason": states.STOPPED_ON_EVENT,
                                           "event": "LOSS_NAN", "step": 3, "message": "x"})
    got = jobs.get(w.db, queued["id"])
    assert got["failure_kind"] == "STOPPED_ON_EVENT"
    assert got["end"] == "stopped on LOSS_NAN (step 3)"
    plain = w.lc.submit(spec())
    w.lc.cancel(plain["id"])
    assert jobs.get(w.db, plain["id"])["end"] == "cancelled"


# -- real processes ---------------------------------------------------------------------

DIVERGE = """\
import os, sys, time
from gpuctl import run
steps = int(sys.argv[1])
for step in range(1, steps + 1):
    loss = 1.0 / step if step < 40 else 10.0 * step   # learns, then blows up at step 40
    run.log({"loss": loss}, step=step)
    time.sleep(0.02)
open("finished-%s" % os.environ["GPUCTL_JOB_ID"], "w").write("all steps\\n")
"""

GRACEFUL = """\
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))   # a trainer that exits 0 on SIGTERM
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def work(tmp_path):
    d = tmp_path / "work"
    d.mkdir()
    (d / "diverge.py").write_text(DIVERGE)
    (d / "graceful.py").write_text(GRACEFUL)
    return d


def cli_main(server, monkeypatch, capsys, *argv):
    monkeypatch.setenv("GPUCTL_TOKEN", server.token)
    code = cli.main(["--server", server.url, *argv])
    return code, capsys.readouterr()


def test_a_job_stops_on_the_event_it_names_and_says_so(live_server, agent, work, monkeypatch,
                                                       capsys):
    api = live_server.api
    job = api.post("/api/v1/jobs", {"command": [sys.executable, "diverge.py", "3000"],
                                    "working_dir": str(work), "cpu_only": True,
                                    "stop_on": ["LOSS_DIVERGED", "LOSS_NAN"]}, expect=201)
    assert job["stop_on"] == ["LOSS_DIVERGED", "LOSS_NAN"]
    done = wait_for(lambda: (j := api.job(job["id"]))["state"] in states.JOB_FINAL and j,
                    60, what="the diverging job to be stopped")
    assert done["state"] == "CANCELLED" and done["failure_kind"] == "STOPPED_ON_EVENT"
    stop = done["stop_reason"]
    [ev] = [e for e in api.get(f"/api/v1/events?job={job['id']}&limit=100")["events"]
            if e["type"] == "LOSS_DIVERGED"]
    assert stop["event"] == "LOSS_DIVERGED" and stop["event_id"] == ev["id"]
    assert done["end"] == f"stopped on LOSS_DIVERGED (step {ev['step']})"
    # it was stopped, not left to finish its 3000 steps
    assert not (work / f"finished-{job['id']}").exists()
    code, out = cli_main(live_server, monkeypatch, capsys, "job", "show", str(job["id"]))
    assert f"stopped on LOSS_DIVERGED (step {ev['step']})" in out.out
    assert "failure" not in out.out.split("stopped", 1)[0].splitlines()[-1]
    code, out = cli_main(live_server, monkeypatch, capsys, "job", "list")
    assert "STOPPED_ON_EVENT" in out.out


def test_wait_until_event_returns_on_the_first_critical_event(live_server, agent, work,
                                                              monkeypatch, capsys):
    api = live_server.api
    job = api.post("/api/v1/jobs", {"command": [sys.executable, "diverge.py", "400"],
                                    "working_dir": str(work), "cpu_only": True},
                   expect=201)
    client = Client(live_server.url, live_server.token)
    waited = wait_for_jobs(client, [job["id"]], timeout_s=60, poll_s=0.2, until_event=True)
    jobs_, timed_out = waited
    assert not timed_out and waited.event["type"] == "LOSS_DIVERGED"
    assert waited.event["job_id"] == job["id"]
    # without stop_on the job goes on: the wait returned before its end
    assert jobs_[0]["state"] not in states.JOB_FINAL
    code, out = cli_main(live_server, monkeypatch, capsys, "job", "wait", str(job["id"]),
                         "--until-event", "--timeout", "60")
    assert code == 6 and "LOSS_DIVERGED" in out.out and f"job cancel {job['id']}" in out.err
    api.post(f"/api/v1/jobs/{job['id']}/cancel")


def test_a_trainer_that_exits_0_on_sigterm_was_stopped(live_server, agent, work):
    api = live_server.api
    job = api.post("/api/v1/jobs", {"command": [sys.executable, "graceful.py"],
                                    "working_dir": str(work), "cpu_only": True},
                   expect=201)
    wait_for(lambda: "ready" in json.dumps(api.get(f"/api/v1/jobs/{job['id']}/logs")),
             30, what="the job to start")
    api.post(f"/api/v1/jobs/{job['id']}/cancel")
    done = wait_for(lambda: (j := api.job(job["id"]))["state"] in states.JOB_FINAL and j,
                    30, what="the cancel to land")
    assert done["state"] == "CANCELLED" and done["exit_code"] == 0


@pytest.mark.parametrize("body, says", [
    ({"stop_on": ["LOSS_EXPLODED"]}, "unknown event type(s) LOSS_EXPLODED"),
    ({"stop_on": "LOSS_NAN"}, None),
    ({"stop_on": [3]}, "'stop_on' must be a list of event types"),
])
def test_stop_on_is_checked(live_server, work, body, says):
    api = live_server.api
    base = {"command": ["true"], "working_dir": str(work), "cpu_only": True}
    if says is None:
        assert api.post("/api/v1/jobs", {**base, **body}, expect=201)["stop_on"] == ["LOSS_NAN"]
        return
    before = len(api.get("/api/v1/jobs")["jobs"])
    err = api.post("/api/v1/jobs", {**base, **body}, expect=400)
    assert says in json.dumps(err) and "LOSS_DIVERGED" in json.dumps(err)
    assert len(api.get("/api/v1/jobs")["jobs"]) == before


def test_a_sweeps_trials_stop_on_nan_and_divergence_unless_it_says_otherwise(live_server,
                                                                             work):
    api = live_server.api
    body = {"working_dir": str(work), "cpu_only": True, "command": "true {x}",
            "parameters": {"x": [1]}}
    s = api.post("/api/v1/sweeps", body, expect=201)
    assert s["job"]["stop_on"] == ["LOSS_NAN", "LOSS_DIVERGED"]
    s = api.post("/api/v1/sweeps", {**body, "stop_on": []}, expect=201)
    assert s["job"]["stop_on"] == []
    err = api.post("/api/v1/sweeps", {**body, "stop_on": ["NOPE"]}, expect=400)
    assert "unknown event type(s) NOPE" in json.dumps(err)


def test_over_mcp_an_agent_waits_until_the_event_and_can_act_on_it(live_server, agent, work,
                                                                   tmp_path):
    from test_mcp import mcp_env, ok, session

    async def body(call, client):
        job = ok(await call("submit_job", command=[sys.executable, "diverge.py", "400"],
                            working_dir=str(work), cpu_only=True))
        got = ok(await call("wait_for_jobs", job_ids=[job["id"]], until="event",
                            timeout_s=60))
        assert got["event"]["type"] == "LOSS_DIVERGED" and got["reached"]
        tools = [a["tool"] for a in got["next_actions"]]
        assert tools[:2] == ["cancel_job", "diagnose_run"], tools
        again = next(a for a in got["next_actions"] if a["tool"] == "wait_for_jobs")
        assert "until" not in again["arguments"]      # the same event would return at once
        ok(await call("cancel_job", job_id=job["id"]))
        stopped = ok(await call("submit_job", command=[sys.executable, "diverge.py", "3000"],
                                working_dir=str(work), cpu_only=True,
                                stop_on=["LOSS_DIVERGED"]))
        got = ok(await call("wait_for_jobs", job_ids=[stopped["id"]], timeout_s=60))
        row = got["jobs"][0]
        assert row["failure_kind"] == "STOPPED_ON_EVENT", row
        assert row["end"].startswith("stopped on LOSS_DIVERGED (step ")
        job = ok(await call("get_job", job_id=stopped["id"]))
        assert job["end"] == row["end"]
    session(mcp_env(live_server.url, live_server.token, tmp_path), body, in_process=True)
