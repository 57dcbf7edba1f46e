"""`gpuplane events` and `gpuplane event-hook` as real processes against a real server."""
import json
import os
import subprocess
import sys

import pytest

from procs import ServerProc

HOOK = """#!/bin/sh
# appends one JSON line per event: what the environment and stdin said
python3 -c '
import json, os, sys
ev = json.load(sys.stdin)
env = {k: v for k, v in os.environ.items() if k.startswith("GPUCTL_EVENT_")}
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"env": env, "stdin": ev}) + "\\n")
' "$1"
exit "${HOOK_EXIT:-0}"
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module; each test works in its own run."""
    s = ServerProc(tmp_path_factory.mktemp("hook") / "server").start()
    yield s
    s.stop()


def cli(server, *argv, env=None, timeout=60):
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
    full.update({"GPUCTL_SERVER": server.url, "GPUCTL_TOKEN": server.token,
                 "GPUCTL_HOME": str(server.home.parent / "client-home"), **(env or {})})
    return subprocess.run([sys.executable, "-m", "gpuplane", *argv], capture_output=True,
                          text=True, env=full, timeout=timeout)


def event(server, run, name):
    return server.api.post(f"/api/v1/runs/{run}/events", {"name": name, "step": 5},
                           expect=201)["event_id"]


def test_hook_runs_once_per_event_in_order_and_resumes(server, tmp_path):
    api = server.api
    run = api.post("/api/v1/runs", {"name": "h", "source": "sdk"}, expect=201)["id"]
    script = tmp_path / "hook.sh"
    script.write_text(HOOK)
    script.chmod(0o755)
    out = tmp_path / "seen.jsonl"
    cursor = tmp_path / "cursor"
    ids = [event(server, run, n) for n in ("a", "b")]
    base = ("event-hook", "--run", str(run), "--type", "USER", "--cursor", str(cursor),
            "--once")
    r = cli(server, *base, "--from-start", "--", str(script), str(out))
    assert r.returncode == 0, r.stderr
    seen = [json.loads(x) for x in out.read_text().splitlines()]
    assert [s["stdin"]["id"] for s in seen] == ids
    env = seen[0]["env"]
    assert env["GPUCTL_EVENT_TYPE"] == "USER" and env["GPUCTL_EVENT_MESSAGE"] == "a"
    assert env["GPUCTL_EVENT_SEVERITY"] == "info" and env["GPUCTL_EVENT_RUN_ID"] == str(run)
    assert env["GPUCTL_EVENT_STEP"] == "5" and env["GPUCTL_EVENT_ID"] == str(ids[0])
    assert json.loads(cursor.read_text()) == {"last_id": ids[1]}

    # the server restarts, a new event comes: only that one runs (none missed, none twice)
    server.restart()
    ids.append(event(server, run, "c"))
    r = cli(server, *base, "--", str(script), str(out))
    assert r.returncode == 0, r.stderr
    assert [json.loads(x)["stdin"]["id"] for x in out.read_text().splitlines()] == ids

    # a failing command is reported and the next event still runs
    ids += [event(server, run, "d"), event(server, run, "e")]
    r = cli(server, *base, "--", str(script), str(out), env={"HOOK_EXIT": "3"})
    assert r.returncode == 0
    assert f"exited with 3 on event {ids[3]} (USER)" in r.stderr
    assert f"exited with 3 on event {ids[4]} (USER)" in r.stderr
    assert [json.loads(x)["stdin"]["id"] for x in out.read_text().splitlines()] == ids


