"""gpuplane/hub.py: followers wake on publish, and all of them on close."""
import threading

from gpuplane.hub import Hub


def test_wait_returns_at_once_when_something_was_published_since():
    hub = Hub()
    seen = hub.version
    hub.publish()
    assert hub.wait(seen, timeout=30) == seen + 1


def test_wait_times_out_with_the_same_version_when_nothing_happens():
    hub = Hub()
    assert hub.wait(hub.version, timeout=0.01) == hub.version


def test_a_publish_wakes_every_waiting_follower_and_close_ends_them():
    hub = Hub()
    woke = []
    ready = threading.Barrier(4)

    def follower():
        seen = hub.version        # taken before the publish, so no wake-up is missed
        ready.wait()
        while True:
            seen = hub.wait(seen, timeout=30)
            woke.append(seen)
            if hub.closed:
                return

    threads = [threading.Thread(target=follower) for _ in range(3)]
    for t in threads:
        t.start()
    ready.wait()
    hub.publish()
    hub.close()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert len(woke) >= 3 and hub.closed
