"""gpuplane-mcp over stdio, driven by the mcp package's own client, against a real server and
agent (fake GPUs). Only MCP tool calls in the tests besides starting the platform."""
import asyncio
import json
import pathlib
import sys

import pytest

from procs import ROOT, free_port, wait_for

EXAMPLE = ROOT / "examples" / "cpu"

OBSERVE = {"get_status", "list_jobs", "get_job", "get_job_logs", "list_runs", "get_run",
           "get_metric_summary", "get_metric_series", "get_metric_table", "list_checkpoints",
           "list_events", "whoami"}
CONTROL = {"submit_job", "cancel_job", "retry_job", "evaluate_checkpoint", "set_primary_metric",
           "pin_checkpoint", "prune_checkpoints", "set_project_defaults"}
SEMANTIC = {"diagnose_run", "compare_runs", "compare_checkpoints", "get_best_checkpoint",
            "explain_failure"}
SWEEPS = {"list_sweeps", "get_sweep", "wait_for_sweep", "create_sweep", "cancel_sweep",
          "retry_failed_sweep"}       # tests/test_sweeps.py drives them


def mcp_env(server_url, token, home):
    return {"GPUCTL_SERVER": server_url, "GPUCTL_TOKEN": token, "GPUCTL_HOME": str(home),
            "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}


def stdio_target(argv, env, log, cwd=ROOT):
    """The stdio transport to `argv` for mcp.Client, its stderr into the file `log`. Not
    Client(StdioServerParameters): mcp's stdio_client binds sys.stderr as its default at
    import, and imported first under a test's capsys that is a capture without a file
    descriptor, which fails every later stdio client of that worker process."""
    from mcp import StdioServerParameters
    from mcp.client.stdio import stdio_client
    log = pathlib.Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    return stdio_client(StdioServerParameters(command=argv[0], args=argv[1:], env=env,
                                              cwd=cwd and str(cwd)), errlog=open(log, "a"))


def session(env, body, in_process=False):
    """Start gpuplane-mcp over stdio with `env`, run `await body(call, client)`.
    in_process: the same server object, connected in memory (no process to start)."""
    from mcp import Client

    if in_process:
        import mcp_server
        target = mcp_server.build_server(mcp_server.Gpuplane(env["GPUCTL_SERVER"],
                                                             env["GPUCTL_TOKEN"]))
    else:
        target = stdio_target([sys.executable, str(ROOT / "mcp_server.py")], env,
                              pathlib.Path(env["GPUCTL_HOME"]) / "mcp-stderr.log")

    async def main():
        async with Client(target) as client:
            async def call(tool, **args):
                r = await client.call_tool(tool, args)
                text = " ".join(getattr(c, "text", "") for c in r.content)
                return r.is_error, (text if r.is_error else r.structured_content)
            return await body(call, client)
    return asyncio.run(main())


class McpHttp:
    """`gpuplane-mcp --http PORT` as a process; .url is its /mcp endpoint."""

    def __init__(self, env, log):
        import subprocess
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "mcp_server.py"), "--http", str(self.port)],
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log, "wb"))

    def __enter__(self):
        import socket

        def listening():
            assert self.proc.poll() is None, self.log.read_text()
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        try:
            wait_for(listening, 60, what="gpuplane-mcp --http to listen")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(10)


def ok(res):
    is_error, data = res
    assert not is_error, data
    check_next_actions(data)
    return data


def check_next_actions(data):
    """Every suggested call names a tool of the table, and its arguments are what that tool
    takes, all filled: no placeholder for the agent to make up."""
    import mcp_server
    for a in (data or {}).get("next_actions", []):
        tool = mcp_server.TOOL_BY_NAME.get(a["tool"])
        assert tool is not None, f"next_actions names no tool: {a}"
        tool.input(**a["arguments"])
        assert not any(isinstance(v, str) and v.startswith("<")
                       for v in a["arguments"].values()), a


