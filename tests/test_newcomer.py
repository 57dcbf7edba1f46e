"""What a newcomer meets in the first hour: another port, the lean `make up` install, the
order of what `up --example` prints, the CLI's own words for what to do next."""
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from procs import free_port, sigint_as_at_a_terminal, wait_for

from gpuplane import config

REPO = pathlib.Path(__file__).resolve().parent.parent


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH")] if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _gpuplane(*argv, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "gpuplane", *argv], env=env or _env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def held_port():
    """A port another program listens on (and never answers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# -- a port held by another program --------------------------------------------------------


def test_up_on_a_taken_port_says_so_at_once_and_writes_nothing(tmp_path, held_port):
    home = tmp_path / "home"
    proc = _gpuplane("--home", str(home), "up", "--port", str(held_port), "--example")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert err.startswith(f"error: port {held_port} on 127.0.0.1 is in use by ")
    assert re.search(r"`gpuplane up --port \d+` \(in the checkout: `make up PORT=\d+`\)$",
                     err), err
    suggested = int(re.search(r"--port (\d+)", err)[1])
    assert suggested != held_port
    assert "Connection in use" not in proc.stderr and "Traceback" not in proc.stderr
    assert not home.exists(), list(home.rglob("*"))


def test_server_on_a_taken_port_writes_no_server_toml(tmp_path, held_port):
    home = tmp_path / "home"
    proc = _gpuplane("--home", str(home), "server", "--port", str(held_port))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"port {held_port} on 127.0.0.1 is in use by " in proc.stderr
    assert "`gpuplane server --port " in proc.stderr
    assert "Connection in use" not in proc.stderr
    assert not (home / "server.toml").exists()


# -- the CLI follows the server `up` started -----------------------------------------------


def test_the_cli_finds_the_port_up_really_started_on(tmp_path, held_port):
    """server.toml names a taken port; `up --port Q` starts on Q; plain `gpuplane status`
    (no --server, no $GPUCTL_SERVER) reaches it, and after `up` stops, server.toml's
    address is the CLI's again."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "server.toml").write_text(f"port = {held_port}\n")
    port = free_port()
    env = _env(GPUCTL_HOME=str(home))
    out_path = tmp_path / "up.out"
    with open(out_path, "wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "gpuplane", "up", "--port", str(port),
                               "--fake-gpus", "1", "--name", "newcomer"], env=env,
                              stdout=out, stderr=subprocess.STDOUT,
                              preexec_fn=sigint_as_at_a_terminal)
    try:
        wait_for(lambda: up.poll() is not None or "Press Ctrl-C" in out_path.read_text(),
                 60, interval=0.1, what="`up` to be ready")
        text = out_path.read_text()
        assert up.poll() is None, text
        url = f"http://127.0.0.1:{port}"
        assert "try: gpuplane status\n" in text      # no --server to add
        assert config.running_address(home) == url
        assert _gpuplane("status", "--url", env=env).stdout.strip() == url
        status = _gpuplane("status", env=env)
        assert status.returncode == 0, status.stderr
        assert re.match(r"newcomer .*connected", status.stdout), status.stdout
        # An explicit address still wins.
        other = f"http://127.0.0.1:{held_port}"
        assert _gpuplane("status", "--url", env=dict(env, GPUCTL_SERVER=other)
                         ).stdout.strip() == other
        # A second `up` on the same home says where the first one is.
        again = _gpuplane("up", env=env)
        assert again.returncode == 1 and f"already runs on the home {home}, at {url}" \
            in again.stderr, again.stderr
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 130
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert not (home / config.ADDRESS_FILE).exists()
    assert _gpuplane("status", "--url", env=env).stdout.strip() == \
        f"http://127.0.0.1:{held_port}"


def test_a_running_address_whose_process_is_gone_is_ignored(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / config.ADDRESS_FILE).write_text(f"{dead.pid} http://127.0.0.1:1\n")
    assert config.running_address(tmp_path) is None
    (tmp_path / config.ADDRESS_FILE).write_text(f"{os.getpid()} http://127.0.0.1:2\n")
    assert config.running_address(tmp_path) == "http://127.0.0.1:2"
    (tmp_path / config.ADDRESS_FILE).write_text("garbage")
    assert config.running_address(tmp_path) is None


# -- make up: a port, and only what running needs ------------------------------------------


def _make_n(*argv, venv):
    if not shutil.which("make"):
        pytest.skip("make is not installed")
    return subprocess.run(["make", "-n", "-C", str(REPO), *argv, f"VENV={venv}"],
                          capture_output=True, text=True, timeout=30, check=True).stdout


