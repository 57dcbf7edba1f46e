"""Time limits, warning signals and project defaults as a user gives them
(gpuplane/timelimit.py, the submit routes, `project defaults`; docs/scheduling.md)."""
import sqlite3

import pytest

from gpuplane import timelimit
from gpuplane.db import MIGRATIONS, Database


@pytest.mark.parametrize("text, seconds", [
    ("2h", 7200), ("90m", 5400), ("45s", 45), ("1h30m", 5400), ("1d", 86400),
    ("1:30:00", 5400), ("30:00", 1800), ("90", 5400), ("2-00:00:00", 172800),
    ("2-12", 216000), ("1.5h", 5400), (30, 30), (" 2H ", 7200),
])
def test_durations_read_as_a_user_writes_them(text, seconds):
    assert timelimit.parse(text) == seconds


@pytest.mark.parametrize("text, says", [
    ("0", "more than zero"), ("0m", "more than zero"), (0, "more than zero"),
    ("soon", "does not read"), ("2x", "does not read"), ("", "empty"),
    ("400d", "more than a year"), (True, "must be a duration"), (-5, "more than zero"),
])
def test_bad_durations_name_the_fix(text, says):
    with pytest.raises(timelimit.LimitError, match=says) as e:
        timelimit.parse(text)
    assert "2h" in str(e.value) or "year" in str(e.value) or "zero" in str(e.value)


def test_signals_and_their_lead():
    assert timelimit.parse_signal("USR1@60", 5) == ("USR1", 60)
    assert timelimit.parse_signal("sigusr2", 5) == ("USR2", 5)
    for bad in ("KILL", "STOP@10", "USR1@soon", ""):
        with pytest.raises(timelimit.LimitError):
            timelimit.parse_signal(bad, 5)
    # the server's lead is at most half a short limit; a job's own lead stands
    assert timelimit.warning_signal({"time_limit_s": 10}, "USR1@60") == ["USR1", 5]
    assert timelimit.warning_signal({"time_limit_s": 10, "time_signal": "USR2@8"},
                                    "USR1@60") == ["USR2", 8]
    assert timelimit.warning_signal({"time_limit_s": 3600, "time_signal": "TERM"},
                                    "USR1@60") == ["TERM", 60]
    assert timelimit.describe(5400) == "1h30m" and timelimit.minutes(61) == 2


def test_a_v16_database_carries_its_minute_limits_over_as_seconds(tmp_path):
    path = tmp_path / "v16.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript("BEGIN;\n" + "\n".join(MIGRATIONS[:16])
                       + "\nPRAGMA user_version=16;\nCOMMIT;")
    conn.execute("INSERT INTO jobs (name, command, working_dir, created_at, queued_at,"
                 " time_limit_min) VALUES ('a', '[\"true\"]', '/w', 1, 1, 90),"
                 " ('b', '[\"true\"]', '/w', 1, 1, NULL)")
    conn.execute("INSERT INTO projects (name, created_at) VALUES ('p', 1)")
    conn.close()
    db = Database(path)
    assert [tuple(r) for r in db.query(
        "SELECT name, time_limit_s, preemptible, preempted_by FROM jobs ORDER BY id")] == \
        [("a", 5400, 0, None), ("b", None, 0, None)]
    assert tuple(db.query_one("SELECT time_limit_s, max_time_limit_s, preemptible FROM "
                              "projects")) == (None, None, None)