def test_next_actions_are_built_in_one_place_and_name_real_tools():
    import re
    import mcp_server
    names = set()
    for path in (ROOT / "gpuplane").rglob("*.py"):
        text = path.read_text()
        if path.name != "next_actions.py":
            assert not re.search(r"^def action\(|\"next_actions\": \[\{", text, re.M), path
        names |= set(re.findall(r"\baction\(\s*\"(\w+)\"", text))
    assert len(names) > 5 and names <= set(mcp_server.TOOL_BY_NAME), \
        names - set(mcp_server.TOOL_BY_NAME)


def err(res):
    """The error's own sentence (the mcp SDK prefixes "Error executing tool NAME: ")."""
    is_error, data = res
    assert is_error, f"expected a tool error, got {data}"
    return data.split(": ", 1)[1] if data.startswith("Error executing tool") else data


def test_tools_over_http_and_a_down_server_is_a_sentence(tmp_path):
    """`--http PORT` serves the tools at /mcp; with the server down it starts all the same
    and every tool says so. (The stdio transport is the acceptance test's.)"""
    from mcp import Client
    env = mcp_env(f"http://127.0.0.1:{free_port()}", "nobody", tmp_path)

    async def body(client):
        async def call(tool, **args):
            r = await client.call_tool(tool, args)
            return r.is_error, " ".join(getattr(c, "text", "") for c in r.content)

        tools = (await client.list_tools()).tools
        names = {t.name for t in tools}
        assert OBSERVE | CONTROL | SEMANTIC | SWEEPS | {"wait_for_job", "wait_for_jobs"} \
            == names
        for t in tools:
            assert t.description and len(t.description) > 40, t.name
            assert t.output_schema, t.name
        submit = next(t for t in tools if t.name == "submit_job")
        assert "working_dir" in submit.input_schema["required"]
        assert "absolute" in submit.input_schema["properties"]["working_dir"]["description"]
        msg = err(await call("get_status"))
        assert "not reachable" in msg and "gpuplane up" in msg
        assert "not reachable" in err(await call("diagnose_run", run_id=1))
        # Bad arguments are tool errors too, and the process lives on.
        assert "job_id" in err(await call("get_job", job_id="seven"))
        err(await call("compare_runs", run_ids=[1]))
        assert "not reachable" in err(await call("whoami"))

    async def main(url):
        import httpx2
        from mcp.client.streamable_http import streamable_http_client
        async with Client(url) as tokenless:      # issue 22: never lent the MCP's token
            r = await tokenless.call_tool("get_status", {})
            assert r.is_error and "needs a GPUPlane token of your own" in r.content[0].text
        async with httpx2.AsyncClient(headers={"Authorization": "Bearer nobody"}) as http, \
                Client(streamable_http_client(url, http_client=http)) as client:
            await body(client)
    with McpHttp(env, tmp_path / "mcp-http.log") as server:
        asyncio.run(main(server.url))
        assert server.proc.poll() is None


