"""What the remote store's two I/O threads share: their lock and wake-ups, idling, closing, and dying.

:class:`IOThread` is the base of :class:`~tiered_kv.remote.writer.Writer` and
:class:`~tiered_kv.remote.reader.Reader`.  A subclass keeps its queued work under ``_cond`` and says
whether any is left (:meth:`IOThread._queued`); it runs its loop in ``_main`` and answers what a dying
thread held in ``_died``.  The owner's calls here only take ``_cond`` briefly: none waits on the network.

Interrupt-safe on the owner's thread (a KeyboardInterrupt at any point): the owner's methods take the raw lock
with ``with self._lock:``, never ``with self._cond:`` -- ``Condition.__enter__`` is Python code, and a signal
handler that runs at its return leaves the lock taken with no ``with`` to release it (bpo-29988), deadlocking the
I/O thread and the owner's next call; ``Lock.__enter__`` is C, called by the BEFORE_WITH opcode, and the ``with``
block's handler covers what follows with no eval-breaker check in between (CPython 3.11).  The owner queues each
piece of work with its counts in one run of bytecodes without a call (``+=``), so an interrupt leaves it queued
with its counts or not at all.  A wake-up (``notify_all``, Python code) an interrupt cuts off only delays the work:
an idle thread looks at its queue again every :data:`IDLE_WAKE_S`, and queued work is sent after
``FALLBACK_WAKE_S`` or at the owner's next :meth:`IOThread.kick`.  :meth:`IOThread.wait_idle` does not wait on the
condition: see there.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from .conn import Conn

__all__ = ["IOThread", "IDLE_WAKE_S"]

IDLE_WAKE_S = 1.0   # an idle I/O thread looks at its queue again this often: work whose wake-up an interrupt on the
#                     owner's thread cut off (inside ``Condition.notify_all``) waits this long at most

log = logging.getLogger(__name__)


class IOThread:
    """One I/O thread of the remote store (``role``: "writer" or "reader")."""

    role = "io"
    point = "io"   # what the test hook is called with ("write" / "read")
    conn: Conn     # the thread's own connection (its subclass sets it)

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()   # the owner's side takes this raw lock, never the condition (see above)
        self._cond = threading.Condition(self._lock)
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
        with self._lock:
            if self._queued():
                self._notify()

    def wake(self) -> None:
        with self._lock:
            self._notify()

    def _notify(self) -> None:
        self._wake = True
        self._cond.notify_all()

    def idle(self) -> bool:
        with self._lock:
            return not self._queued() and not self._busy

    def _held(self) -> bool:
        """Queued work waits for something no wait bounds (the writer: the open breaker holds tombstone ops
        back); under the lock.  Whoever changes it wakes the thread (the breaker's ``on_change``)."""
        return False

    def wait_idle(self, timeout: float) -> bool:
        """Block until everything queued so far was sent and answered; False on timeout, and False as soon as
        queued work is held back (:meth:`_held`): nothing to wait for until the server answers again, or once the
        thread is gone for good (not :attr:`healthy`): nothing will be sent any more.

        The owner's thread (a blocking flush): it never waits on ``_cond`` itself.  ``Condition.wait`` interrupted
        as it gives the lock up or takes it back returns without it, and the caller's ``with`` would then release
        a lock the I/O thread holds.  It queues a waiter lock of its own among the condition's waiters instead
        (the I/O thread's ``notify_all`` releases it, as it would release ``wait``'s) and blocks on that lock with
        no lock of the thread's held: interrupted anywhere, no lock is left held, and a waiter left queued only
        takes one wake-up of a later ``notify_all`` (which wakes every waiter)."""
        deadline = time.monotonic() + max(0.0, timeout)
        kicked = False
        while True:
            waiter = threading.Lock()
            waiter.acquire()
            with self._lock:
                held, healthy = self._held(), self.healthy
                if held or not healthy or (not self._queued() and not self._busy):
                    return not held and healthy
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if not kicked:   # once, as a wait would (the thread's own notify_all must not wake it again)
                    self._notify()   # (before the waiter is queued: this wake-up is the thread's)
                    kicked = True
                self._cond._waiters.append(waiter)   # type: ignore[attr-defined] - released by a notify_all
            waiter.acquire(True, left)   # released by the thread's notify_all, or the deadline: look again
            with self._lock:
                try:   # not released (the deadline): taken off, so that no wake-up goes to it
                    self._cond._waiters.remove(waiter)   # type: ignore[attr-defined]
                except ValueError:
                    pass

    def begin_close(self, deadline: float) -> None:
        with self._lock:
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
