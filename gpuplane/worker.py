"""The shape of every background thread in the server (scheduler, rollup, ...)."""
import logging
import threading

log = logging.getLogger(__name__)


class Worker:
    """A background thread: run() calls the subclass's tick() every `interval` (or at
    once on wake()) until stop(); a failing tick is logged and the loop goes on."""
    name = "worker"
    interval = 1.0

    def __init__(self):
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = None

    def start(self):
        self._thread = threading.Thread(target=self.run, name=f"gpuplane-{self.name}",
                                        daemon=True)
        self._thread.start()

    def wake(self):
        self._wake.set()

    def run(self):
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("%s tick failed", self.name)
            self._wake.wait(self.interval)
            self._wake.clear()

    def tick(self):
        raise NotImplementedError

    def stop(self, timeout=5):
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("thread %s did not stop within %s s", self._thread.name, timeout)