def test_system_series_params_scopes_and_errors_in_mcp_words(live_server, tmp_path):
    """Without an agent: a run's summary leaves its system series out unless asked (and
    they have no direction); list_runs keeps an evaluation's run out of the trainings and
    shows params without bookkeeping; set_primary_metric creates the experiment it names;
    a server sentence reaches the agent with tools in place of CLI commands."""
    from gpuplane.db import now_ms
    api = live_server.api
    run = api.post("/api/v1/runs", {"project": "p", "experiment": "e", "name": "r",
                                    "config": {"lr": 0.1, "out_dir": "/tmp/o"}}, expect=201)
    api.post(f"/api/v1/runs/{run['id']}/metrics", {
        "keys": ["train/loss", "sys/gpu0/util"],
        "points": [[k, i, 1.0 / (i + 1), now_ms()] for i in range(5) for k in (0, 1)]},
        expect=200)

    async def body(call, client):
        s = ok(await call("get_metric_summary", run_id=run["id"]))
        assert [k["key"] for k in s["keys"]] == ["train/loss"] and s["system_left_out"] == 1
        s = ok(await call("get_metric_summary", run_id=run["id"], include_system=True))
        system = next(k for k in s["keys"] if k["key"] == "sys/gpu0/util")
        assert system["role"] == "system" and system["direction"] is None, system
        runs = ok(await call("list_runs", project="p"))["runs"]
        assert runs[0]["params"] == {"lr": 0.1} and "config" not in runs[0], runs
        assert runs[0]["kind"] == "TRAIN" and runs[0]["best_evaluation"] is None
        assert ok(await call("list_runs", project="p", kind="evaluation"))["runs"] == []
        ok(await call("set_primary_metric", key="val/acc", direction="max", project="new",
                      experiment="sweep"))
        rec = ok(await call("get_best_checkpoint", project="new", experiment="sweep"))
        assert rec["checkpoint"] is None
        msg = err(await call("get_best_checkpoint", project="new", experiment="nope"))
        assert "list_runs" in msg and "gpuplane " not in msg, msg
        msg = err(await call("get_run", run_id=999))
        assert "list_runs" in msg and "gpuplane " not in msg, msg
        msg = err(await call("submit_job", command=["true"], working_dir="project"))
        assert "'working_dir' must be an absolute path" in msg and "from /" in msg, msg
        assert "CLI" not in msg and "-d" not in msg, msg
    session(mcp_env(live_server.url, live_server.token, tmp_path), body, in_process=True)


def test_bad_token_and_scopes(live_server, tmp_path):
    api = live_server.api
    read = api.post("/api/v1/tokens", {"name": "reader", "scope": "read"}, expect=201)["token"]
    write = api.post("/api/v1/tokens", {"name": "writer", "scope": "write"}, expect=201)["token"]
    job = api.submit(["true"], "/tmp", cpu_only=True)       # QUEUED: no agent here
    args = {"submit_job": {"command": ["true"], "working_dir": "/tmp", "cpu_only": True},
            "cancel_job": {"job_id": job["id"]},
            "retry_job": {"job_id": job["id"]},
            "evaluate_checkpoint": {"checkpoint_id": 1},
            "pin_checkpoint": {"checkpoint_id": 1},
            "prune_checkpoints": {"job_id": job["id"]},
            "set_primary_metric": {"key": "val/loss", "direction": "min"},
            "set_project_defaults": {"project": "p", "time_limit": "2h"}}

    async def as_reader(call, client):
        assert ok(await call("whoami"))["can_write"] is False
        for tool in sorted(CONTROL):
            msg = err(await call(tool, **args[tool]))
            assert msg.startswith("WriteScopeError"), (tool, msg)
            assert "restart gpuplane-mcp with a write token" in msg, msg
        assert ok(await call("get_job", job_id=job["id"]))["state"] == "QUEUED"
        # No agent: nothing happens to the job, and the wait says so at its timeout.
        w = ok(await call("wait_for_job", job_id=job["id"], timeout_s=1, until="change"))
        assert w["timed_out"] and not w["reached"] and w["state"] == "QUEUED"
        assert w["next_actions"][-1]["tool"] == "wait_for_job"
    # In process: the stdio transport is the other tests' business; this one is scopes.
    session(mcp_env(live_server.url, read, tmp_path), as_reader, in_process=True)

    async def as_writer(call, client):
        assert ok(await call("whoami"))["can_write"] is True
        for tool in ("submit_job", "cancel_job"):
            assert ok(await call(tool, **args[tool]))["next_actions"]
        # retry of the cancelled job goes through; evaluate / set_primary_metric reach
        # the server (a missing checkpoint or a route this server lacks), not a scope error.
        assert ok(await call("retry_job", **args["retry_job"]))["state"] == "QUEUED"
        for tool in ("evaluate_checkpoint", "set_primary_metric", "pin_checkpoint",
                     "prune_checkpoints"):
            is_error, data = await call(tool, **args[tool])
            assert not (is_error and "WriteScopeError" in data), (tool, data)
    session(mcp_env(live_server.url, write, tmp_path), as_writer, in_process=True)

    # Over HTTP a caller's own token (Authorization: Bearer) is the one its calls use.
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    async def over_http(url):
        # Issue 22: a caller that sends no token is not lent the MCP server's own (by
        # default the local admin token); it is told to bring its own.
        async with Client(url) as plain:
            for tool, a in (("whoami", {}), ("cancel_job", {"job_id": job["id"]})):
                r = await plain.call_tool(tool, a)
                assert r.is_error and "Authorization: Bearer TOKEN" in r.content[0].text
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {read}"}) as http, \
                Client(streamable_http_client(url, http_client=http)) as reader:
            who = (await reader.call_tool("whoami", {})).structured_content
            assert who["scope"] == "read"
            r = await reader.call_tool("cancel_job", {"job_id": job["id"]})
            assert r.is_error and "WriteScopeError" in r.content[0].text
            # the caller's own token decides: the fix is a better token, not a restart
            assert "in your Authorization header" in r.content[0].text, r.content[0].text
            assert "restart gpuplane-mcp" not in r.content[0].text
        headers = {"Authorization": f"Bearer {write}"}
        async with httpx2.AsyncClient(headers=headers) as http, \
                Client(streamable_http_client(url, http_client=http)) as mine:
            who = (await mine.call_tool("whoami", {})).structured_content
            assert who["name"] == "writer" and who["can_write"] is True
            r = await mine.call_tool("cancel_job", {"job_id": job["id"]})
            assert not r.is_error, r.content
    with McpHttp(mcp_env(live_server.url, read, tmp_path), tmp_path / "http.log") as server:
        asyncio.run(over_http(server.url))

    async def bad_token(call, client):
        assert err(await call("list_jobs")).startswith("Unauthorized")
        assert err(await call("submit_job", **args["submit_job"])).startswith("Unauthorized")
    session(mcp_env(live_server.url, "not-a-token", tmp_path), bad_token, in_process=True)


