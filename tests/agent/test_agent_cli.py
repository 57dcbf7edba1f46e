"""The command line: `python agent.py` with its settings, agent.toml and signals.

Nothing here waits with sleep(): every wait polls a condition with a deadline.
"""
import os
import signal
import subprocess


from agentutil import PY, ROOT, run_cli


def test_bad_setting_is_named(tmp_path):
    (tmp_path / "agent.toml").write_text('server = "http://x"\ntoken = "t"\n'
                                         'backlog_mb = "lots"\n')
    r = run_cli(["--home", str(tmp_path)], tmp_path)
    assert r.returncode == 2 and "backlog_mb = 'lots' is not a number" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_missing_server_and_token(tmp_path):
    r = run_cli([], tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "--server and --token missing" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_reads_agent_toml_and_stops_on_sigterm(tmp_path, server):
    home = tmp_path / "home"
    home.mkdir()
    (home / "agent.toml").write_text(
        f'server = "{server.url}"\ntoken = "{server.token}"\nname = "tomlbox"\n'
        f'fake_gpus = 2\nheartbeat_s = 0.5\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
    env["GPUCTL_HOME"] = str(home)
    p = subprocess.Popen([PY, os.path.join(ROOT, "agent.py")], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        server.wait_for(lambda: server.syncs, what="agent from agent.toml")
        assert server.hellos[0]["node"] == "tomlbox" and len(server.hellos[0]["gpus"]) == 2
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
        assert p.returncode == 0, out
        assert "Traceback" not in out
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
