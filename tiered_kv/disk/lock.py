"""The path lock: one exclusive ``flock`` on ``DIR/tiered_kv.lock`` per disk tier directory (and the
directory syncs that make a new tier directory's entries durable: :func:`fsync_path`, :func:`sync_dirs`).

Owns taking it (never waiting), writing the holder's pid into it, and releasing it.  Invariants:
a :class:`~tiered_kv.disk.DiskStore` and every writing operator tool take this same lock, so at
most one of them writes a directory at a time; the holder's pid is in the file while it holds it,
so that whoever is refused can name the holder.  Read-only tools never touch it.  A lock held
while the pid written in it is gone is held by that owner's disk I/O process (disk/proc.py), which
shares the lock and dies with its owner: :func:`take` waits for it (up to ``ORPHAN_WAIT_S``).
No other process shares it: ``flock`` belongs to the open file, which every ``os.fork()`` child
(a multiprocessing worker, a forked helper) would hold too, for as long as it lives; so each lock
this process holds is closed in such a child, unlocked in neither (``os.register_at_fork``).  A
child started by :mod:`subprocess` runs no Python between its fork and its ``exec``, and keeps only
the descriptors passed to it (the disk I/O process gets the lock's, ``pass_fds``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from pathlib import Path
from typing import Optional, Union

__all__ = ["LOCK_NAME", "LockFd", "LockHeld", "take", "release", "share", "leave", "leave_all", "holder_pid", "locks",
           "pin", "fd_path", "pinned_path", "as_named", "fsync_path", "sync_dirs"]

LOCK_NAME = "tiered_kv.lock"
ORPHAN_WAIT_S = 10.0   # how long take() waits for the I/O process of a dead owner to exit

# the lock files this process has open (take() to release()/leave()), by descriptor number, under _fds: a
# lock file's open and its entry here, its entry's removal and its close, each happen together as seen by a
# fork (which takes _fds first), so no forked child gets a copy of a lock file it does not close
_held: dict[int, "LockFd"] = {}
_fds = threading.Lock()


class LockFd(int):
    """The descriptor of a lock :func:`take` returned (an ``int``), and its identity: :func:`release` and
    :func:`leave` act on this one only while it holds the lock, so running either again (a close an interrupt
    broke off, finished by the next) does nothing, even once the number is another lock's."""

    __slots__ = ()


def _close_in_child() -> None:
    """In an ``os.fork()`` child: its copies of the lock files are closed, never unlocked (the lock
    belongs to the parent's open file, which goes on holding it)."""
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()
    _fds.release()   # taken by the fork in the parent (before it), and copied taken


os.register_at_fork(before=_fds.acquire, after_in_parent=_fds.release, after_in_child=_close_in_child)


