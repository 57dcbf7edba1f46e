"""The shape of every background thread in the server (scheduler, rollup, ...)."""
import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger(__name__)


def _set_os_thread_name(name):
    """Name the OS thread too (Linux, at most 15 bytes), so `top -H`, /proc/<pid>/task/*/comm
    and bench/ingest.py's rollup share can tell the server's threads apart."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)      # PR_SET_NAME
    except (OSError, AttributeError, TypeError):
        pass


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
        _set_os_thread_name(f"gpuplane-{self.name}")
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("%s tick failed", self.name)
            if self._wake.wait(self.interval):
                settle = self.settle_s()
                if settle:
                    self._stop.wait(settle)     # what arrives meanwhile joins this tick
            self._wake.clear()

    def settle_s(self):
        """Seconds to let more work arrive after a wake before the tick (0: at once)."""
        return 0.0

    def tick(self):
        raise NotImplementedError

    def stop(self, timeout=5):
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("thread %s did not stop within %s s", self._thread.name, timeout)