def test_acceptance_loop(live_server, agent, tmp_path):
    """submit two trainings with different settings -> wait -> diagnose -> compare ->
    evaluate checkpoints -> recommendation, by MCP tools alone. The better learning rate
    wins by construction, and the recommendation is the evaluated best."""
    import shutil
    api = live_server.api
    write = api.post("/api/v1/tokens", {"name": "agent", "scope": "write"}, expect=201)["token"]
    dirs = {}
    for lr in ("0.5", "0.005"):
        d = dirs[lr] = tmp_path / f"lr-{lr}"
        d.mkdir()
        for f in ("train.py", "eval.py"):
            shutil.copy(EXAMPLE / f, d / f)

    async def body(call, client):
        status = ok(await call("get_status"))
        assert "GPUs free" in status["summary"]
        jobs = {}
        for lr, d in dirs.items():
            j = ok(await call("submit_job", command=[
                sys.executable, "train.py", "--epochs", "4", "--steps-per-epoch", "30",
                "--step-delay", "0", "--lr", lr], working_dir=str(d), name=f"lr-{lr}",
                cpu_only=True, project="acc", experiment="lr",
                eval_command=[sys.executable, "eval.py"]))
            assert j["next_actions"][0]["tool"] == "wait_for_job"
            jobs[lr] = j["id"]
        # One wait for the whole sweep.
        w = ok(await call("wait_for_jobs", job_ids=list(jobs.values()), timeout_s=120))
        assert w["reached"] and [j["state"] for j in w["jobs"]] == ["SUCCEEDED"] * 2, w
        assert w["pending"] == [] and w["first_ended"] in jobs.values()
        runs = {lr: j["run_id"] for lr, j in zip(jobs, w["jobs"])}
        assert w["next_actions"][0] == {"tool": "compare_runs", "why": w["next_actions"][0]["why"],
                                        "arguments": {"run_ids": list(runs.values())}}
        good, bad = runs["0.5"], runs["0.005"]

        d = ok(await call("diagnose_run", run_id=good))
        assert d["verdict"] == "healthy", d
        assert d["next_actions"]

        s = ok(await call("get_metric_summary", run_id=good))
        assert {"train/loss", "val/loss", "val/acc"} <= {k["key"] for k in s["keys"]}
        series = ok(await call("get_metric_series", run_id=good, key="train/loss",
                               max_points=20))
        assert 0 < len(series["points"]) <= 20
        assert len(series["ts"]) == len(series["points"]) and series["ts"][0] > 1.7e12

        c = ok(await call("compare_runs", run_ids=[good, bad], key="val/loss"))
        assert c["winner"] == good, c
        assert set(c["config_diff"]) >= {"lr"}

        # By construction: a checkpoint per epoch, at the step where val/loss was logged,
        # so the best by training value sits at the step of the lowest val/loss.
        val = ok(await call("get_metric_series", run_id=good, key="val/loss"))["points"]
        assert len(val) == 4
        lowest = min(val, key=lambda p: p[1])
        best = ok(await call("get_best_checkpoint", run_id=good, key="val/loss"))
        assert best["checkpoint"]["run_id"] == good and best["source"] == "training"
        assert best["checkpoint"]["step"] == lowest[0], (best, val)
        assert best["runner_up"] and best["margin"] > 0 and best["reason"]

        # Evaluate the last two checkpoints of each run on held-out data (eval.py): one
        # wave of four EVALUATE jobs on the agent's four CPU slots.
        cks = {}
        for run_id in (good, bad):
            cks[run_id] = ok(await call("list_checkpoints", run_id=run_id))["checkpoints"]
            assert len(cks[run_id]) == 4, cks[run_id]
        eval_jobs = []
        for ck in cks[good][-2:] + cks[bad][-2:]:
            e = ok(await call("evaluate_checkpoint", checkpoint_id=ck["id"]))
            assert e["next_actions"][0]["tool"] == "wait_for_job"
            eval_jobs.append(e["next_actions"][0]["arguments"]["job_id"])
        w = ok(await call("wait_for_jobs", job_ids=eval_jobs, timeout_s=120))
        assert {j["state"] for j in w["jobs"]} == {"SUCCEEDED"}, w
        assert {j["kind"] for j in w["jobs"]} == {"EVALUATE"}
        assert {"tool": "get_best_checkpoint", "arguments": {"project": "acc", "experiment": "lr"}} \
            in [{k: a[k] for k in ("tool", "arguments")} for a in w["next_actions"]], w

        # No primary metric yet: the ranking names a metric the evaluations produced
        # (eval/...), not one only the trainings logged (val/...).
        guess = ok(await call("compare_checkpoints", run_ids=[good, bad]))
        assert guess["key"].startswith("eval/"), guess["key"]
        cc = ok(await call("compare_checkpoints", run_ids=[good, bad], key="eval/loss"))
        ranked = cc["ranked"]
        # eval/loss exists only where an evaluation made it: the rest stay unranked.
        assert [r["source"] for r in ranked] == ["evaluation"] * 4, ranked
        assert len(cc["unranked"]) == 4
        evaluated_best = min(ranked, key=lambda r: r["value"])
        assert evaluated_best["run_id"] == good

        # The primary metric, set once for the experiment, decides the recommendation.
        ok(await call("set_primary_metric", key="eval/loss", direction="min",
                      project="acc", experiment="lr"))
        rec = ok(await call("get_best_checkpoint", project="acc", experiment="lr"))
        assert rec["source"] == "evaluation", rec
        assert rec["checkpoint"]["checkpoint_id"] == evaluated_best["checkpoint_id"], rec
        assert rec["runner_up"] and rec["margin"] >= 0

        ev = ok(await call("list_events", run_id=good))
        assert isinstance(ev["events"], list)

        logs = ok(await call("get_job_logs", job_id=jobs["0.5"], tail=5))
        assert logs["lines"][-1]["text"].startswith(("training finished", "sdk summary"))

        # A failing job: explain_failure finds the missing module in its log.
        j = ok(await call("submit_job", command=[sys.executable, "-c", "import nosuchmod"],
                          working_dir=str(tmp_path), cpu_only=True, name="broken"))
        w = ok(await call("wait_for_job", job_id=j["id"], timeout_s=60, until="change"))
        assert w["reached"] and not w["timed_out"], w       # started, or already failed
        w = ok(await call("wait_for_job", job_id=j["id"], timeout_s=60))
        assert w["state"] == "FAILED"
        ev = ok(await call("list_events", job_id=j["id"], type="FAILED,CANCELLED"))
        assert [e["type"] for e in ev["events"]] == ["FAILED"], ev
        assert ev["events"][0]["job_id"] == j["id"]
        assert w["next_actions"][0] == {"tool": "explain_failure",
                                        "arguments": {"job_id": j["id"]},
                                        "why": w["next_actions"][0]["why"]}
        e = ok(await call("explain_failure", job_id=j["id"]))
        assert e["kind"] == "MISSING_MODULE", e
        assert any("nosuchmod" in ln["text"] for ln in e["lines"])
    session(mcp_env(live_server.url, write, tmp_path), body)


