"""Whatever the server does, the training loop never raises, and once the server is good
again every logged point arrives: the set of (key, step) received is exactly the set
logged, each with the value logged."""

import threading

import pytest

from sdkutil import TOKEN, wait_for


@pytest.mark.parametrize("mode", ["500", "hang", "reset", "garbage", "garbage200", "401"])
def test_bad_server_then_good_server_loses_and_invents_nothing(sdk, server, mode):
    assert sdk.init(server=server.url, token=TOKEN) == "101"
    logged = {}
    for i in range(300):
        sdk.log({"loss": 1.0 / (i + 1)})
        logged[("loss", i)] = 1.0 / (i + 1)
    assert sdk.flush(5)
    server.mode = mode
    for i in range(300, 2300):
        sdk.log({"loss": 1.0 / (i + 1), "lr": 0.1})
        logged[("loss", i)] = 1.0 / (i + 1)
        logged[("lr", i)] = 0.1
        if i % 500 == 0:
            sdk.flush(0.2)  # the loop may flush while the server misbehaves
            sdk.log_event("tick", {"i": i})
    bad_requests = len(server.requests)
    wait_for(lambda: len(server.requests) > bad_requests, what="a request in mode " + mode)
    assert sdk.summary()["queued"] > 0
    server.mode = "good"
    server.release.set()
    wait_for(lambda: server.identities(101) == set(logged), what="every point")
    assert sdk.flush(5)
    values = server.values(101)
    assert set(values) == set(logged)
    assert all(values[k] == {v} for k, v in logged.items())  # replays only repeat the same value
    s = sdk.summary()
    assert s["dropped"] == 0 and s["queued"] == 0 and s["sent"] >= len(logged)
    events = [b for p, b in server.posts("/events")]
    assert sorted({e["data"]["i"] for e in events}) == [500, 1000, 1500, 2000]


def test_full_queue_drops_the_oldest_and_counts_them(sdk, server, monkeypatch):
    from gpuctl import sender

    monkeypatch.setattr(sender, "TIMEOUT", (1.0, 60.0))
    sdk.init(server=server.url, token=TOKEN)
    server.mode = "hang"
    sdk.log({"x": -1.0}, step=-1)
    sdk.flush(0.01)
    # the sender now waits on a request the server holds: nothing leaves the queue
    wait_for(lambda: server.hung == 1, what="the sender to be held")
    for i in range(15000):
        sdk.log({"x": float(i)}, step=i)
    s = sdk.summary()
    assert s["dropped"] == 5000
    assert s["queued"] >= 10000
    assert s["latest"]["x"] == 14999.0
    server.mode = "good"
    server.release.set()
    wait_for(lambda: len(server.identities(101)) == 10001, what="the survivors")
    assert server.identities(101) == {("x", i) for i in range(-1, 0)} | {
        ("x", i) for i in range(5000, 15000)}
    assert sdk.flush(5)
    assert sdk.summary()["dropped"] == 5000


def test_flush_gives_up_in_time_when_the_server_hangs(sdk, server):
    sdk.init(server=server.url, token=TOKEN)
    server.mode = "hang"
    sdk.log({"x": 1.0})
    assert sdk.flush(0.2) is False
    sdk.finish()  # at most 2 s, and no exception
    assert sdk.summary()["state"] == "finished"
    server.release.set()


def test_logging_from_many_threads_loses_nothing(sdk, server):
    sdk.init(server=server.url, token=TOKEN)

    def work(t):
        for i in range(2000):
            sdk.log({"t%d" % t: float(i)}, step=i)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sdk.flush(10)
    assert server.identities(101) == {("t%d" % t, i) for t in range(4) for i in range(2000)}
    assert sdk.summary()["dropped"] == 0
