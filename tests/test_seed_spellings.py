"""The seed README's own spellings work: `gpuctl-server`, `gpuctl-agent`, `gpuctl job ...`,
`gpuctl-mcp serve --port N` (streamable HTTP) and `gpuctl-mcp stdio`, with the MCP server
configured by GPUCTL_SERVER_URL and GPUCTL_MCP_TOKEN. Each console script is run as
installed, as real processes: a server, an agent, a job, both MCP transports."""
import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import tomllib

import pytest
import requests

from procs import free_port, wait_for

BIN = pathlib.Path(sys.executable).parent
SCRIPTS = ("gpuctl", "gpuctl-server", "gpuctl-agent", "gpuctl-mcp")


def script(name):
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{path} is missing: `make install` (pip install -e '.[test]') installs "
                    "the console scripts of pyproject.toml")
    return str(path)


def clean_env(home, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
    env.update(GPUCTL_HOME=str(home), **extra)
    return env


def test_every_seed_name_is_a_console_script():
    scripts = tomllib.loads((pathlib.Path(__file__).parent.parent / "pyproject.toml")
                            .read_text())["project"]["scripts"]
    assert set(SCRIPTS) <= set(scripts)
    assert scripts["gpuctl-agent"] == scripts["gpuplane-agent"]
    assert scripts["gpuctl-mcp"] == scripts["gpuplane-mcp"]
    for name in SCRIPTS:
        script(name)


def test_mcp_modes_refuse_what_contradicts():
    for argv, says in ((["serve"], "--port"), (["--http", "1", "stdio"], "exclude"),
                       (["--http", "2", "serve", "--port", "3"], "once")):
        r = subprocess.run([script("gpuctl-mcp"), *argv], capture_output=True, text=True,
                           timeout=60, stdin=subprocess.DEVNULL)
        assert r.returncode == 2 and says in r.stderr, (argv, r.stderr)


@pytest.fixture
def procs():
    made = []
    yield made
    for p in made:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


def start(procs, argv, env, log, cwd=None):
    p = subprocess.Popen(argv, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd)
    procs.append(p)
    return p


def test_server_agent_job_and_mcp_by_the_seed_names(tmp_path, procs):
    home, port = tmp_path / "server", free_port()
    url = f"http://127.0.0.1:{port}"
    server = start(procs, [script("gpuctl-server"), "--home", str(home), "--port", str(port)],
                   clean_env(home), tmp_path / "server.log")

    def up():
        assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        return requests.get(url + "/api/v1/health", timeout=2).ok
    wait_for(up, 60, what="gpuctl-server to answer")
    token = tomllib.loads((home / "server.toml").read_text())["admin_token"]

    agent_home = tmp_path / "agent"
    agent_home.mkdir()
    fd = os.open(agent_home / "agent.toml", os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f'server = "{url}"\ntoken = "{token}"\n')
    start(procs, [script("gpuctl-agent"), "--home", str(agent_home), "--name", "seed",
                  "--fake-gpus", "1", "--heartbeat", "1"], clean_env(agent_home),
          tmp_path / "agent.log")

    cli = clean_env(tmp_path / "cli", GPUCTL_SERVER=url, GPUCTL_TOKEN=token)
    sub = subprocess.run([script("gpuctl"), "job", "submit", "-n", "seed", "-g", "1", "-d",
                          str(tmp_path), "--", sys.executable, "-c", "print('seeded')"],
                         env=cli, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job_id = int(sub.stdout.split()[-1])
    waited = subprocess.run([script("gpuctl"), "job", "wait", str(job_id), "--timeout", "120"],
                            env=cli, capture_output=True, text=True, timeout=150)
    assert waited.returncode == 0, (waited.stdout, waited.stderr,
                                    (tmp_path / "agent.log").read_text()[-3000:])

    # The MCP server takes its server and token from GPUCTL_SERVER_URL / GPUCTL_MCP_TOKEN
    # (nothing else points it anywhere: no GPUCTL_SERVER, an empty home).
    mcp_env = clean_env(tmp_path / "mcp", GPUCTL_SERVER_URL=url, GPUCTL_MCP_TOKEN=token)
    from mcp import Client

    from test_mcp import stdio_target

    async def job_state(client):
        r = await client.call_tool("get_job", {"job_id": job_id})
        assert not r.is_error, r.content
        return r.structured_content["state"]

    async def over_stdio():
        target = stdio_target([script("gpuctl-mcp"), "stdio"], mcp_env,
                              tmp_path / "mcp-stdio.log", cwd=None)
        async with Client(target) as client:
            return await job_state(client)
    assert asyncio.run(over_stdio()) == "SUCCEEDED"

    mcp_port = free_port()
    mcp = start(procs, [script("gpuctl-mcp"), "serve", "--port", str(mcp_port)], mcp_env,
                tmp_path / "mcp.log")

    def listening():
        assert mcp.poll() is None, (tmp_path / "mcp.log").read_text()[-3000:]
        try:
            requests.get(f"http://127.0.0.1:{mcp_port}/mcp", timeout=2)
            return True
        except requests.ConnectionError:
            return False
    wait_for(listening, 60, what="gpuctl-mcp serve to listen")

    async def over_http():
        import httpx2
        from mcp.client.streamable_http import streamable_http_client
        # over HTTP every caller brings a token of its own (docs/mcp.md)
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http, \
                Client(streamable_http_client(f"http://127.0.0.1:{mcp_port}/mcp",
                                              http_client=http)) as client:
            return await job_state(client)
    assert asyncio.run(over_http()) == "SUCCEEDED"


def _uv_env(home):
    """uv reads no pip configuration: give it the indexes pip uses on this host (an
    offline mirror in CI, say), trusted alike, and a cache of its own under `home`."""
    env = clean_env(home, UV_CACHE_DIR=str(home / "uv-cache"),
                    UV_INDEX_STRATEGY="unsafe-best-match", UV_PYTHON=sys.executable)
    env.pop("VIRTUAL_ENV", None)
    pip = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, timeout=60).stdout
    for line in pip.splitlines():
        key, _, value = line.partition("=")
        value = value.strip("'\"")
        if key.endswith(".index-url"):
            env["UV_INDEX_URL"] = value
        elif key.endswith(".extra-index-url"):
            env["UV_EXTRA_INDEX_URL"] = value
        elif key.endswith(".find-links"):
            env["UV_FIND_LINKS"] = value
    return env


def test_uv_sync_then_uv_run_the_seed_names(tmp_path, procs):
    """`uv sync` in a fresh copy of the repository, then `uv run gpuctl-server` answers
    and the other names run. uv comes with the test extras (pyproject.toml)."""
    uv = BIN / "uv"
    if not uv.exists():
        why = "uv is not installed in .venv (`make install` puts it there with the test extras)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)        # .ci/run installs the test extras
        pytest.skip(why)
    root = pathlib.Path(__file__).parent.parent
    copy = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=root, capture_output=True, check=True).stdout.split(b"\0")
    for rel in filter(None, files):
        src, dst = root / os.fsdecode(rel), copy / os.fsdecode(rel)
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    env = _uv_env(tmp_path)
    sync = subprocess.run([str(uv), "sync"], cwd=copy, env=env, capture_output=True,
                          text=True, timeout=600)
    assert sync.returncode == 0, sync.stderr[-3000:]
    # (what each name does is the test above's; here: uv finds and runs them)
    r = subprocess.run([str(uv), "run", "gpuctl", "job", "submit", "--help"], cwd=copy,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "usage: gpuctl job submit" in r.stdout, r.stderr[-2000:]
    for name in ("gpuctl-agent", "gpuctl-mcp"):
        assert (copy / ".venv" / "bin" / name).exists(), name
    port = free_port()
    server = start(procs, [str(uv), "run", "gpuctl-server", "--home", str(tmp_path / "home"),
                           "--port", str(port)], dict(env, GPUCTL_HOME=str(tmp_path / "home")),
                   tmp_path / "uv-server.log", cwd=copy)
    # uv run runs the server from the copy's own .venv
    assert (copy / ".venv" / "bin" / "gpuctl-server").exists()

    def up():
        assert server.poll() is None, (tmp_path / "uv-server.log").read_text()[-3000:]
        try:
            return requests.get(f"http://127.0.0.1:{port}/api/v1/health", timeout=2).ok
        except requests.ConnectionError:
            return False
    wait_for(up, 120, what="`uv run gpuctl-server` to answer")
