"""Issue 22: what a job can reach (docs/security.md). A running attempt's start record
keeps no secret; with --run-as the agent runs jobs as another Unix user, who cannot read
the agent's home at all."""
import json
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid

import pytest

from procs import wait_for


def _spec(agent, job):
    return json.loads((agent.home / "agent" / "jobs" / str(job["id"]) / "1" /
                       "spec.json").read_text())


def test_a_running_attempts_start_record_keeps_no_token_and_no_env_value(live_server, agent,
                                                                          tmp_path):
    api = live_server.api
    gate = tmp_path / "gate"
    job = api.submit(["/bin/sh", "-c", f"echo $SECRET_KEY; while [ ! -e {gate} ]; do "
                      "sleep 0.05; done"], tmp_path, cpu_only=True,
                     env={"SECRET_KEY": "s3cr3t-value"})
    try:
        api.wait_job(job["id"], states=("RUNNING",))
        wait_for(lambda: "ingest_token" not in _spec(agent, job)["start"], 30,
                 what="the start record rewritten without its token")
        spec = _spec(agent, job)
        text = json.dumps(spec)
        assert "s3cr3t-value" not in text and spec["start"]["env"] == {
            "SECRET_KEY": "<redacted>"}
        assert "env" not in spec["exec"] and "GPUCTL_TOKEN" not in text
        lines = wait_for(lambda: [x["text"] for x in api.get(
            f"/api/v1/jobs/{job['id']}/logs")["lines"]], 30, what="the job's line")
        assert lines[0] == "s3cr3t-value"            # the job itself has it
    finally:
        gate.touch()
    assert api.wait_job(job["id"])["state"] == "SUCCEEDED"


@pytest.fixture
def job_user():
    if os.geteuid() != 0:
        pytest.skip("--run-as needs root (to create a user and to switch to it); "
                    "this test runs as uid %d" % os.geteuid())
    if not shutil.which("useradd") or not shutil.which("setpriv"):
        pytest.skip("useradd or setpriv (util-linux) is not installed")
    name = "gpj" + uuid.uuid4().hex[:8]
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True,
                   capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def test_run_as_runs_jobs_as_another_user_who_cannot_read_the_agents_home(
        live_server, agent_factory, job_user):
    a = agent_factory(live_server, name="isolated", extra=("--run-as", job_user.pw_name))
    wd = tempfile.mkdtemp(prefix="gpj-wd-")
    os.chown(wd, job_user.pw_uid, job_user.pw_gid)
    try:
        job = live_server.api.submit(["/bin/sh", "-c", f"id -u; echo $HOME; "
                                      f"cat {a.home}/agent.toml || echo DENIED; "
                                      "echo mine > own.txt && echo WROTE"], wd, cpu_only=True)
        j = live_server.api.wait_job(job["id"], timeout=90)
        lines = [x["text"] for x in live_server.api.get(
            f"/api/v1/jobs/{job['id']}/logs")["lines"]]
        assert j["state"] == "SUCCEEDED", lines
        assert lines[0] == str(job_user.pw_uid), lines
        assert "DENIED" in lines and "WROTE" in lines, lines
        assert not any("token" in x for x in lines), lines
        assert os.stat(os.path.join(wd, "own.txt")).st_uid == job_user.pw_uid
    finally:
        shutil.rmtree(wd, ignore_errors=True)


def test_run_as_refuses_an_unknown_user_or_root(tmp_path):
    import agent as agent_mod
    with pytest.raises(agent_mod.ConfigError, match="no such user"):
        agent_mod.run_as_user("no-such-user-" + uuid.uuid4().hex[:6])
    with pytest.raises(agent_mod.ConfigError, match="root"):
        agent_mod.run_as_user("root")