INSPECTOR_VERSION = "2.12.0"


def inspector():
    """mcp-inspector from a per-user cache, installed there by npm on first use."""
    import os
    import shutil
    import subprocess
    if not shutil.which("node") or not shutil.which("npm"):
        pytest.skip("node/npm are not installed: the MCP Inspector test needs them")
    cache = pathlib.Path(os.environ.get("GPUPLANE_TEST_CACHE",
                                        pathlib.Path.home() / ".cache" / "gpuplane"))
    home = cache / f"inspector-{INSPECTOR_VERSION}"
    exe = home / "node_modules" / ".bin" / "mcp-inspector"
    if not exe.exists():
        home.mkdir(parents=True, exist_ok=True)
        try:
            r = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error",
                                f"@modelcontextprotocol/inspector@{INSPECTOR_VERSION}"],
                               cwd=home, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.skip("npm install of the MCP Inspector took over 300 s")
        if r.returncode or not exe.exists():
            pytest.skip(f"npm could not install the MCP Inspector: {r.stderr.strip()[-300:]}")
    return exe


def test_mcp_inspector_cli(live_server, tmp_path):
    import subprocess
    exe = inspector()
    api = live_server.api
    run = api.post("/api/v1/runs", {"project": "p", "name": "r"}, expect=201)
    from gpuplane.db import now_ms
    api.post(f"/api/v1/runs/{run['id']}/metrics",
             {"keys": ["train/loss"], "points": [[0, i, 2.0 - 0.03 * i, now_ms()]
                                                 for i in range(40)]}, expect=200)
    calls = {"list": ["--method", "tools/list"],
             "observe": ["--method", "tools/call", "--tool-name", "get_status"],
             "semantic": ["--method", "tools/call", "--tool-name", "diagnose_run",
                          "--tool-arg", f"run_id={run['id']}"]}
    out = {}
    env = mcp_env(live_server.url, live_server.token, tmp_path)
    # Over streamable HTTP: one gpuplane-mcp for the three calls (spawning it per call
    # over stdio costs a Python start each).
    with McpHttp(env, tmp_path / "mcp-http.log") as server:
        for k, args in calls.items():
            r = subprocess.run([str(exe), "--cli", server.url, "--transport", "http",
                                "--header", f"Authorization: Bearer {live_server.token}", *args],
                               capture_output=True, text=True, timeout=120, cwd=ROOT)
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
            out[k] = json.loads(r.stdout)
    tools = out["list"]["tools"]
    import mcp_server
    assert len(tools) == len(mcp_server.TOOLS) and all(t.get("outputSchema") for t in tools)
    status = out["observe"]
    assert status["isError"] is False and "GPUs free" in status["structuredContent"]["summary"]
    d = out["semantic"]
    assert d["isError"] is False
    assert d["structuredContent"]["verdict"] == "healthy", d