def test_make_up_installs_no_test_tools_and_takes_a_port(tmp_path):
    venv = tmp_path / "venv"              # none there: make shows every step it would run
    up = _make_n("up", "PORT=8611", venv=venv)
    installs = [ln for ln in up.splitlines() if "pip install" in ln and "-e" in ln]
    assert installs and all("[test]" not in ln for ln in installs), up
    assert re.search(r"gpuplane up --example --port 8611$", up, re.M), up
    assert re.search(r"gpuplane up --example$", _make_n("up", venv=venv), re.M)
    for target in ("test", "lint", "install"):
        assert "-e '.[test]'" in _make_n(target, venv=venv), target


# -- up --example: what it prints, in order ------------------------------------------------


def test_up_example_says_the_job_started_before_its_lines(tmp_path):
    home = tmp_path / "home"
    proc = subprocess.run(
        [sys.executable, "-m", "gpuplane", "--home", str(home), "up", "--port",
         str(free_port()), "--fake-gpus", "1", "--example", "--exit-when-done"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, out
    lines = out.splitlines()
    first_log = next(i for i, ln in enumerate(lines) if ln.startswith("epoch "))
    started = [i for i, ln in enumerate(lines) if re.match(r"job 1 started on ", ln)]
    assert len(started) <= 1 and all(i < first_log for i in started), out
    # the example's own last words are a sentence, not the SDK's dict
    assert "sdk summary" not in out and "{" not in out.split("training finished")[0][-300:]
    assert re.search(r"^sdk: \d+ records sent to run \d+ of this job$", out, re.M), out


def test_a_follower_says_started_before_the_first_line(tmp_path, live_server, agent):
    """A job that waits first: `job submit -f`'s "job N started on NODE" (stderr) comes
    before the job's first line (stdout), both written to one terminal."""
    from gpuplane import client
    c = client.Client(live_server.url, live_server.token)
    hog = c.submit_job([sys.executable, "-c", "import time; time.sleep(600)"], str(tmp_path),
                       gpus=2)
    wait_for(lambda: c.get_job(hog["id"])["state"] == "RUNNING", 30, what="the hog running")
    path = tmp_path / "terminal"
    with open(path, "wb") as term:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuplane", "--server", live_server.url, "job", "submit",
             "-g", "1", "-f", "-d", str(tmp_path), "--", sys.executable, "-c",
             "print('first line', flush=True)"],
            env=_env(GPUCTL_TOKEN=live_server.token), stdout=term, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "is queued" in path.read_text(), 30, what="the follower's wait")
        c.cancel_job(hog["id"])
        assert proc.wait(60) == 0, path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = path.read_text()
    assert re.search(r"job \d+ started on ", text), text
    assert text.index(" started on ") < text.index("first line"), text


# -- next steps: tool calls for MCP, commands for the CLI, one table ----------------------


def _sample(name, field, n):
    """A value for a tool argument, distinct per argument, of the argument's type."""
    import typing
    ann = field.annotation
    kind = ann
    if typing.get_origin(ann) in (typing.Union, getattr(__import__("types"), "UnionType")):
        kind = [a for a in typing.get_args(ann) if a is not type(None)][0]
    origin = typing.get_origin(kind)
    if name == "stop_on":           # event types: the CLI checks them
        return ["LOSS_NAN", "LOSS_DIVERGED"]
    if origin is typing.Literal:
        return [v for v in typing.get_args(kind) if v != field.default][0]
    if kind is bool:
        return True
    if kind is int:
        return 100 + n
    if kind is float:
        return 100.0 + n
    if origin in (list, tuple):
        inner = typing.get_args(kind)[0] if typing.get_args(kind) else str
        return [200 + n, 300 + n] if inner is int else [f"w{n}a", f"w{n}b"]
    if origin is dict:
        return {f"K{n}": f"v{n}"}
    if name == "time_limit":
        return "90m"
    if name in ("command", "eval_command"):
        return f"python s{n}.py --x {n}"
    if name.endswith("_dir"):
        return f"/abs/s{n}"
    return f"s{n}"


def _flat(values):
    out = []
    for v in values:
        if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], str):   # --env K=V
            out.append(f"{v[0]}={v[1]}")
        elif isinstance(v, (list, tuple)):
            out += _flat(v)
        elif isinstance(v, dict):
            out += [f"{k}={x}" for k, x in v.items()]
        else:
            out.append(v)
    return out


