"""POSIX shared-memory arrays and the naming/cleanup rules for every fdserve IPC object.

This module owns:
- the name scheme ``fd.<instance>.<name>.<dp_rank>`` shared by shared-memory segments and
  POSIX semaphores (``ipc_name``), so two servers on one host never collide;
- ``SharedArray``: a numpy array over a POSIX shared-memory segment (posix_ipc + mmap). We do
  not use ``multiprocessing.shared_memory``: on Python 3.11 its resource tracker unlinks a
  segment created by another process when an attaching process exits;
- the process-local registry of names this process created (``unlink_created``) and the
  start-up sweep of names left behind by a dead instance (``sweep_stale``).
"""
from __future__ import annotations

import atexit
import errno
import logging
import mmap
import os
import re
import threading
from typing import Any

import numpy as np
import posix_ipc

logger = logging.getLogger(__name__)

_NAME_PART = re.compile(r"[A-Za-z0-9_-]+")
# Linux limits a shm name to NAME_MAX (255) and a semaphore name to 251, because glibc stores
# semaphores in /dev/shm as "sem.<name>".
_MAX_NAME_LEN = 250
_SHM_DIR = "/dev/shm"
_SEM_PREFIX = "sem."

# name (no leading "/") -> (kind, creating pid). The pid keeps a forked child, which inherits
# this dict and the atexit hook, from unlinking its parent's objects.
_created: dict[str, tuple[str, int]] = {}
# Re-entrant: a signal handler running unlink_created may interrupt this thread inside the lock.
_created_lock = threading.RLock()
_atexit_registered = False

_KIND_SHM = "shm"
_KIND_SEM = "semaphore"


def ipc_name(instance_id: str, name: str, dp_rank: int = 0) -> str:
    """The shared name of one IPC object: ``fd.<instance_id>.<name>.<dp_rank>``.

    The posix_ipc name is this with a leading "/"; /dev/shm lists a segment under this
    name and a semaphore as ``sem.<this>``.
    """
    _check_part("instance_id", instance_id)
    _check_part("name", name)
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
        raise ValueError(f"dp_rank must be a non-negative int, got {dp_rank!r}")
    full = f"fd.{instance_id}.{name}.{dp_rank}"
    if len(full) > _MAX_NAME_LEN:
        raise ValueError(f"IPC name {full!r} is longer than {_MAX_NAME_LEN} characters")
    return full


def _check_part(label: str, part: str) -> None:
    if not isinstance(part, str) or not _NAME_PART.fullmatch(part):
        raise ValueError(f"{label} must be a non-empty string of [A-Za-z0-9_-], got {part!r}")


def _posix_name(name: str) -> str:
    """posix_ipc wants exactly one leading slash; accept the name with or without it."""
    bare = name[1:] if name.startswith("/") else name
    if not bare or "/" in bare:
        raise ValueError(f"invalid shared-memory name {name!r}")
    return "/" + bare


def _register_created(name: str, kind: str) -> None:
    global _atexit_registered
    with _created_lock:
        _created[name] = (kind, os.getpid())
        if not _atexit_registered:
            atexit.register(unlink_created)
            _atexit_registered = True


def _forget_created(name: str) -> None:
    with _created_lock:
        _created.pop(name, None)


def register_created_semaphore(name: str) -> None:
    """Record a POSIX semaphore this process created, so ``unlink_created`` removes it too."""
    _register_created(_posix_name(name)[1:], _KIND_SEM)


def _unlink(kind: str, name: str) -> bool:
    """Unlink one object by bare name; False if it was already gone."""
    unlink = posix_ipc.unlink_shared_memory if kind == _KIND_SHM else posix_ipc.unlink_semaphore
    try:
        unlink("/" + name)
    except posix_ipc.ExistentialError:
        logger.debug("%s %s was already unlinked", kind, name)
        return False
    return True


def unlink_segment(name: str) -> bool:
    """Unlink a shared-memory segment by its bare name (one a dead process created); False if absent."""
    return _unlink(_KIND_SHM, name)


def unlink_created() -> list[str]:
    """Unlink every segment and semaphore this process created and has not unlinked yet.

    Safe to call repeatedly and from signal handlers' shutdown paths; also registered with
    atexit on the first creation. Returns the names removed.
    """
    pid = os.getpid()
    with _created_lock:
        mine = [(name, kind) for name, (kind, owner) in _created.items() if owner == pid]
        for name, _kind in mine:
            del _created[name]
    removed = [name for name, kind in mine if _unlink(kind, name)]
    if removed:
        logger.info("unlinked %d IPC objects created by pid %d: %s", len(removed), pid, removed)
    return removed


def sweep_stale(instance_id: str) -> list[str]:
    """Unlink every segment and semaphore named ``fd.<instance_id>.*`` (left by a dead instance).

    Call at start-up, before creating anything. Returns the /dev/shm entries removed
    (semaphores as ``sem.fd...``).
    """
    _check_part("instance_id", instance_id)
    prefix = f"fd.{instance_id}."
    try:
        entries = sorted(os.listdir(_SHM_DIR))
    except FileNotFoundError:
        logger.debug("no %s on this platform; nothing to sweep", _SHM_DIR)
        return []
    removed: list[str] = []
    for entry in entries:
        if entry.startswith(prefix):
            kind, bare = _KIND_SHM, entry
        elif entry.startswith(_SEM_PREFIX + prefix):
            kind, bare = _KIND_SEM, entry[len(_SEM_PREFIX):]
        else:
            continue
        _forget_created(bare)
        try:
            if _unlink(kind, bare):
                removed.append(entry)
        except posix_ipc.PermissionsError:
            logger.warning("cannot remove stale %s %s: owned by another user", kind, entry)
    if removed:
        logger.warning("removed stale IPC objects of instance %s: %s", instance_id, removed)
    return removed