class LockHeld(Exception):
    """Another process (or another holder in this one) has the lock; ``holder`` is its pid as written."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"held by pid {holder}")
        self.holder = holder


def fsync_path(p: Union[int, str, "os.PathLike[str]"], directory: bool = False) -> None:
    """fsync a file, or a directory (its entries: the files and directories made in it), by name or by an open
    descriptor (an ``int``, left open)."""
    if isinstance(p, int):
        os.fsync(p)
        return
    fd = os.open(p, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_dirs(d: Path, stop: Path) -> None:
    """fsync directory ``d`` and each parent of it up to ``stop`` (included), the way the files and
    directories made under ``stop`` survive a crash (a file's own fsync does not sync its name)."""
    while True:
        fsync_path(d, directory=True)
        if d == stop or d.parent == d:
            return
        d = d.parent


def holder_pid(fd: int) -> str:
    """The pid written into an open lock file ("unknown" if none can be read)."""
    try:
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
    except OSError:
        return "unknown"


def locks(fd: int, directory: Union[str, "os.PathLike[str]"]) -> bool:
    """Whether the open lock file ``fd`` is ``directory``'s lock file (the same inode), i.e. ``directory`` still
    names the directory whose lock ``fd`` holds: not one that replaced it (moved aside, removed and made again,
    mounted over) or that a link repointed since names."""
    try:
        mine, there = os.fstat(fd), os.stat(Path(directory) / LOCK_NAME)
    except FileNotFoundError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def pin(fd: int, directory: Union[str, "os.PathLike[str]"], into: list[int]) -> bool:
    """Open ``directory`` (``O_DIRECTORY``) and say whether the directory it opened holds the lock file ``fd`` is
    (checked through the descriptor, not the name).  The descriptor is appended to ``into``, the caller's, which
    closes it (in either case): the open and that record are one chain of C calls, so an interrupt cannot fall
    between them.  Files opened through the descriptor (:func:`pinned_path`) are the locked directory's whatever
    happens to its name afterwards (moved aside, made again, mounted over): the check and the opens that follow
    it see one directory."""
    n = len(into)
    try:
        into.extend(map(os.open, (directory,), (os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC,)))
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:   # (followed if a link, as take() opens it)
        mine, there = os.fstat(fd), os.stat(LOCK_NAME, dir_fd=into[n])
    except FileNotFoundError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def as_named(text: str, at: Path, name: Union[str, "os.PathLike[str]"]) -> str:
    """``text`` (an error's, which names the path a file was opened through) with the pinned path ``at`` given as
    the configured ``name``, the one the operator knows."""
    return text.replace(str(at), str(name))


def fd_path(fd: int) -> Path:
    """``/proc/self/fd/N``: the name under which this process's descriptor ``fd`` is opened through."""
    return Path(f"/proc/self/fd/{fd}")


def pinned_path(dfd: int) -> Optional[Path]:
    """A path that names the directory open as ``dfd`` itself (``/proc/self/fd/N``: the kernel resolves it to
    the open directory, not to a name), for the libraries that open files by path (LMDB); None where this
    process has no ``/proc`` (the caller then opens by name and checks the lock again after)."""
    p = fd_path(dfd)
    try:
        return p if os.path.samestat(os.stat(p), os.fstat(dfd)) else None
    except OSError:
        return None


def take(directory: Union[str, "os.PathLike[str]"]) -> LockFd:
    """Take the lock of ``directory`` and write our pid into it; returns the fd to :func:`release`.

    Raises :class:`OSError` when the lock file cannot be opened, :class:`LockHeld` when it is held.
    """
    with _fds:   # before the flock: a fork from here on closes it in the child
        fd = LockFd(os.open(Path(directory) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644))
        _held[fd] = fd
    deadline = time.monotonic() + ORPHAN_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            holder = holder_pid(fd)
            if _gone(holder) and time.monotonic() < deadline:
                time.sleep(0.01)   # its owner is dead: the owner's I/O process is exiting (see above)
                continue
            with _fds:
                del _held[fd]
                os.close(fd)
            raise LockHeld(holder) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except BaseException:
        release(fd)
        raise
    return fd


def _gone(holder: str) -> bool:
    """Whether the pid written in the lock file names no live process."""
    try:
        pid = int(holder)
    except ValueError:
        return False
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def release(fd: int) -> None:
    """Unlock and close a lock :func:`take` returned.  One this process no longer has open (closed in it
    as a forked child, see above), or released already (its number may be another lock's by now), is left
    alone: unlocking it would free another holder's path."""
    with _fds:
        if _held.get(fd) is not fd:
            return
        del _held[fd]   # (no call from here to the unlock: an interrupt now still closes it, below)
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def share(fd: "LockFd") -> "LockFd":
    """Another descriptor of the lock ``fd`` holds (``dup``: the same open file, so the same lock), for
    :func:`leave` only: the lock stays held while any of its descriptors is open (here or in a child it was
    passed to), so a holder of several can close one (a disk I/O process replaced) without the path ever
    being free.  Raises :class:`OSError` when it cannot be made (out of descriptors), or when ``fd`` no
    longer holds the lock (left or released)."""
    with _fds:
        if _held.get(fd) is not fd:   # left or released already: its number may be another file's by now
            raise OSError(errno.EBADF, "the lock is not held by this descriptor any more")
        dup = LockFd(os.dup(fd))
        _held[dup] = dup
    return dup


def leave_all(fd: int) -> None:
    """:func:`leave` ``fd`` and every other descriptor of its lock this process still holds (its shares): for
    an owner giving up an open before any store of it lives, whatever an interrupt left between a
    :func:`share` and the code that would have left it."""
    with _fds:
        if _held.get(fd) is not fd:
            return
        mine = os.fstat(fd)
        for other in list(_held.values()):
            try:
                st = os.fstat(other)
            except OSError:   # (closed behind the registry's back: nothing to leave)
                continue
            if other is fd or (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                del _held[other]
                os.close(other)


def leave(fd: int) -> None:
    """Close a lock :func:`take` returned without unlocking it: it stays held while another process
    shares its open file (a disk I/O process that did not exit when killed), and is free once that
    process is gone too."""
    with _fds:
        if _held.get(fd) is not fd:
            return
        del _held[fd]
        os.close(fd)