def test_hook_missing_not_executable_and_hanging(server, tmp_path):
    api = server.api
    run = api.post("/api/v1/runs", {"name": "h", "source": "sdk"}, expect=201)["id"]
    first = event(server, run, "x")
    base = ("event-hook", "--run", str(run), "--type", "USER", "--from-start", "--once")
    r = cli(server, *base, "--cursor", str(tmp_path / "c1"), "--", str(tmp_path / "nope.sh"))
    assert r.returncode == 0 and "nope.sh does not exist" in r.stderr
    plain = tmp_path / "plain.sh"
    plain.write_text("#!/bin/sh\nexit 0\n")
    r = cli(server, *base, "--cursor", str(tmp_path / "c2"), "--", str(plain))
    assert r.returncode == 0 and "is not executable" in r.stderr and "chmod +x" in r.stderr
    hang = tmp_path / "hang.sh"
    hang.write_text("#!/bin/sh\nsleep 60\n")
    hang.chmod(0o755)
    r = cli(server, *base, "--cursor", str(tmp_path / "c3"), "--timeout", "0.5", "--",
            str(hang))
    assert r.returncode == 0 and f"still ran after 0.5 s on event {first}" in r.stderr
    assert json.loads((tmp_path / "c3").read_text()) == {"last_id": first}


def test_events_command_lists_and_filters(server):
    api = server.api
    run = api.post("/api/v1/runs", {"name": "h", "source": "sdk"}, expect=201)["id"]
    event(server, run, "hello-event")
    r = cli(server, "events", "--run", str(run), "--type", "USER")
    assert r.returncode == 0, r.stderr
    assert "hello-event" in r.stdout and "USER" in r.stdout and "SEVERITY" in r.stdout
    r = cli(server, "events", "--run", str(run), "--severity", "critical", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == []
    r = cli(server, "run", "show", str(run))
    assert r.returncode == 0, r.stderr
    assert f"events (the latest 2; all: gpuplane events --run {run})" in r.stdout
    assert "hello-event" in r.stdout


def test_a_nul_byte_never_stops_the_hook(server, tmp_path):
    """Issue 22: one event whose message held a NUL byte stopped `gpuplane event-hook` for
    good (every restart died on it). The API refuses such text where it enters; one stored
    before (here: written into the file) reaches the hook as U+FFFD, and the next runs."""
    import sqlite3
    api = server.api
    run = api.post("/api/v1/runs", {"name": "h", "source": "sdk"}, expect=201)["id"]
    r = api.post(f"/api/v1/runs/{run}/events", {"name": "a\u0000b"}, expect=400)
    assert "NUL byte" in r["error"]["message"]
    r = api.post(f"/api/v1/runs/{run}/events", {"name": "a\ud800b"}, expect=400)
    assert "surrogate" in r["error"]["message"]
    with sqlite3.connect(server.home / "server" / "gpuctl.db", timeout=30) as c:
        c.execute("INSERT INTO events (run_id, type, severity, message, data, ts) VALUES"
                  " (?, 'USER', 'info', ?, '{}', 1)", (run, "bad\u0000message"))
    after = event(server, run, "after")
    script = tmp_path / "hook.sh"
    script.write_text(HOOK)
    script.chmod(0o755)
    out, cursor = tmp_path / "seen.jsonl", tmp_path / "cursor"
    base = ("event-hook", "--run", str(run), "--type", "USER", "--cursor", str(cursor),
            "--once", "--from-start")
    r = cli(server, *base, "--", str(script), str(out))
    assert r.returncode == 0, r.stderr
    seen = [json.loads(x) for x in out.read_text().splitlines()]
    assert [s["env"]["GPUCTL_EVENT_MESSAGE"] for s in seen] == ["bad\ufffdmessage", "after"]
    assert seen[0]["stdin"]["message"] == "bad\u0000message"    # JSON carries it as it is
    assert json.loads(cursor.read_text()) == {"last_id": after}
    # a hook that cannot run for an event says so, records it beside the cursor, goes on
    r = cli(server, "event-hook", "--run", str(run), "--type", "USER", "--once",
            "--from-start", "--cursor", str(tmp_path / "c2"), "--", str(tmp_path / "nope"))
    assert r.returncode == 0 and "does not exist" in r.stderr
    failed = [json.loads(x) for x in (tmp_path / "c2.failed").read_text().splitlines()]
    assert [f["id"] for f in failed][-1] == after and "does not exist" in failed[0]["why"]