def _check_free_space(name: str, nbytes: int) -> None:
    """Refuse a segment larger than the free space of /dev/shm.

    tmpfs allocates pages on first touch, so an oversized segment would be created fine and
    then kill the process with SIGBUS when the model writes into it (Docker's default
    /dev/shm is 64 MB). Concurrent allocations can still race; this catches the common case.
    """
    try:
        fs = os.statvfs(_SHM_DIR)
    except FileNotFoundError:
        return
    free = fs.f_bavail * fs.f_frsize
    if nbytes > free:
        raise OSError(
            errno.ENOSPC,
            f"shared memory {name} needs {nbytes / 2**20:.1f} MiB but {_SHM_DIR} has {free / 2**20:.1f} MiB free "
            "(enlarge it, e.g. docker run --shm-size, or use a smaller KV cache)",
        )


class SharedArray:
    """A numpy array living in a named POSIX shared-memory segment.

    ``create=True`` makes a new segment (fails if the name exists; run ``sweep_stale`` at
    start-up), mode 0600, zero-filled: a freshly sized POSIX segment reads as zeros, so no
    page is touched here and a large KV cache costs nothing until used. ``create=False``
    attaches to an existing segment and checks that its size matches shape x dtype.
    The array is a view on the mapping, never a copy.
    """

    def __init__(self, name: str, shape: int | tuple[int, ...], dtype: Any, create: bool) -> None:
        self.name = _posix_name(name)[1:]
        self.shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        if any(d <= 0 for d in self.shape):
            raise ValueError(f"shared array {self.name} needs positive dimensions, got shape {self.shape}")
        if self.dtype.hasobject or self.dtype.itemsize == 0:
            raise ValueError(f"shared array {self.name} needs a fixed-size plain dtype, got {self.dtype}")
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.created = bool(create)
        self._unlinked = False
        self._mmap = self._map(create)
        # frombuffer (unlike np.ndarray(buffer=...)) holds a buffer export on the mmap, so
        # close() cannot unmap memory that a live view still points to.
        flat = np.frombuffer(self._mmap, dtype=self.dtype, count=self.nbytes // self.dtype.itemsize)
        self._array: np.ndarray | None = flat.reshape(self.shape)

    def _map(self, create: bool) -> mmap.mmap:
        posix = "/" + self.name
        if create:
            _check_free_space(self.name, self.nbytes)
            try:
                shm = posix_ipc.SharedMemory(posix, flags=posix_ipc.O_CREX, mode=0o600, size=self.nbytes)
            except posix_ipc.ExistentialError as exc:
                raise FileExistsError(
                    f"shared memory {self.name} already exists (another server with this instance id, "
                    "or a stale one: sweep_stale removes leftovers)"
                ) from exc
            _register_created(self.name, _KIND_SHM)
        else:
            try:
                shm = posix_ipc.SharedMemory(posix)
            except posix_ipc.ExistentialError as exc:
                raise FileNotFoundError(f"shared memory {self.name} does not exist (has its creator started?)") from exc
            size = shm.size
            if size != self.nbytes:
                shm.close_fd()
                raise ValueError(
                    f"shared memory {self.name} holds {size} bytes, expected {self.nbytes} "
                    f"for shape {self.shape} dtype {self.dtype}"
                )
        try:
            return mmap.mmap(shm.fd, self.nbytes)
        except OSError:
            if create:
                _forget_created(self.name)
                _unlink(_KIND_SHM, self.name)
            raise
        finally:
            # The mapping keeps the memory; the descriptor is no longer needed.
            shm.close_fd()

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            raise ValueError(f"shared array {self.name} is closed")
        return self._array

    def close(self) -> None:
        """Unmap this process's view. Views still referenced elsewhere keep the mapping alive."""
        if self._mmap is None:
            return
        self._array = None
        try:
            self._mmap.close()
        except BufferError:
            # Someone still holds a view (a numpy slice, a dlpack tensor); unmapping now would
            # leave it dangling. The mmap object unmaps itself when the last view goes away.
            logger.debug("shared array %s still has views; unmapped when they are released", self.name)
        self._mmap = None

    def unlink(self) -> bool:
        """Remove the name (creator only; a no-op for attachers and on repeated calls).

        Existing mappings stay valid until closed. Returns True if this call removed it.
        """
        if not self.created:
            logger.debug("shared array %s: unlink ignored, this process only attached", self.name)
            return False
        if self._unlinked:
            return False
        self._unlinked = True
        _forget_created(self.name)
        return _unlink(_KIND_SHM, self.name)

    def __enter__(self) -> "SharedArray":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
        self.unlink()

    def __repr__(self) -> str:
        role = "creator" if self.created else "attached"
        return f"SharedArray({self.name!r}, shape={self.shape}, dtype={self.dtype}, {role})"
