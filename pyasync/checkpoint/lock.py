"""The writers' directory lock: one save at a time per checkpoint directory.

Note [Checkpoint directory lock]
Rank 0 of a save takes an exclusive, non-blocking ``fcntl.flock`` on ``<dir>/.pyasync-lock`` (created
if missing, never deleted: unlinking a flock'ed file lets a third writer lock a fresh inode while a
second still holds the old one) before anything of the save is written, records its pid and host in
the file, and holds the lock until its manifest is committed and the directory cleaned up; every exit
path releases it, and the kernel releases it when the holder dies, so a crashed save never leaves a
stale lock. Rank 0 folds the outcome into the broadcast that already carries the save id (see
save.py): a refused lock makes the save fail on every rank of that job with "another save is writing
to DIR (lock held by pid N on HOST)" before any file is written, so the running save and the
directory are untouched.

Readers never take the lock (see Note [Loading while a save commits] in load.py).

Where flock is unavailable (no fcntl module; a file system that answers ENOLCK, EOPNOTSUPP, ENOSYS or
EINVAL, e.g. NFS without a lock daemon) the save goes on unlocked with a RuntimeWarning, and its
cleanup only deletes files of the manifest it replaced (see Note [Checkpoint cleanup] in save.py), so
even unlocked concurrent saves never leave a manifest naming a deleted file. On NFS, flock is
emulated with POSIX byte-range locks (Linux >= 2.6.12) and excludes writers on other clients only
when the server's lock service works; with ``-o nolock`` or ``local_lock=flock`` it excludes writers
on the same client only.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from typing import Any

try:
    import fcntl
except ImportError:  # e.g. Windows: no flock; saves go on unlocked (Note [Checkpoint directory lock])
    fcntl = None  # type: ignore[assignment]

__all__ = ["BUSY", "ERROR", "HELD", "LOCK_FILE", "UNLOCKED", "DirLock"]

LOCK_FILE = ".pyasync-lock"
HOST_BYTES = 64  # the holder's host name travels in this many bytes (Linux HOST_NAME_MAX)

# Outcomes of DirLock.acquire (also sent from rank 0 to the other ranks of a save, as int64).
HELD = 1  # this process holds the lock
UNLOCKED = 2  # flock is not available here: going on without it
BUSY = 3  # another process holds the lock
ERROR = 4  # the directory or the lock file cannot be created or opened

_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}
_CONTENDED = {errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES}


def hostname() -> str:
    return socket.gethostname()[:HOST_BYTES] or "?"


def read_holder(path: str) -> tuple[int | None, str | None]:
    """(pid, host) recorded in the lock file ``path``, or (None, None) when it is empty or unreadable
    (a holder that is not pyasync, or one between taking the lock and recording itself)."""
    try:
        with open(path, "rb") as f:
            text = f.read(4096).decode("utf-8", "replace")
        # raw_decode: a record shorter than the previous one may be followed by that one's tail for
        # the moment between the holder's pwrite and its ftruncate.
        rec, _ = json.JSONDecoder().raw_decode(text)
    except (OSError, ValueError):
        return None, None
    if not isinstance(rec, dict):
        return None, None
    pid, host = rec.get("pid"), rec.get("host")
    ok_pid = isinstance(pid, int) and not isinstance(pid, bool) and pid > 0
    return (pid if ok_pid else None), (host[:HOST_BYTES] if isinstance(host, str) else None)


def describe_holder(pid: int | None, host: str | None) -> str:
    if pid is None:
        return "lock held by another process that did not record its pid"
    return f"lock held by pid {pid}" + (f" on {host}" if host else "")


def _record(fd: int, rec: dict[str, Any] | None) -> None:
    """Write (or, with None, clear) the holder record; best effort (a read-only fd cannot)."""
    data = b"" if rec is None else json.dumps(rec).encode() + b"\n"
    try:
        if data:
            os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    except OSError:
        pass


class DirLock:
    """An exclusive, non-blocking flock on ``<d>/.pyasync-lock``. See Note [Checkpoint directory lock].

    ``acquire()`` returns HELD, UNLOCKED, BUSY or ERROR (also kept in ``state``); on BUSY ``holder``
    is the (pid, host) the holder recorded, on ERROR and UNLOCKED ``error`` says why. ``release()`` is
    idempotent and never raises. Also a context manager (acquire on enter, release on exit).
    """

    def __init__(self, d: str) -> None:
        self.dir = d
        self.path = os.path.join(d, LOCK_FILE)
        self.fd: int | None = None
        self.state = 0
        self.holder: tuple[int | None, str | None] = (None, None)
        self.error = ""

    def acquire(self) -> int:
        if self.fd is not None:
            raise RuntimeError(f"{self.path}: already acquired by this DirLock")
        self.state = self._acquire()
        return self.state

    def _acquire(self) -> int:
        try:
            os.makedirs(self.dir, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except PermissionError:  # someone else's lock file: flock works on a read-only fd too
                fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            self.error = f"cannot create or open the lock file {self.path}: {type(e).__name__}: {e}"
            return ERROR
        if fcntl is None:
            os.close(fd)
            self.error = "fcntl.flock is not available on this platform"
            return UNLOCKED
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in _CONTENDED:
                self.holder = read_holder(self.path)
                return BUSY
            if e.errno in _UNSUPPORTED:
                self.error = f"flock is not supported on {self.dir}: {e}"
                return UNLOCKED
            self.error = f"cannot lock {self.path}: {type(e).__name__}: {e}"
            return ERROR
        self.fd = fd
        _record(fd, {"pid": os.getpid(), "host": hostname(), "since": time.time()})
        return HELD

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        _record(fd, None)  # a BUSY reader then says "did not record its pid", never a stale pid
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)  # also for copies of the fd in forked children
        except OSError:
            pass
        finally:
            os.close(fd)

    def __enter__(self) -> DirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