def test_submit_takes_a_limit_in_any_form_and_refuses_bad_ones(live_server, tmp_path):
    api = live_server.api
    for body, seconds in (({"time_limit": "2h"}, 7200), ({"time_limit": "1:30:00"}, 5400),
                          ({"time_limit": 90}, 90), ({"time_limit_s": 600}, 600),
                          ({"time_limit_min": 3}, 180), ({}, None)):
        job = api.submit(["true"], tmp_path, cpu_only=True, **body)
        assert job["time_limit_s"] == seconds, body
        assert job["time_limit_min"] == (None if seconds is None else -(-seconds // 60))
    shown = api.job(api.submit(["true"], tmp_path, cpu_only=True, time_limit="10s",
                               time_signal="USR2")["id"])
    assert shown["time_signal"] == "USR2" and shown["warning_signal"] == ["USR2", 5]
    for body, says in (({"time_limit": "0"}, "more than zero"),
                       ({"time_limit": "soon"}, "does not read as a duration"),
                       ({"time_limit": "2h", "time_limit_s": 5}, "give one time limit"),
                       ({"time_limit_s": "5"}, "whole number"),
                       ({"time_signal": "KILL"}, "cannot warn a job"),
                       ({"preemptible": "yes"}, "true or false")):
        r = api.post("/api/v1/jobs", {"command": ["true"], "working_dir": str(tmp_path),
                                      "cpu_only": True, **body})
        assert api.last.status_code == 400, body
        assert says in r["error"]["message"], (body, r)


def test_project_defaults_fill_in_and_cap_its_jobs_limits(live_server, tmp_path):
    api = live_server.api
    api.post("/api/v1/projects", {"name": "lab"}, expect=201)
    p = api.request("PATCH", "/api/v1/projects/lab", expect=200,
                    json={"time_limit": "1h", "max_time_limit": "4h", "preemptible": True})
    assert (p["time_limit_s"], p["max_time_limit_s"], p["preemptible"]) == (3600, 14400, True)
    job = api.submit(["true"], tmp_path, cpu_only=True, project="lab")
    assert job["time_limit_s"] == 3600 and job["preemptible"] is True
    job = api.submit(["true"], tmp_path, cpu_only=True, project="lab", time_limit="3h",
                     preemptible=False)
    assert job["time_limit_s"] == 10800 and job["preemptible"] is False
    r = api.post("/api/v1/jobs", {"command": ["true"], "working_dir": str(tmp_path),
                                  "cpu_only": True, "project": "lab", "time_limit": "5h"})
    assert api.last.status_code == 400
    assert "above the maximum of project 'lab' (4h)" in r["error"]["message"]
    assert "--max-time" in r["error"]["message"]
    r = api.request("PATCH", "/api/v1/projects/lab", json={"time_limit": "6h"})
    assert api.last.status_code == 400 and "above its maximum" in r["error"]["message"]
    # without a default, the maximum is the limit; cleared, none
    api.request("PATCH", "/api/v1/projects/lab", json={"time_limit": None}, expect=200)
    assert api.submit(["true"], tmp_path, cpu_only=True, project="lab")["time_limit_s"] == 14400
    api.request("PATCH", "/api/v1/projects/lab", json={"max_time_limit": None}, expect=200)
    assert api.submit(["true"], tmp_path, cpu_only=True, project="lab")["time_limit_s"] is None
    # a job of another project has none of it
    other = api.submit(["true"], tmp_path, cpu_only=True)
    assert other["time_limit_s"] is None and other["preemptible"] is False


def test_sweep_trials_are_preemptible_and_limited_unless_told(live_server, tmp_path):
    api = live_server.api
    sweep = api.post("/api/v1/sweeps", {"command": "echo {x}", "working_dir": str(tmp_path),
                                        "parameters": {"x": [1, 2]}, "cpu_only": True,
                                        "time_limit": "20m"}, expect=201)
    assert sweep["job"]["preemptible"] is True
    assert sweep["job"]["time_limit_s"] == 1200
    off = api.post("/api/v1/sweeps", {"command": "echo {x}", "working_dir": str(tmp_path),
                                      "parameters": {"x": [1]}, "cpu_only": True,
                                      "preemptible": False}, expect=201)
    assert off["job"]["preemptible"] is False
    api.post("/api/v1/projects", {"name": "capped"}, expect=201)
    api.request("PATCH", "/api/v1/projects/capped", json={"max_time_limit": "10m"},
                expect=200)
    r = api.post("/api/v1/sweeps", {"command": "echo {x}", "working_dir": str(tmp_path),
                                    "parameters": {"x": [1]}, "cpu_only": True,
                                    "project": "capped", "time_limit": "1h"})
    assert api.last.status_code == 400 and "(10m)" in r["error"]["message"]


def test_the_cli_sends_time_and_preemptible_and_sets_project_defaults(live_server, tmp_path):
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "gpuplane", "--server", live_server.url,
                               "--token", live_server.token, *args],
                              capture_output=True, text=True, timeout=60)
    out = cli("project", "create", "cli-lab")
    assert out.returncode == 0, out.stderr
    out = cli("project", "defaults", "cli-lab", "--time", "30m", "--max-time", "2h",
              "--preemptible")
    assert out.returncode == 0, out.stderr
    assert "time limit 30m, at most 2h, preemptible" in out.stdout
    out = cli("job", "submit", "--cpu-only", "--project", "cli-lab", "--time", "1:30:00",
              "--signal", "USR2@30", "--no-preemptible", "-d", str(tmp_path), "--", "true")
    assert out.returncode == 0, out.stderr
    job = live_server.api.job(int(out.stdout.split()[0]))
    assert (job["time_limit_s"], job["time_signal"], job["preemptible"]) == \
        (5400, "USR2@30", False)
    shown = cli("job", "show", str(job["id"]))
    assert "1h30m (SIGUSR2 30 s before)" in shown.stdout
    out = cli("job", "submit", "--cpu-only", "--time", "0", "--", "true")
    assert out.returncode == 2 and "more than zero" in out.stderr


def test_a_job_past_its_limit_is_warned_then_ends_timeout(live_server, agent, tmp_path):
    """A real agent: SIGUSR1 `lead` seconds before the limit (the job saves and logs it),
    then the stop; the job ends FAILED with kind TIMEOUT and is not retried."""
    import sys
    from procs import wait_for
    (tmp_path / "t.py").write_text(
        "import signal, time\n"
        "signal.signal(signal.SIGUSR1, lambda *a: print('SIGUSR1: checkpoint saved', "
        "flush=True))\n"
        "time.sleep(120)\n")
    api = live_server.api
    job = api.post("/api/v1/jobs", {"command": [sys.executable, "t.py"], "cpu_only": True,
                                    "working_dir": str(tmp_path), "time_limit": "3s",
                                    "time_signal": "USR1@2", "max_attempts": 3},
                   expect=201)
    done = wait_for(lambda: (j := api.job(job["id"]))["state"] in ("SUCCEEDED", "FAILED",
                                                                    "CANCELLED") and j,
                    60, what="the job to reach its limit")
    assert done["state"] == "FAILED" and done["failure_kind"] == "TIMEOUT", done
    assert done["attempt"] == 1                    # a timeout is never retried
    assert "time limit of 3s" in done["message"]
    lines = api.get(f"/api/v1/jobs/{job['id']}/logs")["lines"]
    assert any("SIGUSR1: checkpoint saved" in ln["text"] for ln in lines)
