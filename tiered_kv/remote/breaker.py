"""The remote store's circuit breaker: stop talking to a server that does not answer, probe it, come back.

``breaker_failures`` consecutive failed round trips (either I/O thread; a trip fails when it raised, or
when every command of it failed for a reason that says the server is unreachable) open it.  While it
is open the store answers puts and fetches ``remote_down`` at once instead of waiting on timeouts.
After ``breaker_backoff_min_s`` the writer thread sends one probe (PING); its success closes the
breaker, its failure doubles the back-off up to ``breaker_backoff_max_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

__all__ = ["Breaker"]

log = logging.getLogger(__name__)


class Breaker:
    """Thread-safe.  ``on_open(msg)`` runs once per opening; ``on_change()`` after every open / close
    (the store wakes its threads there).  Neither is called with the breaker's lock held."""

    def __init__(self, failures: int, backoff_min_s: float, backoff_max_s: float, on_open: Callable[[str], None],
                 on_change: Callable[[], None], name: str = "remote") -> None:
        self.threshold = max(1, int(failures))
        self.backoff_min_s = max(0.0, backoff_min_s)
        self.backoff_max_s = max(self.backoff_min_s, backoff_max_s)
        self._on_open = on_open
        self._on_change = on_change
        self.name = name
        self._lock = threading.Lock()
        self._failures = 0
        self._open = False
        self._opening = False     # on_open is running: the breaker opens when it returns
        self._backoff = self.backoff_min_s
        self._next_probe = 0.0
        self.openings = 0

    @property
    def closed(self) -> bool:
        return not self._open

    def success(self) -> None:
        """A round trip (or the probe) got answers: the count restarts; an open breaker closes."""
        with self._lock:
            self._failures = 0
            was_open, self._open = self._open, False
            if was_open:
                self._backoff = self.backoff_min_s
        if was_open:
            log.info("%s: the server answers again: circuit breaker closed", self.name)
            self._on_change()

    def failure(self, msg: str) -> bool:
        """A failed round trip; True when it opened the breaker."""
        with self._lock:
            self._failures += 1
            if self._open or self._opening or self._failures < self.threshold:
                return False
            self._opening = True
            n = self._failures
        self._opened(f"{n} failed round trips in a row, the last: {msg}")
        return True

    def trip(self, msg: str) -> bool:
        """Open now (the store starts with a server that does not answer); True when it was closed."""
        with self._lock:
            if self._open or self._opening:
                return False
            self._opening = True
        self._opened(msg)
        return True

    def _opened(self, msg: str) -> None:
        """Count the opening (``on_open``) before anyone can see the breaker open, then open it."""
        log.warning("%s: circuit breaker open (%s); probing again in %.2f s", self.name, msg, self._backoff)
        self._on_open(msg)
        with self._lock:
            self._opening = False
            self._open = True
            self.openings += 1
            self._next_probe = time.monotonic() + self._backoff
        self._on_change()

    def probe_in(self) -> float:
        """Seconds until the next probe is due (0: now).  Meaningless while closed."""
        return max(0.0, self._next_probe - time.monotonic())

    def probe_failed(self) -> None:
        with self._lock:
            self._backoff = min(self.backoff_max_s, max(self._backoff * 2, 1e-3))
            self._next_probe = time.monotonic() + self._backoff
            backoff = self._backoff
        log.info("%s: probe failed, next in %.2f s", self.name, backoff)
