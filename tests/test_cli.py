"""The `gpuplane` CLI and the REST client: parsing, server/token resolution, and the
commands against a real server and agent."""

import http.server
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading

import pytest

from procs import free_port, sigint_as_at_a_terminal, wait_for

from gpuplane import cli, client, config

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    # A developer's own GPUCTL_* settings must not leak into what is tested.
    for key in ("GPUCTL_SERVER", "GPUCTL_TOKEN", "GPUCTL_HOME"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user-home"))


# -- parser ------------------------------------------------------------------------------

PARSES = [
    (["server"], {"command": "server"}),
    (["server", "--host", "0.0.0.0", "--port", "9000", "--threads", "32"],
     {"host": "0.0.0.0", "port": 9000, "threads": 32}),
    (["agent", "--server", "http://h:8600", "--token", "t", "--fake-gpus", "2"],
     {"agent_args": ["--server", "http://h:8600", "--token", "t", "--fake-gpus", "2"]}),
    (["up", "--port", "0", "--fake-gpus", "2", "--example", "--exit-when-done"],
     {"port": 0, "fake_gpus": 2, "example": True, "exit_when_done": True}),
    (["job", "submit", "-n", "mnist", "-g", "2", "-d", "/data/mnist", "--priority", "5",
      "--max-attempts", "3", "--env", "LR=0.1", "--env", "X=a=b", "--project", "p",
      "--experiment", "e", "--tb-dir", "runs", "--watch", "ckpt", "--follow", "--",
      "python", "train.py", "--epochs", "3"],
     {"name": "mnist", "gpus": 2, "working_dir": "/data/mnist", "priority": 5,
      "max_attempts": 3, "env": [("LR", "0.1"), ("X", "a=b")], "project": "p",
      "experiment": "e", "tb_dir": "runs", "watch": "ckpt", "follow": True,
      "cmd": ["python", "train.py", "--epochs", "3"]}),
    (["job", "submit", "--cpu-only", "--", "echo hi"], {"cpu_only": True, "cmd": ["echo hi"]}),
    (["job", "list", "--state", "running", "--json"], {"state": "RUNNING", "json": True}),
    (["job", "show", "17", "--json"], {"job_id": 17, "json": True}),
    (["job", "cancel", "3"], {"job_id": 3, "job_command": "cancel"}),
    (["job", "retry", "3"], {"job_id": 3, "job_command": "retry"}),
    (["logs", "-f", "--tail", "20", "5"], {"follow": True, "tail": 20, "job_id": 5}),
    (["logs", "5"], {"follow": False, "tail": None}),
    (["status", "--json"], {"json": True}),
    (["whoami"], {"command": "whoami"}),
    (["token", "create", "--name", "laptop", "--scope", "read"],
     {"name": "laptop", "scope": "read"}),
    (["token", "list", "--json"], {"json": True}),
    (["token", "revoke", "4"], {"token_id": 4}),
    (["token", "show-admin"], {"token_command": "show-admin"}),
    # Connection flags work before and after the command.
    (["--server", "http://a:1", "job", "list"], {"server": "http://a:1", "token": None}),
    (["job", "list", "--server", "http://b:2", "--token", "T"],
     {"server": "http://b:2", "token": "T"}),
    (["--token", "T1", "status", "--home", "/h"], {"token": "T1", "home": "/h"}),
]


@pytest.mark.parametrize("argv,expected", PARSES, ids=[" ".join(a) for a, _ in PARSES])
def test_every_command_parses(argv, expected):
    args = cli.get_parser().parse_args(argv)
    assert callable(args.func)
    for key, value in expected.items():
        assert getattr(args, key) == value, key


BAD = [
    ([], "required: COMMAND"),
    (["job"], "required: JOB_COMMAND"),
    (["frobnicate"], "invalid choice"),
    (["job", "show", "abc"], "job ids are numbers"),
    (["job", "show", "0"], "job ids start at 1"),
    (["job", "submit", "-n", "x"], "required: CMD"),
    (["job", "submit", "-n", "x", "python", "train.py", "--epochs", "3"],
     "unrecognized arguments: --epochs"),
    # Issue 9 item 14: the usual cause is named.
    (["job", "submit", "-n", "x", "python", "train.py", "--epochs", "3"],
     "hint: put `--` before the job's command"),
    (["job", "submit", "--env", "NOEQUALS", "--", "ls"], "expected KEY=VALUE"),
    (["job", "submit", "-g", "-1", "--", "ls"], "expected"),
    (["job", "list", "--state", "SLEEPING"], "invalid choice"),
    (["logs", "--tail", "many", "3"], "expected a whole number"),
    (["token", "create", "--name", "x", "--scope", "root"], "invalid choice: 'root'"),
    # `token create` without --name: tests/test_newcomer.py (--agent NODE names it)
    (["server", "--port", "70000"], "a port is 0-65535"),
    # a mistyped command names the one meant
    (["job", "sumbit", "--", "ls"], "did you mean: gpuplane job submit"),
    (["sweeps", "list"], "did you mean: gpuplane sweep"),
]


def test_version_is_printed(capsys):
    from gpuplane import __version__
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"gpuplane {__version__}"


def test_a_column_of_values_has_one_precision():
    from gpuplane.cli.checkpoints import _column_format
    fmt = _column_format([0.4182, 0.520878, 0.61])
    assert [fmt(v) for v in (0.4182, 0.520878, 0.61)] == ["0.4182", "0.5209", "0.6100"]
    fmt = _column_format([1234.5, 1234.25])
    assert fmt(1234.5) != fmt(1234.25) and fmt(1234.5).startswith("1234.5")


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) or "(none)" for a, _ in BAD])
def test_bad_input_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_exit_when_done_needs_example(capsys, tmp_path):
    assert cli.main(["--home", str(tmp_path), "up", "--exit-when-done"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err.startswith("error: --exit-when-done")


def test_submit_body_sends_the_dir_as_given_and_a_shell_line_as_a_string(monkeypatch):
    parse = cli.get_parser().parse_args
    command, wd, fields = cli.jobs.job_body(parse(
        ["job", "submit", "-d", "relative/dir", "--", "python", "sub/train.py"]))
    assert command == ["python", "sub/train.py"] and wd == "relative/dir"
    assert fields["name"] == "train" and fields["cpu_only"] is None
    command, wd, fields = cli.jobs.job_body(parse(["job", "submit", "-g", "0", "--", "echo a | wc"]))
    assert command == "echo a | wc" and wd == os.getcwd()
    assert fields["cpu_only"] is True and fields["gpus"] == 0 and fields["name"] == "echo"


def test_time_formatting():
    now = 1_764_403_200.0
    assert cli.ago(now * 1000 - 2_000, now) == "just now"
    assert cli.ago(now * 1000 - 42_000, now) == "42s ago"
    assert cli.ago(now * 1000 - 5 * 60_000, now) == "5m ago"
    assert cli.ago(now * 1000 - 3 * 3_600_000, now) == "3h ago"
    assert cli.ago(None, now) is None
    assert cli.duration(1000, 46_000) == "45s"
    assert cli.duration(1000, 1400) == "0.4s" and cli.duration(1000, 10_900) == "9.9s"
    assert cli.duration(0 + 1, 192_001) == "3m 12s"
    assert cli.duration(1, 3_720_001) == "1h 02m"


def test_table_is_aligned(capsys):
    cli.print_table([[1, "a", None], [100, "longer name", "x"]], ["ID", "NAME", "NODE"])
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["ID   NAME         NODE",
                     "1    a            -",
                     "100  longer name  x"]


# -- server and token resolution ------------------------------------------------------------

def write_server_toml(home, text):
    home.mkdir(parents=True, exist_ok=True)
    (home / "server.toml").write_text(text)


def test_resolution_defaults_without_any_configuration(tmp_path):
    assert client.resolve(home=tmp_path / "nothing") == ("http://127.0.0.1:8600", None)


def test_resolution_reads_the_local_server_toml(tmp_path):
    write_server_toml(tmp_path, 'admin_token = "adm"\nhost = "0.0.0.0"\nport = 9123\n')
    assert client.resolve(home=tmp_path) == ("http://127.0.0.1:9123", "adm")


def test_resolution_env_beats_toml_and_args_beat_env(tmp_path, monkeypatch):
    write_server_toml(tmp_path, 'admin_token = "adm"\nport = 9123\n')
    monkeypatch.setenv("GPUCTL_SERVER", "http://env-host:1/")
    monkeypatch.setenv("GPUCTL_TOKEN", "envtok")
    assert client.resolve(home=tmp_path) == ("http://env-host:1", "envtok")
    assert client.resolve("http://arg:2", "argtok", home=tmp_path) == ("http://arg:2", "argtok")
    assert client.resolve("http://arg:2", home=tmp_path) == ("http://arg:2", "envtok")
    monkeypatch.delenv("GPUCTL_SERVER")
    assert client.resolve(home=tmp_path) == ("http://127.0.0.1:9123", "envtok")


def test_home_from_environment(tmp_path, monkeypatch):
    write_server_toml(tmp_path, 'admin_token = "from-env-home"\nport = 9124\n')
    monkeypatch.setenv("GPUCTL_HOME", str(tmp_path))
    assert client.resolve() == ("http://127.0.0.1:9124", "from-env-home")


def test_local_admin_token_never_goes_to_another_server(tmp_path, monkeypatch):
    write_server_toml(tmp_path, 'admin_token = "adm"\nport = 9123\n')
    assert client.resolve("http://elsewhere:8600", home=tmp_path) == \
        ("http://elsewhere:8600", None)
    monkeypatch.setenv("GPUCTL_SERVER", "http://elsewhere:8600")
    assert client.resolve(home=tmp_path)[1] is None
    # ... but naming the local server explicitly still finds its token.
    assert client.resolve("http://127.0.0.1:9123/", home=tmp_path)[1] == "adm"


@pytest.mark.parametrize("given,expected", [
    ("127.0.0.1:8600", "http://127.0.0.1:8600"),
    ("localhost:8600/", "http://localhost:8600"),
    ("gpu-box", "http://gpu-box"),
    ("https://h.example:443", "https://h.example:443"),
    ("[::1]:8600", "http://[::1]:8600"),
])
def test_a_server_address_without_a_scheme_is_http(given, expected):
    # Issue 9 item 7.
    assert client.resolve(given, "t") == (expected, "t")


@pytest.mark.parametrize("given,says", [
    ("ftp://h:21", "has scheme 'ftp'"),
    ("127.0.0.1:port", "is not a URL"),
    ("http://:8600", "names no host"),
])
def test_a_bad_server_address_is_one_sentence_and_exit_2(given, says, capsys, monkeypatch):
    monkeypatch.setenv("GPUCTL_TOKEN", "t")
    assert cli.main(["--server", given, "status"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("error: server address") and says in err
    assert "bug" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("local", ["http://localhost:9123", "http://127.0.0.1:9123",
                                   "http://127.1.2.3:9123", "http://[::1]:9123",
                                   "localhost:9123", "http://LOCALHOST:9123/"])
def test_every_loopback_name_is_the_local_server(local, tmp_path):
    # Issue 9 item 8: the admin token is found however the local server is named ...
    write_server_toml(tmp_path, 'admin_token = "adm"\nhost = "127.0.0.1"\nport = 9123\n')
    assert client.resolve(local, home=tmp_path)[1] == "adm"
    # ... and never for another port or host.
    assert client.resolve(local.replace("9123", "9124"), home=tmp_path)[1] is None
    assert client.resolve("http://10.0.0.1:9123", home=tmp_path)[1] is None


def test_no_token_found_is_said_once(tmp_path, capsys, monkeypatch):
    # A server that wants a token: the CLI's sentence replaces the server's, not repeats it.
    class NeedsToken(_Handler):
        def do_GET(self):
            body = json.dumps({"error": {"code": "Unauthorized",
                                         "message": "no token: send a bearer token"}}).encode()
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NeedsToken)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        code = cli.main(["--home", str(tmp_path), "--server",
                         f"localhost:{srv.server_address[1]}", "status"])
    finally:
        srv.shutdown()
        srv.server_close()
    err = capsys.readouterr().err
    assert code == cli.EXIT_ERROR
    assert "send a bearer token" not in err
    assert "none was found: set $GPUCTL_TOKEN" in err and len(err.splitlines()) == 1


def test_show_admin_prints_the_token_of_the_home(tmp_path, capsys):
    cfg, created = config.ensure_server_config(tmp_path)
    assert created
    assert cli.main(["--home", str(tmp_path), "token", "show-admin"]) == 0
    assert capsys.readouterr().out.strip() == cfg["admin_token"]


def test_show_admin_without_a_server_toml_names_the_fix(tmp_path, capsys):
    assert cli.main(["token", "show-admin", "--home", str(tmp_path / "none")]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "gpuplane server" in err and "server.toml" in err


def test_unreachable_server_is_one_line_and_exit_4(capsys, monkeypatch):
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("GPUCTL_TOKEN", "t")
    assert cli.main(["--server", url, "job", "list"]) == cli.EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot reach the GPUPlane server at {url}")
    assert len(err.strip().splitlines()) == 1


# -- client against plain HTTP servers ---------------------------------------------------
# These two stand in for a broken proxy and a flaky network, which a real GPUPlane
# server does not produce on demand.

class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen_last_event_ids = []

    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.path.startswith("/api/v1/jobs/1/logs/stream"):
            return self._stream()
        body = b"<html>Bad Gateway</html>"
        self.send_response(502)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _stream(self):
        last = self.headers.get("Last-Event-ID")
        type(self).seen_last_event_ids.append(last)
        start = int(last) + 1 if last else 1
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        # First connection: lines 1-3, then the connection drops mid-job.
        # Second: the rest from where the client says it is, then the end event.
        stop = 3 if last is None else 5
        for i in range(start, stop + 1):
            line = {"id": i, "attempt": 1, "line_no": i, "ts": 0, "text": f"line {i}"}
            self.wfile.write(f": keepalive\n\nid: {i}\ndata: {json.dumps(line)}\n\n".encode())
        if last is not None:
            self.wfile.write(b'event: end\ndata: {"state": "SUCCEEDED"}\n\n')
        self.wfile.flush()


@pytest.fixture
def plain_server():
    _Handler.seen_last_event_ids = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_non_json_error_names_the_url(plain_server):
    c = client.Client(plain_server, "t")
    with pytest.raises(client.ApiError) as exc:
        c.list_jobs()
    assert exc.value.status == 502
    assert plain_server in exc.value.message and "Bad Gateway" in exc.value.message


def test_stream_resumes_with_last_event_id_without_loss_or_repeats(plain_server):
    c = client.Client(plain_server, "t")
    said = []
    texts = [line["text"] for line in c.stream_job_logs(
        1, tail=10, on_reconnect=lambda reason, s: said.append(reason))]
    assert texts == [f"line {i}" for i in range(1, 6)]
    assert _Handler.seen_last_event_ids == [None, "3"]
    # The wait for the reconnection is announced once, with why.
    assert said == ["the stream closed before the job ended"]


# -- against a real server and agent -----------------------------------------------------

def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH")] if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _wait(what, check, deadline_s=30):
    return wait_for(check, deadline_s, interval=0.1, what=what)


@pytest.fixture
def stack(live_server, agent):
    """The conftest's real server and agent (node1, 2 fake GPUs)."""
    return {"url": live_server.url, "token": live_server.token, "node": agent.name,
            "client": client.Client(live_server.url, live_server.token)}


def run_cli(stack, *argv):
    """Run the CLI in process against the stack; returns (code, stdout, stderr)."""
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    # The token in the environment, as the docs say: on a command line `ps` shows it.
    saved = os.environ.get("GPUCTL_TOKEN")
    os.environ["GPUCTL_TOKEN"] = stack["token"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["--server", stack["url"], *argv])
    finally:
        if saved is None:
            os.environ.pop("GPUCTL_TOKEN", None)
        else:
            os.environ["GPUCTL_TOKEN"] = saved
    return code, out.getvalue(), err.getvalue()


def test_submit_follow_show_and_list(stack, tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    code, out, err = run_cli(
        stack, "job", "submit", "-n", "hello", "--cpu-only", "-d", str(workdir),
        "--env", "GREETING=hi there", "--follow", "--",
        sys.executable, "-c", "import os; print(os.environ['GREETING']); print('done')")
    assert code == cli.EXIT_OK, err
    lines = out.splitlines()
    job_id = int(lines[0])
    assert lines[1:] == ["hi there", "done"]
    assert f"job {job_id} SUCCEEDED" in err

    code, out, _ = run_cli(stack, "job", "show", str(job_id))
    assert code == 0
    assert "SUCCEEDED" in out and "hello" in out and str(workdir) in out
    assert "ATTEMPT" in out and stack["node"] in out

    code, out, _ = run_cli(stack, "job", "show", str(job_id), "--json")
    job = json.loads(out)
    assert job["state"] == "SUCCEEDED" and job["exit_code"] == 0 and job["attempts"]

    code, out, _ = run_cli(stack, "job", "list", "--json")
    assert [j["id"] for j in json.loads(out)] == [job_id]
    code, out, _ = run_cli(stack, "job", "list")
    header, row = out.splitlines()
    assert header.split()[:3] == ["ID", "NAME", "STATE"]
    assert row.split()[:3] == [str(job_id), "hello", "SUCCEEDED"]

    code, out, _ = run_cli(stack, "logs", "--tail", "1", str(job_id))
    assert code == 0 and out == "done\n"

    # Issue 9 item 10: cancelling a job that SUCCEEDED is refused, with exit 1.
    code, out, err = run_cli(stack, "job", "cancel", str(job_id))
    assert code == cli.EXIT_ERROR and out == ""
    assert err.startswith("error: ") and "SUCCEEDED" in err
    # Issue 9 item 9: retrying it runs it again as a new attempt.
    code, out, err = run_cli(stack, "job", "retry", str(job_id))
    assert code == 0 and f"job {job_id} QUEUED again" in out, err
    code, out, err = run_cli(stack, "logs", "-f", str(job_id))
    assert code == 0 and "--- attempt 2 ---" in out


def test_failed_job_exit_code(stack, tmp_path):
    # A relative -d: tests/test_newcomer.py (resolved when the agent is on this host, else
    # refused in one line).
    code, out, err = run_cli(stack, "job", "submit", "--cpu-only", "-d", str(tmp_path),
                             "--follow", "--", sys.executable, "-c", "raise SystemExit(7)")
    assert code == cli.EXIT_FAILED
    assert "FAILED" in err and "exit code 7" in err


def test_cancel_retry_and_logs_follow(stack, tmp_path):
    code, out, _ = run_cli(
        stack, "job", "submit", "--cpu-only", "-d", str(tmp_path), "--",
        sys.executable, "-c",
        "import time\nprint('started', flush=True)\nwhile True: time.sleep(0.05)")
    job_id = int(out)
    c = stack["client"]
    _wait("job running and printing", lambda: c.get_job_logs(job_id)["lines"], 30)

    # A second `gpuplane` process follows the logs while this one cancels.
    out_path = tmp_path / "follow.out"
    with open(out_path, "wb") as out_file:
        follower = subprocess.Popen(
            [sys.executable, "-m", "gpuplane", "--server", stack["url"], "logs", "-f",
             str(job_id)],
            env=dict(_env(), GPUCTL_TOKEN=stack["token"]), stdout=out_file, stderr=subprocess.PIPE, text=True)
    try:
        _wait("the follower printing", lambda: out_path.read_text().startswith("started\n"))
        code, out, _ = run_cli(stack, "job", "cancel", str(job_id))
        assert code == 0 and f"job {job_id}" in out
        _wait("the job to be CANCELLED",
              lambda: c.get_job(job_id)["state"] == "CANCELLED", 30)
        err = follower.communicate(timeout=30)[1]
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == cli.EXIT_CANCELLED, err
    assert out_path.read_text() == "started\n"
    assert f"job {job_id} CANCELLED" in err

    # Issue 9 item 10: cancelling a CANCELLED job is a success that says so.
    code, out, _ = run_cli(stack, "job", "cancel", str(job_id))
    assert code == 0 and f"job {job_id} was already CANCELLED" in out

    code, out, _ = run_cli(stack, "job", "retry", str(job_id), "--json")
    assert code == 0 and json.loads(out)["state"] in ("QUEUED", "DISPATCHED", "RUNNING")
    _wait("the second attempt", lambda: c.get_job(job_id)["attempt"] == 2)
    code, out, _ = run_cli(stack, "job", "show", str(job_id))
    assert re.search(r"attempt\s+2 of", out)
    run_cli(stack, "job", "cancel", str(job_id))


def test_status_shows_nodes_slots_and_queue(stack, tmp_path):
    # More GPUs than any node has: it stays queued with a reason.
    code, out, _ = run_cli(stack, "job", "submit", "-g", "4", "-n", "huge", "-d",
                           str(tmp_path), "--", "true")
    assert code == 0
    code, out, _ = run_cli(stack, "status")
    assert code == 0
    assert stack["node"] in out and "GPU 0" in out and "GPU 1" in out
    assert "huge" in out and "queue: 1 job" in out
    code, out, _ = run_cli(stack, "status", "--json")
    data = json.loads(out)
    assert [n["name"] for n in data["nodes"]] == [stack["node"]]
    assert [j["name"] for j in data["queue"]] == ["huge"]


def test_missing_job_is_one_error_line(stack):
    code, out, err = run_cli(stack, "job", "show", "999")
    assert code == cli.EXIT_ERROR and out == ""
    assert err.startswith("error: ") and "999" in err


def test_tokens_and_whoami(stack):
    code, out, _ = run_cli(stack, "whoami", "--json")
    assert json.loads(out)["scope"] == "admin"
    code, out, err = run_cli(stack, "token", "create", "--name", "laptop", "--scope", "read")
    assert code == 0
    secret = out.strip()
    assert secret and "shown only this once" in err

    reader = {**stack, "token": secret}
    code, out, _ = run_cli(reader, "whoami")
    assert code == 0 and "laptop" in out and "read only" in out
    code, _, err = run_cli(reader, "job", "submit", "--cpu-only", "-d", "/tmp", "--", "true")
    assert code == cli.EXIT_ERROR and err.startswith("error: ")

    code, out, _ = run_cli(stack, "token", "list", "--json")
    token_id = next(t["id"] for t in json.loads(out) if t["name"] == "laptop")
    assert secret not in out
    code, out, _ = run_cli(stack, "token", "revoke", str(token_id))
    assert code == 0 and "revoked" in out
    code, _, err = run_cli(reader, "whoami")
    assert code == cli.EXIT_ERROR and err.startswith("error: ")


def test_slow_up_example_exit_when_done(tmp_path):
    """`gpuplane up --example --exit-when-done` from a clean home. Slow (~10-30 s):
    skip with `-k "not slow"`."""
    home = tmp_path / "home"
    proc = subprocess.run(
        [sys.executable, "-m", "gpuplane", "--home", str(home), "up", "--port",
         str(free_port()), "--example", "--exit-when-done"],
        env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GPUPlane is up at http://127.0.0.1:" in proc.stdout
    assert str(home / "server.toml") in proc.stdout
    assert "SUCCEEDED" in proc.stdout
    assert "Traceback" not in proc.stderr
    # Both children were stopped: nothing answers on the port any more.
    url = proc.stdout.split("GPUPlane is up at ")[1].split()[0]
    with pytest.raises(client.ServerUnreachable):
        client.Client(url, "-").get_health()


def test_up_stays_up_until_sigterm_then_stops_both(tmp_path):
    home = tmp_path / "home"
    out_path = tmp_path / "up.out"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuplane", "--home", str(home), "up", "--port",
             str(free_port()), "--fake-gpus", "1", "--name", "upnode"],
            env=_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait("`up` to be ready", lambda: proc.poll() is not None
              or "Press Ctrl-C" in out_path.read_text(), 60)
        assert proc.poll() is None, out_path.read_text()
        text = out_path.read_text()
        url = text.split("GPUPlane is up at ")[1].split()[0]
        assert "node upnode: 1 GPU (fake)" in text
        token = config.load_server_config(home)["admin_token"]
        nodes = client.Client(url, token).list_nodes()
        assert [(n["name"], n["state"]) for n in nodes] == [("upnode", "connected")]
        proc.terminate()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(client.ServerUnreachable):
        client.Client(url, "-").get_health()
    assert (home / "logs" / "server.log").exists() and (home / "logs" / "agent.log").exists()
    # issue 22: agent.log was 0644 (opened after the server had made the home private)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (home / "logs").iterdir()}
    assert modes == {"server.log": "0o600", "agent.log": "0o600"}, modes
    assert oct((home / "logs").stat().st_mode & 0o777) == "0o700"


def test_token_on_the_command_line_is_warned_about(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert cli.main(["--server", url, "--token", "secret", "whoami"]) == cli.EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert err.startswith("warning: a token on the command line is visible")
    assert "$GPUCTL_TOKEN" in err


WEIRD_KEYS = ["train/loss", "what?yes", "a#b", "with space", "ünï/лосс", "pct%20x", "q&r=s"]


def test_metric_keys_are_quoted_whole_by_the_client(live_server, capsys, monkeypatch):
    c = client.Client(live_server.url, live_server.token)
    run = c.create_run(project="quoting")["id"]
    c.log_run_metrics(run, WEIRD_KEYS, [[i, s, float(s * (i + 1)), 0]
                                    for i in range(len(WEIRD_KEYS)) for s in range(3)])
    for i, key in enumerate(WEIRD_KEYS):
        series = c.get_run_metric(run, key)
        assert series["key"] == key
        assert [p[0] for p in series["points"]] == [0, 1, 2], key
    monkeypatch.setenv("GPUCTL_TOKEN", live_server.token)
    assert cli.main(["--server", live_server.url, "run", "show", str(run), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["metrics"]
    assert sorted(k["key"] for k in shown) == sorted(WEIRD_KEYS)
    assert all(len(k["sparkline"]) == 3 for k in shown)


def _follower(stack, tmp_path, name, *argv):
    """A `gpuplane` process in the background; its stderr goes to a file to poll."""
    err_path = tmp_path / f"{name}.err"
    with open(err_path, "wb") as err, open(tmp_path / f"{name}.out", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gpuplane", "--server", stack["url"],
                                 *argv], env=dict(_env(), GPUCTL_TOKEN=stack["token"]),
                                stdout=out, stderr=err)
    return proc, err_path


def test_submit_warns_when_no_node_can_hold_the_job_and_followers_say_why_they_wait(
        stack, tmp_path):
    # Issue 9 item 2. The stack's node has 2 (fake) GPUs.
    code, out, err = run_cli(stack, "job", "submit", "-g", "5", "--", "true")
    assert code == 0
    never = int(out)
    assert f"warning: job {never} needs 5 GPUs on one node, and the largest node " \
        f"({stack['node']}) has 2" in err
    follower, follower_err = _follower(stack, tmp_path, "never", "logs", "-f", str(never))
    try:
        _wait("the follower to say why the job waits",
              lambda: "needs 5 GPUs on one node" in follower_err.read_text())
    finally:
        run_cli(stack, "job", "cancel", str(never))
    assert follower.wait(30) == cli.EXIT_CANCELLED

    # A job that fits but waits for a busy node: the follower says why, then that it started.
    code, out, err = run_cli(stack, "job", "submit", "-g", "2", "--",
                             sys.executable, "-c", "import time; time.sleep(600)")
    hog = int(out)
    assert "warning" not in err
    _wait("the first job running", lambda: stack["client"].get_job(hog)["state"] == "RUNNING")
    follower, follower_err = _follower(stack, tmp_path, "second", "job", "submit", "-g", "1",
                                       "-f", "--", sys.executable, "-c", "print('ran')")
    try:
        _wait("the second job's reason",
              lambda: "is queued: waiting for 1 free GPU on one node" in follower_err.read_text())
        run_cli(stack, "job", "cancel", str(hog))
        assert follower.wait(60) == cli.EXIT_OK
    finally:
        if follower.poll() is None:
            follower.kill()
    text = follower_err.read_text()
    assert re.search(r"job \d+ started on " + stack["node"], text), text
    assert (tmp_path / "second.out").read_text().splitlines()[1:] == ["ran"]


def test_why_a_job_failed_is_shown_wherever_a_human_looks(stack, tmp_path):
    # Issue 9 item 3: a dispatch failure's message in job show, logs and logs -f.
    missing = tmp_path / "no-such-dir"
    code, out, err = run_cli(stack, "job", "submit", "--cpu-only", "-d", str(missing), "-f",
                             "--", "true")
    assert code == cli.EXIT_FAILED
    assert "DISPATCH_FAILED" in err and "working dir does not exist" in err
    job_id = int(out.splitlines()[0])
    code, out, _ = run_cli(stack, "job", "show", str(job_id))
    assert re.search(r"why\s+working dir does not exist on this host: " + re.escape(str(missing)),
                     out), out
    code, _, err = run_cli(stack, "logs", str(job_id))
    assert code == 0 and "DISPATCH_FAILED" in err and "working dir does not exist" in err
    code, _, err = run_cli(stack, "logs", "-f", str(job_id))
    assert code == cli.EXIT_FAILED and "working dir does not exist" in err


def test_run_show_accepts_a_job(stack, tmp_path):
    # Issue 9 item 11: run ids are not job ids; `run show --job` and `job:ID` find the run.
    c = stack["client"]
    c.create_run(project="offset")           # so run ids and job ids differ
    code, out, _ = run_cli(stack, "job", "submit", "--cpu-only", "-d", str(tmp_path), "-f",
                           "--", sys.executable, "-c", "print(1)")
    job_id = int(out.splitlines()[0])
    run_id = c.get_job(job_id)["run_id"]
    assert run_id != job_id
    for argv in (["--job", str(job_id)], [f"job:{job_id}"]):
        code, out, err = run_cli(stack, "run", "show", *argv, "--json")
        assert code == 0, err
        assert json.loads(out)["run"]["id"] == run_id
    code, _, err = run_cli(stack, "run", "show")
    assert code == cli.EXIT_USAGE and "--job ID" in err


def test_up_on_another_port_than_server_toml_hands_jobs_the_real_address(tmp_path):
    """Issue 9 items 16, 17 and 1/4: `up --port P` on a home whose server.toml names
    another port: jobs get P in GPUCTL_SERVER, the hints name the address, and a host
    without an NVIDIA driver gets pretend GPUs, said on the terminal."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "server.toml").write_text(f"port = {free_port()}\n")
    port = free_port()
    out_path = tmp_path / "up.out"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuplane", "--home", str(home), "up", "--port", str(port),
             "--name", "portnode"], env=_env(), stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=sigint_as_at_a_terminal)
    try:
        _wait("`up` to be ready", lambda: proc.poll() is not None
              or "Press Ctrl-C" in out_path.read_text(), 60)
        text = out_path.read_text()
        assert proc.poll() is None, text
        url = f"http://127.0.0.1:{port}"
        # The CLI follows the server `up` started (issue 36): only --home to add.
        assert f"gpuplane --home {home} token show-admin" in text
        from agent import GpuProbe   # what the agent itself would find
        if not GpuProbe(0).nvml:
            assert "NOTE: " in text and "pretends this host has 2 GPUs" in text
            assert "--fake-gpus 0" in text and "node portnode: 2 GPUs (fake)" in text
        token = config.load_server_config(home)["admin_token"]
        c = client.Client(url, token)
        job = c.submit_job("echo $GPUCTL_SERVER", str(tmp_path), cpu_only=True)
        _wait("the job", lambda: c.get_job(job["id"])["state"] == "SUCCEEDED")
        assert [ln["text"] for ln in c.get_job_logs(job["id"])["lines"]] == [url]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == cli.EXIT_INTERRUPTED      # Ctrl-C: 130, as documented
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_run_show_judges_results_not_counters_and_shows_a_curve_once(live_server, capsys,
                                                                      monkeypatch):
    # Issue 9 item 15.
    c = client.Client(live_server.url, live_server.token)
    run = c.create_run(project="noise")["id"]
    keys = ["epoch", "lr", "train/loss", "tb/train/loss", "val/acc"]
    pts = [[i, s, v, 0] for s in range(40) for i, v in enumerate(
        [s // 10, 0.1 * 0.9 ** s, 1 / (s + 1), 1 / (s + 1), s / 40])]
    c.log_run_metrics(run, keys, pts)
    summary = {k["key"]: k for k in c.list_run_metrics(run)}
    assert summary["epoch"]["judged"] is False and summary["epoch"]["direction"] is None
    assert summary["epoch"]["trend"] is None and summary["lr"]["trend"] is None
    assert summary["train/loss"]["direction"] == "min"
    assert summary["train/loss"]["trend"] == "improving"
    assert summary["tb/train/loss"]["duplicate_of"] == "train/loss"
    assert "duplicate_of" not in summary["train/loss"]

    monkeypatch.setenv("GPUCTL_TOKEN", live_server.token)
    assert cli.main(["--server", live_server.url, "run", "show", str(run)]) == 0
    out, err = capsys.readouterr()
    table = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert "tb/train/loss" not in table and "train/loss" in table
    assert table["epoch"][3:5] == ["-", "-"]          # no goal, no trend
    assert "tb/train/loss (the same curve as train/loss" in err and "--all" in err
    assert cli.main(["--server", live_server.url, "run", "show", str(run), "--all"]) == 0
    assert "tb/train/loss" in capsys.readouterr().out


def test_the_api_root_says_where_to_start(live_server):
    # Issue 9 item 17: /api/v1/ itself was a 404.
    import requests
    r = requests.get(live_server.url + "/api/v1/", timeout=10)
    assert r.status_code == 200
    assert r.json()["routes"].startswith("/api/v1/routes") and "Bearer" in r.json()["auth"]


def test_doctor_checks_everything_and_names_fixes(stack, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GPUCTL_TOKEN", stack["token"])
    code = cli.main(["--server", stack["url"], "--home", str(tmp_path), "doctor"])
    out = capsys.readouterr().out
    assert code == 0, out
    for check in ("client", "disk", "this host", "server", "token", f"agent {stack['node']}"):
        assert re.search(rf"^(ok  |    )  {re.escape(check)}\s", out, re.M), (check, out)
    assert "scope admin" in out and "2 GPUs (pretend (--fake-gpus))" in out
    # A bad token: FAIL with the fix, exit 1.
    monkeypatch.setenv("GPUCTL_TOKEN", "wrong")
    code = cli.main(["--server", stack["url"], "--home", str(tmp_path), "doctor", "--json"])
    checks = {c["check"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert code == cli.EXIT_ERROR and checks["token"]["ok"] is False
    assert "GPUCTL_TOKEN" in checks["token"]["fix"]
    # No server: FAIL with how to start one.
    url = f"http://127.0.0.1:{free_port()}"
    assert cli.main(["--server", url, "--home", str(tmp_path), "doctor"]) == cli.EXIT_ERROR
    out = capsys.readouterr().out
    assert re.search(r"^FAIL  server", out, re.M) and "fix: start one with `gpuplane up`" in out


COMPLETE = r'''
eval "$(gpuplane completion bash)"
t() { COMP_WORDS=("$@"); COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 )); COMPREPLY=();
      _gpuplane_complete; echo "${COMPREPLY[*]}"; }
t gpuplane jo
t gpuplane job su
t gpuplane job list --st
t gpuplane job list --state ""
t gpuplane --server x token create --scope a
t gpuplane job submit -- pyth
'''


def test_bash_completion_is_generated_from_the_parser(tmp_path):
    env = dict(_env(), PATH=os.pathsep.join([str(pathlib.Path(sys.executable).parent),
                                             os.environ["PATH"]]))
    proc = subprocess.run(["bash", "-c", COMPLETE], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "job", "submit", "--state", "QUEUED DISPATCHED RUNNING SUCCEEDED FAILED CANCELLED",
        "admin agent", ""]
    zsh = subprocess.run([sys.executable, "-m", "gpuplane", "completion", "zsh"], env=env,
                         capture_output=True, text=True, timeout=60).stdout
    assert zsh.startswith("#compdef gpuplane gpuctl") and "'gpuplane job' " in zsh
    if shutil.which("zsh"):
        assert subprocess.run(["zsh", "-n"], input=zsh, text=True).returncode == 0


def test_job_output_cannot_drive_the_terminal():
    # Issue 10 item 14: control characters and escape sequences are removed from job
    # output; colour (SGR) only with --color.
    from gpuplane.cli.common import clean_line
    nasty = ("\x1b]0;pwned title\x07\x1b[2J\x1b[H\x1b[31mred\x1b[0m done\r\x08\x07"
             "\x1b]52;c;ZXZpbA==\x07\x9b31mx\x1bPqdcs\x1b\\")
    assert clean_line(nasty) == "red donex" + "qdcs"
    kept = clean_line(nasty, colour=True)
    assert "\x1b[31mred\x1b[0m" in kept and "\x1b]" not in kept and "\x1b[2J" not in kept
    assert "\x07" not in kept and "\r" not in kept
    assert clean_line("plain\ttabs stay") == "plain\ttabs stay"


def test_logs_strip_control_characters_unless_colour_is_asked(stack, tmp_path):
    code, out, _ = run_cli(stack, "job", "submit", "--cpu-only", "-d", str(tmp_path), "-f",
                           "--", sys.executable, "-c",
                           r"print('\x1b[2J\x1b]0;title\x07\x1b[32mgreen\x1b[0m ok')")
    assert code == 0
    assert out.splitlines()[1] == "green ok"
    job_id = out.splitlines()[0]
    code, out, _ = run_cli(stack, "logs", job_id)
    assert out == "green ok\n"
    code, out, _ = run_cli(stack, "logs", "--color", job_id)
    assert out == "\x1b[32mgreen\x1b[0m ok\n"


def test_gpuctl_names_itself_in_usage_errors():
    # Issue 9 item 17: `gpuctl` errors said "gpuplane: error".
    gpuctl = pathlib.Path(sys.executable).parent / "gpuctl"
    assert gpuctl.exists(), "`make install` installs the gpuctl console script (pyproject.toml)"
    proc = subprocess.run([str(gpuctl), "job", "show", "x"], capture_output=True, text=True,
                          timeout=60, env=_env())
    assert proc.returncode == cli.EXIT_USAGE and "gpuctl job show: error" in proc.stderr


def test_up_says_what_it_waits_for_when_it_takes_a_while(monkeypatch, capsys):
    # Every long wait in the CLI says what it waits for; `up`'s waits after 2 s.
    from gpuplane.cli import up
    clock = iter(range(0, 1000))                 # one second per look at the clock
    monkeypatch.setattr(up.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(up.time, "sleep", lambda s: None)
    answers = iter([None, None, None, None, "ready"])
    assert up._wait_for("node 'x' to connect", lambda: next(answers), [], 60) == "ready"
    err = capsys.readouterr().err
    assert err.count("waiting for node 'x' to connect (up to 60s)...") == 1
    with pytest.raises(cli.CliError, match="gave up waiting for the server after 5s"):
        up._wait_for("the server", lambda: None, [], 5)


def test_job_wait_exit_codes_say_how_the_jobs_ended(stack, tmp_path):
    """`job wait ID...`: 0 all SUCCEEDED, 5 one FAILED, 3 one CANCELLED, 124 the timeout,
    --any returns at the first end; the agent has 4 CPU slots, so all three run at once."""
    def submit(*cmd):
        code, out, err = run_cli(stack, "job", "submit", "--cpu-only", "-d", str(tmp_path),
                                 "--", *cmd)
        assert code == 0, err
        return out.split()[0]
    ok = submit("true")
    bad = submit(sys.executable, "-c", "raise SystemExit(3)")
    slow = submit("sleep", "120")
    code, out, err = run_cli(stack, "job", "wait", ok, bad)
    assert code == cli.EXIT_FAILED, (out, err)
    assert f"job {ok} SUCCEEDED" in out and f"job {bad} FAILED" in out
    assert run_cli(stack, "job", "wait", ok)[0] == cli.EXIT_OK
    code, out, err = run_cli(stack, "job", "wait", slow, "--timeout", "0.5")
    assert code == 124 and f"job {slow}" in err, (out, err)
    code, out, _ = run_cli(stack, "job", "wait", slow, ok, "--any", "--json")
    assert code == cli.EXIT_OK and {j["id"] for j in json.loads(out)} == {int(slow), int(ok)}
    assert run_cli(stack, "job", "cancel", slow)[0] == 0
    code, out, _ = run_cli(stack, "job", "wait", ok, slow, "--timeout", "60")
    assert code == cli.EXIT_CANCELLED, out
    code, out, err = run_cli(stack, "job", "wait", ok, "999")
    assert code == cli.EXIT_ERROR and "999" in err
