"""What the remote store's two I/O threads share: their lock and wake-ups, idling, closing, and dying.

:class:`IOThread` is the base of :class:`~tiered_kv.remote.writer.Writer` and
:class:`~tiered_kv.remote.reader.Reader`.  A subclass keeps its queued work under ``_cond`` and says
whether any is left (:meth:`IOThread._queued`); it runs its loop in ``_main`` and answers what a dying
thread held in ``_died``.  The owner's calls here only take ``_cond`` briefly: none waits on the network.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from .conn import Conn

__all__ = ["IOThread"]

log = logging.getLogger(__name__)


class IOThread:
    """One I/O thread of the remote store (``role``: "writer" or "reader")."""

    role = "io"
    point = "io"   # what the test hook is called with ("write" / "read")
    conn: Conn     # the thread's own connection (its subclass sets it)

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition(threading.Lock())
        self._busy = False        # taken work not finished (wait_idle)
        self._wake = False
        self.accepting = True
        self._closing = False
        self._close_deadline = 0.0
        self.restarts = 0
        self.healthy = True
        self.hook: Optional[Callable[[str], None]] = None   # tests: called between taking a batch and sending it

    def _start(self) -> threading.Thread:
        t = threading.Thread(target=self._run, name=f"tiered-kv-remote-{self.role}", daemon=True)
        t.start()
        return t

    def _queued(self) -> bool:   # pragma: no cover - every subclass says
        raise NotImplementedError

    # ------------------------------------------------------------ any thread, never blocks on I/O
    def kick(self) -> None:
        """The owner's step ended: send what it queued."""
        with self._cond:
            if self._queued():
                self._notify()

    def wake(self) -> None:
        with self._cond:
            self._notify()

    def _notify(self) -> None:
        self._wake = True
        self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return not self._queued() and not self._busy

    def _held(self) -> bool:
        """Queued work waits for something no wait bounds (the writer: the open breaker holds tombstone ops
        back); under the lock.  Whoever changes it wakes the thread (the breaker's ``on_change``)."""
        return False

    def wait_idle(self, timeout: float) -> bool:
        """Block until everything queued so far was sent and answered; False on timeout, and False as soon as
        queued work is held back (:meth:`_held`): nothing to wait for until the server answers again, or once the
        thread is gone for good (not :attr:`healthy`): nothing will be sent any more."""
        with self._cond:
            self._notify()
            done = self._cond.wait_for(
                lambda: self._held() or not self.healthy or (not self._queued() and not self._busy), timeout)
            return done and not self._held() and self.healthy

    def begin_close(self, deadline: float) -> None:
        with self._cond:
            self.accepting = False
            self._closing = True
            self._close_deadline = deadline
            self._notify()

    def join(self, timeout: float) -> bool:
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive()

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            self._main()
        except BaseException as e:  # noqa: BLE001 - answered, counted, restarted by _died
            log.exception("%s: the remote %s thread died", self.name, self.role)
            self._died(e)   # resets the conn; a restarted thread goes on with it
            return
        # done (the store closes): the thread closes its own connection, whether or not close() still waits for it
        self.conn.close()

    def _main(self) -> None:   # pragma: no cover - every subclass has its loop
        raise NotImplementedError

    def _run_batch(self, batch: Optional[list[Any]], send: Callable[[list[Any]], None]) -> bool:
        """One turn of a loop: ``batch`` None means the thread is done (False: stop); a non-empty
        batch goes through the test hook (``hook(role-point)``), then ``send``."""
        if batch is None:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
            return False
        if batch:
            if self.hook is not None:
                self.hook(self.point)
            send(batch)
        return True

    def _died(self, e: BaseException) -> None:   # pragma: no cover - every subclass answers its work
        raise NotImplementedError
