"""In-process pub/sub: log lines and job ends wake SSE followers (one server process)."""
import threading


class Hub:
    def __init__(self):
        self._cond = threading.Condition()
        self._version = 0
        self.closed = False

    def close(self):
        """Server shutdown: wake every follower so its stream ends and frees its thread."""
        self.closed = True
        self.publish()

    def publish(self):
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    @property
    def version(self):
        return self._version

    def wait(self, seen_version, timeout):
        """Block until something was published after `seen_version`, or timeout."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != seen_version, timeout)
            return self._version
