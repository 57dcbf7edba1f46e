"""The spool across processes: replay after a restart without duplicates, the atexit flush,
and an unwritable spool that must not break anything."""

import json
import os
import subprocess
import sys
import textwrap
import threading

from sdkutil import TOKEN, sdk_env, wait_for

LOGGER = textwrap.dedent("""
    import sys
    from gpuctl import run, sender
    sender.RETRY_MIN_S = sender.RETRY_MAX_S = 0.05
    mode = sys.argv[1]
    run_id = run.init(project="restart", experiment="e", name="first", config={"seed": 1})
    for i in range(int(sys.argv[2])):
        run.log({"loss": 1.0 / (i + 1), "acc": i / 10.0})
        if i == 1234:
            run.log_checkpoint("ckpt-1234.pt")
            run.log_event("halfway", {"i": i})
    print(run.summary()["mode"], run.summary()["run_id"], flush=True)
    if mode == "finish":
        run.finish()
    # otherwise exit without flush or finish: atexit must do it
""")


def _run_logger(tmp_path, home, server, mode, n):
    script = tmp_path / "logger.py"
    script.write_text(LOGGER)
    env = sdk_env(home, GPUCTL_SERVER=server.url, GPUCTL_TOKEN=TOKEN)
    out = subprocess.run([sys.executable, str(script), mode, str(n)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # the SDK raised nothing, and said at most once that the server did not answer
    lines = out.stderr.splitlines()
    assert lines == [] or (len(lines) == 1 and lines[0].startswith("gpuctl: logging locally")
                           and server.mode != "good"), out.stderr
    return out.stdout.split()


def _spools(home):
    d = home / "spool"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_spool_of_a_dead_process_is_replayed_once_by_the_next(sdk, server, tmp_path):
    home = tmp_path / "home"
    server.mode = "503"
    mode, local_id = _run_logger(tmp_path, home, server, "exit", 3000)
    assert mode == "local" and local_id.startswith("local-")
    assert _spools(home) == ["sdk-%s.jsonl" % local_id]
    assert server.applied == []

    server.mode = "good"
    run_id = sdk.init(project="second", server=server.url, token=TOKEN)
    replayed = wait_for(lambda: [r for r, b in server.runs.items() if b["project"] == "restart"],
                        what="the left-behind run to be registered")
    assert len(replayed) == 1
    r = replayed[0]
    assert server.runs[r] == {"project": "restart", "experiment": "e", "name": "first",
                              "config": {"seed": 1}, "source": "sdk"}
    expected = {(k, i) for i in range(3000) for k in ("loss", "acc")}
    wait_for(lambda: server.identities(r) == expected, what="the replayed points")
    wait_for(lambda: _spools(home) == [], what="the replayed spool to go")
    assert server.identities(run_id) == set()  # nothing leaked into the new run
    ck = [b for p, b in server.posts("/checkpoints") if p.startswith("/api/v1/runs/%d/" % r)]
    assert len(ck) == 1 and ck[0]["path"] == str(tmp_path / "ckpt-1234.pt")
    assert ck[0]["abs_path"] == str(tmp_path / "ckpt-1234.pt")
    # Issue 9 item 6: the process exited without finish(): the replay ends the run as
    # FAILED, after an event saying where it stopped.
    events = [b for p, b in server.posts("/events")]
    assert [e["name"] for e in events] == ["halfway", "exited_without_finish"]
    assert events[1]["data"] == {"last_step": 2999}
    assert [b for p, b in server.posts("/finish") if "/runs/%d/" % r in p] == \
        [{"status": "FAILED", "reason": "the process ended without run.finish()"}]
    # no point was sent twice, and a third process finds nothing to replay
    assert len(server.applied) == len(expected)
    sdk.finish()
    before = len(server.requests)
    _run_logger(tmp_path, home, server, "finish", 1)
    assert len(server.runs) == 3
    assert all("/runs/%d/" % r not in p for p, _, _ in server.requests[before:])


def test_interrupted_replay_resumes_where_it_stopped(sdk, server, tmp_path):
    home = tmp_path / "home"
    server.mode = "503"
    _, local_id = _run_logger(tmp_path, home, server, "exit", 5000)
    server.mode = "good"
    seen = len(server.requests)

    def fail_after_three_requests():
        # the replay registers the run and gets two records in, then the server fails
        wait_for(lambda: len(server.requests) >= seen + 3, what="three replay requests")
        server.mode = "503"

    t = threading.Thread(target=fail_after_three_requests)
    t.start()
    sdk.init(project="second", server=server.url, token=TOKEN)
    t.join()
    assert sdk.flush(5)
    server.mode = "good"
    r = wait_for(lambda: [r for r, b in server.runs.items() if b["project"] == "restart"],
                 what="registration")[0]
    expected = {(k, i) for i in range(5000) for k in ("loss", "acc")}
    wait_for(lambda: server.identities(r) == expected, what="all points after the retry")
    assert [r for r, b in server.runs.items() if b["project"] == "restart"] == [r]
    wait_for(lambda: _spools(home) == [], what="the spool to go")
    # each event once (the run's own, and the one its exit without finish() left), and
    # acknowledged records were not resent
    # (an event the server failed with 503 is retried: only the accepted ones count)
    names = sorted(b["name"] for _, b in server.accepted_posts("/events"))
    assert names == ["exited_without_finish", "halfway"]
    assert len(server.applied) == len(expected)


def test_atexit_flush_sends_what_was_logged(server, tmp_path):
    home = tmp_path / "home"
    mode, run_id = _run_logger(tmp_path, home, server, "exit", 1500)
    assert mode == "registered"
    expected = {(k, i) for i in range(1500) for k in ("loss", "acc")}
    assert server.identities(run_id) == expected
    assert _spools(home) == []
    # atexit flushes, and a run whose process ends without finish() is FAILED (issue 9
    # item 6), with an event at the last step
    assert [b for _, b in server.posts("/finish")] == \
        [{"status": "FAILED", "reason": "the process ended without run.finish()"}]
    assert [b["step"] for _, b in server.posts("/events")
            if b["name"] == "exited_without_finish"] == [1499]


def test_unwritable_spool_never_raises(sdk, server, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / "spool").write_text("a file where the spool directory should be")
    assert sdk.init() is None
    for i in range(3000):
        sdk.log({"loss": float(i)})
    sdk.log_checkpoint(tmp_path)
    sdk.flush(2)
    s = sdk.summary()
    assert s["mode"] == "local" and s["spool"] is None and s["errors"] >= 1
    sdk.finish()
    # online, the same unwritable home still lets everything through from memory
    sdk.init(server=server.url, token=TOKEN)
    for i in range(3000):
        sdk.log({"loss": float(i)})
    assert sdk.flush(5)
    assert server.identities(sdk.summary()["run_id"]) == {("loss", i) for i in range(3000)}
    sdk.finish()


def test_spool_of_a_live_process_is_left_alone(sdk, server, tmp_path):
    home = tmp_path / "home"
    script = tmp_path / "live.py"
    script.write_text(textwrap.dedent("""
        import sys
        from gpuctl import run
        run.init(project="live")
        run.log({"loss": 1.0})
        run.flush(5)
        print(run.summary()["spool"], flush=True)
        sys.stdin.readline()  # stay alive, holding the spool, until told
    """))
    p = subprocess.Popen([sys.executable, str(script)], env=sdk_env(home), text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        spool = p.stdout.readline().strip()
        assert os.path.exists(spool)
        sdk.init(server=server.url, token=TOKEN)
        sdk.log({"x": 1.0})
        assert sdk.flush(5)
        assert sdk.flush(5)  # a second tick, after the foreign scan
        assert not any(b.get("project") == "live" for b in server.runs.values())
        assert os.path.exists(spool)
        with open(spool) as f:
            assert json.loads(f.readline())["project"] == "live"
    finally:
        p.communicate("\n", timeout=30)
    assert p.returncode == 0
