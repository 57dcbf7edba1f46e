"""The network between agent and server goes away for N seconds while a job logs, then
comes back. A TCP proxy on loopback stands between them and stops forwarding.

Pass: zero lines lost or doubled; the server shows the node disconnected within a few
heartbeats and connected again after the heal; the job is not declared lost (the cut is
shorter than node_grace_s) and runs once, to the end.
"""
import time


from .helpers import (AgentTarget, Proxy, check_lines, log_rows, long_mode, report, ro, starts,
                      stream_command, wait_for)

HEARTBEAT_S = 1


def pytest_generate_tests(metafunc):
    if "mode" in metafunc.fixturenames:
        modes = ["blackhole", "reset"] if long_mode(metafunc.config) else ["blackhole"]
        metafunc.parametrize("mode", modes)


def test_network_cut_and_heal(mode, server_factory, agent_factory, tmp_path, faults_long):
    cut_s = 60.0 if faults_long else 10.0
    lines = 6_000 if faults_long else 3_000
    duration = cut_s + 5
    server = server_factory({"log_keep_lines": 10_000_000, "heartbeat_s": HEARTBEAT_S,
                             "node_grace_s": cut_s + 60})
    proxy = Proxy(server.port)
    try:
        agent = agent_factory(AgentTarget(server, proxy.url), name="behind-proxy",
                              fake_gpus=1)
        api = server.api
        job = api.submit(stream_command(tmp_path, lines, duration=duration), tmp_path, gpus=1)
        wait_for(lambda: len(log_rows(server, job["id"])) > 100, 30, what="lines flowing")

        proxy.cut(mode)
        cut_began, cut_wall_ms = time.monotonic(), time.time() * 1000
        wait_for(lambda: agent.node()["state"] == "disconnected", 6 * HEARTBEAT_S + 5,
                 interval=0.1, what="the node shown disconnected")
        with ro(server) as c:
            down_ms = c.execute("SELECT disconnected_at FROM nodes WHERE name = ?",
                                ("behind-proxy",)).fetchone()[0]
        seen_down = (down_ms - cut_wall_ms) / 1000
        during = api.job(job["id"])
        wait_for(lambda: time.monotonic() - cut_began >= cut_s, cut_s + 1, interval=0.2,
                 what="the end of the cut")
        still = api.job(job["id"])
        proxy.heal()
        healed = time.monotonic()
        agent.wait_connected(timeout=60)
        back_after = time.monotonic() - healed

        j = api.wait_job(job["id"], timeout=duration + 120)
        stored, lost, doubled, disorder, gaps = check_lines(log_rows(server, job["id"]), lines)
        report(f"network-cut-{mode}", cut_s=cut_s, heartbeat_s=HEARTBEAT_S,
               disconnected_after_s=round(seen_down, 2), reconnected_after_heal_s=round(back_after, 1),
               lines_sent=lines, lines_stored=stored, lines_lost=lost, lines_doubled=doubled,
               job=j["state"], attempt=j["attempt"], starts=len(starts(tmp_path)),
               proxy_connections=proxy.connections)
    finally:
        proxy.close()

    assert during["state"] == "RUNNING" and still["state"] == "RUNNING", (during, still)
    assert j["state"] == "SUCCEEDED" and j["attempt"] == 1 and j["exit_code"] == 0, j
    assert len(starts(tmp_path)) == 1
    assert (stored, lost, doubled, disorder, gaps) == (lines, 0, 0, 0, False)