def test_every_suggested_tool_has_a_cli_command_that_parses_to_the_same_arguments():
    import mcp_server
    from gpuplane import cli, next_actions
    named = set()
    for path in (REPO / "gpuplane").rglob("*.py"):
        named |= set(re.findall(r"\baction\(\s*\"(\w+)\"", path.read_text()))
    named |= set(re.findall(r"\baction\(\s*\"(\w+)\"", (REPO / "mcp_server.py").read_text()))
    assert named <= set(next_actions.CLI), named - set(next_actions.CLI)
    for tool, (words, positional, flags, left_out) in next_actions.CLI.items():
        fields = mcp_server.TOOL_BY_NAME[tool].input.model_fields
        covered = set(positional) | set(flags) | set(left_out)
        assert covered == set(fields), (tool, set(fields) ^ covered)
        arguments = {name: _sample(name, f, i) for i, (name, f) in enumerate(fields.items())
                     if name not in left_out}
        line = next_actions.cli_command(next_actions.action(tool, "why", **arguments))
        assert line.startswith(f"gpuplane {words} "), line
        parsed = cli.get_parser().parse_args(shlex.split(line)[1:])
        assert callable(parsed.func), line
        seen = _flat([[v] if isinstance(v, tuple) else v for v in vars(parsed).values()
                      if v is not None])
        seen = {str(v) for v in seen} | {" ".join(map(str, v)) for v in vars(parsed).values()
                                         if isinstance(v, list)}
        for name, value in arguments.items():
            flag = flags.get(name)
            if isinstance(flag, dict):
                dest = flag[value].lstrip("-").replace("-", "_") if flag.get(value) else None
                assert dest is None or getattr(parsed, dest) is True, (line, name)
            elif isinstance(flag, tuple):
                assert (shlex.join(value) if isinstance(value, list) else value) in seen, \
                    (tool, name, line)
            elif value is True:
                dest = flag.lstrip("-").replace("-", "_")
                assert getattr(parsed, dest) is True, (line, name, dest)
            else:
                for v in _flat([value]):
                    v = {"90m": 5400}.get(v, v)       # --time is parsed into seconds
                    assert str(v) in seen, (tool, name, v, line, vars(parsed))


def test_the_cli_prints_commands_where_mcp_prints_tool_calls(capsys):
    from gpuplane.cli.common import print_next_actions
    from gpuplane.next_actions import action
    print_next_actions([
        action("evaluate_checkpoint", "evaluate it", checkpoint_id=18),
        action("get_job_logs", "read more", job_id=18, tail=200),
        action("diagnose_run", "judge it", run_id=3),
        action("get_best_checkpoint", "keep it", sweep_id=1),
        action("wait_for_jobs", "wait", job_ids=[4, 5], mode="any", timeout_s=600),
        action("submit_job", "again", command="python train.py --lr 0.1",
               working_dir="/w d", cpu_only=True, project="p"),
    ])
    assert capsys.readouterr().out.splitlines() == [
        "next:",
        "  gpuplane ckpt evaluate 18  # evaluate it",
        "  gpuplane logs 18 --tail 200  # read more",
        "  gpuplane diagnose 3  # judge it",
        "  gpuplane ckpt recommend --sweep 1  # keep it",
        "  gpuplane job wait 4 5 --any  # wait",
        "  gpuplane job submit -d '/w d' --cpu-only --project p -- "
        "'python train.py --lr 0.1'  # again",
    ]


# -- explain knows what job show knows; -d on this host ------------------------------------


