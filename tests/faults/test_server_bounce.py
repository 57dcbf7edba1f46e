"""The server dies (SIGKILL, or SIGTERM) three times while a job streams log lines through
its agent and metric points through the SDK: nothing is lost, nothing doubled, the job
never notices, and the SQLite file is intact."""
import os
import random
import signal
import time

import pytest

from .helpers import (check_lines, check_points, integrity, log_rows, point_rows, report,
                      sdk_summary, starts, stream_command, wait_for)

SEED = int(os.environ.get("FAULTS_SEED", "1"))


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_server_bounce_loses_and_doubles_nothing(sig, server_factory, agent_factory,
                                                  tmp_path, job_home, faults_long):
    if faults_long:
        lines, steps, keys, duration = 20_000, 25_000, 4, 45.0
    else:
        lines, steps, keys, duration = 3_000, 2_000, 4, 10.0
    rng = random.Random(f"{SEED}-{sig}")
    server = server_factory({"log_keep_lines": 10_000_000})
    agent_factory(server, fake_gpus=1)
    job = server.api.submit(stream_command(tmp_path, lines, steps, keys, duration), tmp_path,
                            gpus=1, env={"GPUCTL_HOME": str(job_home)})
    wait_for(lambda: starts(tmp_path), 30, what="the job started")

    kills, downtime = 0, 0.0
    for _ in range(3):
        time.sleep(rng.uniform(0.2, duration / 4))      # a random moment mid-stream
        began = time.monotonic()
        if sig == "SIGKILL":
            server.kill()
        else:
            server.stop(signal.SIGTERM)
        kills += 1
        server.start()
        downtime += time.monotonic() - began

    j = server.api.wait_job(job["id"], timeout=duration + 240)
    rows = log_rows(server, job["id"])
    stored, lost, doubled, disorder, gaps = check_lines(rows, lines)
    sdk = sdk_summary(rows) or {}
    prows = point_rows(server, [j["run_id"]])
    p_stored, p_lost, p_doubled, p_wrong = check_points(prows, keys, steps)
    server.stop()
    ok = integrity(server)
    report(f"server-bounce-{sig}", seed=SEED, kills=kills, downtime_s=round(downtime, 1),
           lines_sent=lines, lines_stored=stored, lines_lost=lost, lines_doubled=doubled,
           points_sent=steps * keys, points_stored=p_stored, points_lost=p_lost,
           points_doubled=p_doubled, points_wrong=p_wrong, sdk_dropped=sdk.get("dropped"),
           job=j["state"], starts=len(starts(tmp_path)), integrity=ok)

    assert j["state"] == "SUCCEEDED" and j["exit_code"] == 0 and j["attempt"] == 1, j
    assert len(starts(tmp_path)) == 1, "the job was started again"
    assert (stored, lost, doubled, disorder, gaps) == (lines, 0, 0, 0, False)
    assert sdk.get("dropped") == 0 and sdk.get("queued") == 0, sdk
    assert (p_stored, p_lost, p_doubled, p_wrong) == (steps * keys, 0, 0, 0)
    assert ok == "ok"
