"""The connection: the one WebSocket to the server, against the fake server of tests/fake_server.py.

Nothing here waits with sleep(): every wait polls a condition with a deadline.
"""


from agentutil import GATED, PY, make_agent, start_msg, write_script


def test_connection_handshake_replay_and_commands(tmp_path, server):
    home = tmp_path / "home"
    a = make_agent(home, server)
    # records spooled before any connection are replayed after the welcome
    a.outbox.append("event", {"run_id": None, "job_id": None, "type": "AGENT_TEST",
                              "severity": "info", "message": "before connect", "data": {}})
    a.start()
    try:
        server.wait_for(lambda: server.syncs, what="sync")
        hello = server.hellos[0]
        assert hello["node"] == "box" and hello["fake"] is True
        assert hello["gpus"][0]["name"] == "Fake GPU 0" and hello["epoch"] == a.outbox.epoch
        assert server.records()[0]["type"] == "AGENT_TEST"
        assert server.syncs[0] == {"type": "sync", "running": [], "known": []}
        server.wait_for(lambda: server.heartbeats >= 2, what="heartbeats")

        server.send(start_msg(20, [PY, "-c", "print('remote'); raise SystemExit(0)"],
                              tmp_path))
        server.wait_for(lambda: [r for r in server.applied if r["kind"] == "job"
                                 and r["state"] == "EXITED"], what="EXITED at server")
        assert [ln[2] for r in server.records("log") for ln in r["lines"]] == ["remote"]
        seqs = [r["seq"] for r in server.records()]
        assert seqs == list(range(1, len(seqs) + 1))
        server.wait_for(lambda: a.outbox.acked == a.outbox.last_seq, what="all acked")
    finally:
        a.stop()


def test_reconnect_replays_without_loss_or_duplicates(tmp_path, server):
    home = tmp_path / "home"
    write_script(tmp_path / "gated.py", GATED)
    gate = tmp_path / "gate"
    a = make_agent(home, server)
    a.start()
    try:
        server.send(start_msg(21, [PY, "gated.py", str(gate)], tmp_path))
        server.wait_for(lambda: sum(len(r["lines"]) for r in server.records("log")) == 5,
                        what="five lines")
        server.ack = False            # batches vanish: the agent must time out and replay
        gate.write_text("go")
        server.wait_for(lambda: any(r["kind"] == "job" and r["state"] == "EXITED"
                                    for r in server.swallowed), what="EXITED sent, lost")
        assert a.outbox.last_seq > server.cursor
        server.drop()                 # so the replay can only come on a new connection
        server.ack = True
        server.wait_for(lambda: [r for r in server.applied if r["kind"] == "job"
                                 and r["state"] == "EXITED"], what="EXITED after replay")
        lines = [ln for r in server.records("log") for ln in r["lines"]]
        assert [ln[0] for ln in lines] == list(range(1, 11))
        seqs = [r["seq"] for r in server.records()]
        assert seqs == list(range(1, len(seqs) + 1))
        assert len(server.hellos) >= 2
        # the second sync follows the ack of the replayed EXITED record
        server.wait_for(lambda: len(server.syncs) >= 2, what="sync after the reconnect")
        assert server.syncs[-1]["known"] == [[21, 1]]
    finally:
        a.stop()


def test_agent_restart_over_same_home_keeps_epoch_and_cursor(tmp_path, server):
    home = tmp_path / "home"
    a = make_agent(home, server)
    a.start()
    server.send(start_msg(22, "echo one", tmp_path))
    server.wait_for(lambda: server.records("job") and
                    server.records("job")[-1]["state"] == "EXITED", what="first job")
    server.wait_for(lambda: a.outbox.acked == a.outbox.last_seq, what="acked")
    a.stop()
    b = make_agent(home, server)
    assert b.outbox.epoch == a.outbox.epoch
    b.start()
    try:
        server.send(start_msg(22, "echo one", tmp_path))   # a repeated start: re-report only
        server.send(start_msg(23, "echo two", tmp_path))
        server.wait_for(lambda: [r for r in server.records("job") if r["job_id"] == 23
                                 and r["state"] == "EXITED"], what="second job")
        seqs = [r["seq"] for r in server.records()]
        assert seqs == list(range(1, len(seqs) + 1))
        texts = [ln[2] for r in server.records("log") for ln in r["lines"]]
        assert texts == ["one", "two"]
        assert len(server.hellos) == 2 and server.hellos[1]["epoch"] == server.hellos[0]["epoch"]
    finally:
        b.stop()


def test_bad_token_is_retried_until_it_works(tmp_path, server):
    a = make_agent(tmp_path / "home", server, token="wrong")
    a.start()
    try:
        server.wait_for(lambda: server.rejected >= 2, what="rejections with backoff")
        assert not server.hellos
        a.config.token = server.token      # the operator fixes it; no restart needed
        server.wait_for(lambda: server.syncs, timeout=30, what="connected")
    finally:
        a.stop()


def test_server_cursor_behind_acked_starts_a_new_epoch(tmp_path, server):
    home = tmp_path / "home"
    a = make_agent(home, server)
    for i in range(3):
        a.outbox.append("event", {"run_id": None, "job_id": None, "type": f"E{i}",
                                  "severity": "info", "message": "", "data": {}})
    a.start()
    server.wait_for(lambda: server.syncs, what="first sync")
    server.wait_for(lambda: a.outbox.acked == 3, what="acked")
    a.stop()
    old_epoch = a.outbox.epoch
    with server.lock:                 # the server's database was restored from a backup
        server.cursor = 1
    b = make_agent(home, server)
    b.outbox.append("event", {"run_id": None, "job_id": None, "type": "AFTER",
                              "severity": "info", "message": "", "data": {}})
    b.start()
    try:
        server.wait_for(lambda: len(server.syncs) >= 2, what="sync after new epoch")
        assert b.outbox.epoch != old_epoch and server.epoch == b.outbox.epoch
        assert server.records()[-1]["type"] == "AFTER" and server.records()[-1]["seq"] == 1
    finally:
        b.stop()
