"""What a newcomer meets first with the SDK (issue 9 items 5, 6, 12): a server or token
that does not work is said once; on the server's host the SDK finds it; a local run's
finish (or crash) ends the run when it is replayed; run.init inside a job shapes the
job's run."""
import json
import subprocess
import sys
import textwrap

import requests

from sdkutil import TOKEN, sdk_env, wait_for


def test_a_refused_token_is_said_once_and_counted(sdk, server, capsys):
    server.mode = "401"
    assert sdk.init(server=server.url, token="nope") is None
    sdk.log({"loss": 1.0})
    s = sdk.summary()
    assert s["mode"] == "local" and s["errors"] >= 1
    err = capsys.readouterr().err
    assert err.count("gpuctl: logging locally for now: the token was refused from "
                     + server.url) == 1


def test_a_server_without_a_token_is_said(sdk, server, capsys):
    assert sdk.init(server=server.url) is None
    assert "was given but no token (set GPUCTL_TOKEN)" in capsys.readouterr().err
    assert sdk.summary()["errors"] >= 1


def test_on_the_servers_host_the_sdk_finds_it(sdk, server, tmp_path, capsys):
    port = server.url.rsplit(":", 1)[1]
    home = tmp_path / "home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "server.toml").write_text(f'admin_token = "{TOKEN}"\nport = {port}\n')
    run_id = sdk.init(project="found")
    assert run_id is not None and sdk.summary()["mode"] == "registered"
    assert capsys.readouterr().err == ""


LOCAL = textwrap.dedent("""
    import os, sys
    from gpuctl import run
    run.init(project="offline", config={"lr": 0.5})
    for i in range(10):
        run.log({"loss": 1.0 / (i + 1)}, step=i)
    if sys.argv[1] == "finish":
        run.finish()
    elif sys.argv[1] == "kill":
        run.flush(5)
        os._exit(9)          # no atexit: a crash
""")


def test_local_runs_end_when_replayed(sdk, server_factory, tmp_path):
    srv = server_factory()
    home = tmp_path / "home"
    script = tmp_path / "local.py"
    script.write_text(LOCAL)
    for how in ("finish", "exit", "kill"):
        out = subprocess.run([sys.executable, str(script), how], env=sdk_env(home),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == (9 if how == "kill" else 0), out.stderr
        assert out.stderr == ""          # nothing was given: local is expected, no warning
    sdk.init(project="replayer", server=srv.url, token=srv.token)
    h = {"Authorization": "Bearer " + srv.token}

    def offline_runs():
        runs = requests.get(f"{srv.url}/api/v1/runs?project=offline", headers=h,
                            timeout=10).json()["runs"]
        return len(runs) == 3 and all(r["state"] != "RUNNING" for r in runs) and runs
    runs = wait_for(offline_runs, 30, what="the three local runs replayed and ended")
    assert sorted(r["state"] for r in runs) == ["FAILED", "FAILED", "SUCCEEDED"]
    assert all(r["config"] == {"lr": 0.5} for r in runs)


ATTACHED = textwrap.dedent("""
    from gpuctl import run
    run.init(project="mnist", experiment="lr-sweep", name="from-sdk",
             config={"lr": 0.001, "batch": 64})
    run.log({"loss": 0.5}, step=1)
    run.finish()
""")


def test_init_inside_a_job_shapes_the_jobs_run(live_server, agent, tmp_path):
    api = live_server.api
    (tmp_path / "train.py").write_text(ATTACHED)
    # The job names its experiment; the SDK's experiment must not win, its project must.
    job = api.submit([sys.executable, "train.py"], tmp_path, cpu_only=True,
                     experiment="from-job")
    job = api.wait_job(job["id"])
    assert job["state"] == "SUCCEEDED", job
    run = wait_for(lambda: (r := api.get(f"/api/v1/runs/{job['run_id']}"))["config"].get("lr")
                   and r, 30, what="the SDK's init to reach the run")
    assert run["project"] == "mnist" and run["experiment"] == "from-job"
    assert run["config"]["lr"] == 0.001 and run["config"]["batch"] == 64
    assert run["config"]["command"] == [sys.executable, "train.py"]   # the job's own
    print(json.dumps(run))