def _cli(live_server, monkeypatch, capsys, *argv):
    from gpuplane import cli
    monkeypatch.setenv("GPUCTL_TOKEN", live_server.token)
    code = cli.main(["--server", live_server.url, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_says_what_job_show_says(live_server, agent, monkeypatch, capsys, tmp_path):
    missing = tmp_path / "does-not-exist"
    cases = [(["-d", str(missing), "--", "python", "train.py"],
              f"working dir does not exist on this host: {missing}", "create the directory"),
             (["-d", str(tmp_path), "--", "pythn", "train.py"],
              "command not found: pythn", "check the program's spelling")]
    for argv, sentence, tip in cases:
        code, out, err = _cli(live_server, monkeypatch, capsys, "job", "submit", "--cpu-only",
                              "-f", *argv)
        assert code == 5, err
        job_id = int(out.splitlines()[0])
        assert " started on " not in err, err            # it never started
        _, shown, _ = _cli(live_server, monkeypatch, capsys, "job", "show", str(job_id))
        assert re.search(r"why\s+" + re.escape(sentence), shown), shown
        _, explained, _ = _cli(live_server, monkeypatch, capsys, "explain", str(job_id))
        first = explained.splitlines()[0]
        assert first == f"DISPATCH_FAILED: job {job_id} could not be started by the agent: " \
            f"{sentence}", explained
        assert f"  try: {tip}" in explained
        assert f"  gpuplane logs {job_id} --tail 200  #" in explained
        _, js, _ = _cli(live_server, monkeypatch, capsys, "explain", str(job_id), "--json")
        assert __import__("json").loads(js)["reason"] == sentence


def test_a_relative_dir_is_resolved_when_the_agent_is_on_this_host(
        live_server, agent, monkeypatch, capsys, tmp_path):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path)
    code, out, err = _cli(live_server, monkeypatch, capsys, "job", "submit", "--cpu-only",
                          "-d", "work", "-f", "--", "pwd")
    assert code == 0, err
    assert f"-d work: {tmp_path / 'work'} (the agent runs on this host)" in err
    assert out.splitlines()[-1] == str(tmp_path / "work")
    code, out, err = _cli(live_server, monkeypatch, capsys, "job", "submit", "--cpu-only",
                          "-d", "nowhere", "--", "true")
    assert code == 0
    assert f"warning: working dir {tmp_path / 'nowhere'} does not exist on this host" in err


def test_run_compare_and_ckpt_compare_print_commands_next(live_server, monkeypatch, capsys):
    from gpuplane import client
    c = client.Client(live_server.url, live_server.token)
    runs = []
    for scale in (1.0, 2.0):
        run = c.create_run(project="cmp", experiment="e")["id"]
        c.log_run_metrics(run, ["val/loss"], [[0, s, scale / (s + 1), 0] for s in range(20)])
        c.create_checkpoint(run, f"/ck/{run}/10.pt", step=10)
        runs.append(run)
    code, out, err = _cli(live_server, monkeypatch, capsys, "run", "compare",
                          *map(str, runs))
    assert code == 0, err
    assert out.startswith(f"run {runs[0]} wins on val/loss"), out
    assert f"  gpuplane ckpt recommend --run {runs[0]}  #" in out
    assert f"  gpuplane diagnose {runs[0]}  #" in out
    code, out, err = _cli(live_server, monkeypatch, capsys, "ckpt", "compare",
                          *map(str, runs))
    assert code == 0, err
    assert out.startswith("ranked by val/loss (lower is better)"), out
    assert re.search(r"gpuplane ckpt evaluate \d+  #", out), out
    code, _, err = _cli(live_server, monkeypatch, capsys, "run", "compare", str(runs[0]))
    assert code == 2 and "at least two runs" in err


def test_a_relative_dir_is_refused_in_one_line_without_a_node_on_this_host(
        live_server, monkeypatch, capsys):
    code, out, err = _cli(live_server, monkeypatch, capsys, "job", "submit", "--cpu-only",
                          "-d", "relative/dir", "--", "true")
    assert code == 1 and out == ""
    assert err.startswith("error: ") and "relative/dir" in err
    assert len(err.strip().splitlines()) == 1


def test_an_agent_token_is_named_after_its_node_and_others_need_a_name(
        live_server, monkeypatch, capsys):
    code, out, err = _cli(live_server, monkeypatch, capsys, "token", "create", "--agent",
                          "cluster")
    assert code == 0 and out.strip().startswith("gp"), err
    assert "'agent cluster' scope agent" in err
    code, out, err = _cli(live_server, monkeypatch, capsys, "token", "create", "--scope",
                          "read")
    assert code == 2 and out == ""
    assert err == "error: give the token a --name saying what it is for, e.g. --name " \
        "laptop\n"


def test_doctor_judges_a_slurm_node_by_its_partition_not_its_login_node():
    from gpuplane.cli import doctor
    node = {"name": "cluster", "state": "connected", "runner": "slurm", "gpus": [],
            "cpu_slots": 8, "version": "0.1.0",
            "slurm": {"partition": "gpu", "nodes": 1, "max_gpus": 2}}
    r = doctor.Report()
    doctor._check_slurm_node(r, node)
    assert not r.failed and "Slurm partition gpu: 1 nodes, up to 2 GPUs" in r.lines[0]["detail"]
    r = doctor.Report()
    doctor._check_slurm_node(r, dict(node, slurm={"error": "sinfo: command not found"}))
    assert r.failed and "sinfo failed" in r.lines[0]["detail"]
