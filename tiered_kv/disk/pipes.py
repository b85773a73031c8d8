"""The pipes between the owner and its disk I/O process (:mod:`.proc`, :mod:`.child`): the frames that
cross them, and the thread that starts the child.

Owns the framing (a 4-byte length, then a pickle; :func:`_frame`, :class:`_Frames`), the pipes'
size (:func:`_bigger_pipe`) and the spawner thread (:func:`_spawn`).  Invariant: the child is
started from one daemon thread that lives as long as the process, so ``PR_SET_PDEATHSIG`` (sent
when the forking *thread* ends) follows the owner process.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import os
import pickle
import queue
import select
import struct
import subprocess
import threading
import time
from typing import Any, Optional

__all__: list[str] = []   # private to the disk package

_LEN = struct.Struct("<I")
_PIPE_BYTES = 1 << 20          # asked for each pipe (F_SETPIPE_SZ); the kernel may give less
_READ_CHUNK = 1 << 20
_F_SETPIPE_SZ = 1031


# ---------------------------------------------------------------------------- starting the child
_spawn_q: Optional["queue.SimpleQueue[Any]"] = None
_spawn_lock = threading.Lock()
_at_fork = False   # _forget_spawner registered (at the first spawn, not at import)


def _spawn(argv: list[str], fds: tuple[int, ...]) -> "subprocess.Popen[bytes]":
    """Start the child from one long-lived thread of this process.

    The child asks for ``PR_SET_PDEATHSIG``, which Linux sends when the *thread* that forked it
    ends, not the process: a manager made on a short-lived thread (an engine's start-up thread, a
    test's helper) would otherwise lose its I/O process with that thread.  The spawner is a daemon
    thread started on first use (not at import); it is never joined, so it outlives every
    ``atexit`` handler and the child goes only with the process."""
    global _spawn_q, _at_fork
    with _spawn_lock:
        if _spawn_q is None:
            # kept only once its thread runs: a start that failed (can't start new thread) is tried again next time
            fresh: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
            threading.Thread(target=_spawner, args=(fresh,), name="tiered-kv-disk-spawner", daemon=True).start()
            _spawn_q = fresh
            if not _at_fork:   # a forked process has no spawner thread: its first _spawn starts its own
                os.register_at_fork(after_in_child=_forget_spawner)
                _at_fork = True
        q = _spawn_q
    done: concurrent.futures.Future[subprocess.Popen[bytes]] = concurrent.futures.Future()
    q.put((argv, fds, done))
    return done.result()


def _forget_spawner() -> None:
    """In a forked child: the parent's spawner thread is not there (nor, perhaps, its lock's owner)."""
    global _spawn_q, _spawn_lock
    _spawn_q = None
    _spawn_lock = threading.Lock()


def _spawner(q: "queue.SimpleQueue[Any]") -> None:
    while True:
        argv, fds, done = q.get()
        try:
            done.set_result(subprocess.Popen(argv, pass_fds=fds, stdin=subprocess.DEVNULL, close_fds=True))
        except BaseException as exc:   # handed to the caller, which raises it
            done.set_exception(exc)


# ---------------------------------------------------------------------------- framing
def _frame(obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=5)
    return _LEN.pack(len(body)) + body


class _Frames:
    """Frames read from a blocking pipe: ``next()`` returns one decoded frame, raises EOFError at the end."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = bytearray()

    def next(self, deadline: Optional[float] = None) -> Any:
        """The next frame; ``deadline`` (``time.monotonic()``): TimeoutError when none is whole by then."""
        buf = self._buf
        while True:
            if len(buf) >= 4:
                (n,) = _LEN.unpack_from(buf)
                if len(buf) >= 4 + n:
                    obj = pickle.loads(memoryview(buf)[4:4 + n])
                    del buf[:4 + n]
                    return obj
            if deadline is not None:
                readable = select.poll()
                readable.register(self._fd, select.POLLIN)
                if not readable.poll(max(0.0, deadline - time.monotonic()) * 1e3):
                    raise TimeoutError("no frame before the deadline")
            chunk = os.read(self._fd, _READ_CHUNK)
            if not chunk:
                raise EOFError
            buf += chunk


def _bigger_pipe(fd: int) -> None:
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)
    except OSError:
        pass   # capped by /proc/sys/fs/pipe-max-size: the default size works, in more writes
