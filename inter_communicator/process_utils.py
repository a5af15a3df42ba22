"""Process lifetime helpers shared by every fdserve process.

Owns: making a child die with its parent (``set_parent_death_signal`` plus ``ParentWatcher``),
telling a live process from a dead one or a reused pid (``pid_start_time``, ``process_alive``; both
take the procfs root as a parameter and raise ``ProcUnreadableError`` rather than guess when it
cannot be read),
the SIGINT/SIGTERM shutdown hook (``install_shutdown_handlers``), the bounded shutdown
(``ShutdownDeadline``), and the one entry sequence every fdserve process runs (``ProcessEntry``:
logging, stop signals, parent death, deadline, clean-up, exit code). The role is a string: this
module knows no process kind.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from types import TracebackType
from typing import Callable

from inter_communicator.shm import unlink_created

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# /proc/<pid>/stat fields counted from 1; the text after the last ')' starts at field 3.
_STAT_FIRST_FIELD_AFTER_COMM = 3
_STAT_STARTTIME_FIELD = 22
_DEAD_STATES = ("Z", "X", "x")


# The kernel can deliver the parent-death signal more than once (once per re-parenting when the
# parent had several threads). SIGTERM's handler restores the default after the first one, so a
# second SIGTERM would kill us mid-cleanup; SIGUSR1 only ever requests a stop.
PARENT_DEATH_SIGNAL = signal.SIGUSR1


def set_parent_death_signal(sig: int = PARENT_DEATH_SIGNAL, parent_pid: int | None = None) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux prctl).

    The kernel tracks the parent *thread* that forked us, and the setting is cleared by some
    execs, so pair this with ``ParentWatcher``. If ``parent_pid`` is given and the parent is
    already gone (it died before this call), ``sig`` is sent right away.
    """
    if not sys.platform.startswith("linux"):
        logger.debug("PR_SET_PDEATHSIG is Linux-only; skipped on %s", sys.platform)
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG, {int(sig)}) failed: {os.strerror(err)}")
    if parent_pid is not None and os.getppid() != parent_pid:
        logger.warning("parent %d exited before the death signal was armed; sending %d to self", parent_pid, sig)
        os.kill(os.getpid(), sig)


def _terminate_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


class ParentWatcher(threading.Thread):
    """Daemon thread calling ``callback`` once when the parent process goes away.

    Detection: our parent pid changes (we were re-parented to init or a subreaper). Checks
    every ``interval`` seconds with a blocking wait. Default callback: SIGTERM to ourselves,
    so the process's normal shutdown handlers run.
    """

    def __init__(
        self,
        interval: float = 1.0,
        callback: Callable[[], object] | None = None,
        parent_pid: int | None = None,
    ) -> None:
        super().__init__(name="parent-watcher", daemon=True)
        if interval <= 0:
            raise ValueError(f"ParentWatcher interval must be positive, got {interval}")
        self.interval = interval
        self.callback = callback or _terminate_self
        # Given by the spawner, this also catches a parent that died before we started.
        self.parent_pid = parent_pid if parent_pid is not None else os.getppid()
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self.interval):
            if os.getppid() != self.parent_pid:
                logger.warning("parent process %d is gone; shutting down", self.parent_pid)
                self.callback()
                return

    def stop(self) -> None:
        """End the watch without calling the callback (orderly shutdown)."""
        self._stopped.set()


PROC_ROOT = "/proc"


class ProcUnreadableError(OSError):
    """The proc filesystem cannot be read, so a process's start time (its identity) is unknown."""


def proc_readable(proc_root: str = PROC_ROOT) -> bool:
    """True if ``<proc_root>/self/stat`` can be read (procfs mounted and accessible)."""
    return os.access(f"{proc_root}/self/stat", os.R_OK)


def _read_stat_fields(pid: int, proc_root: str = PROC_ROOT) -> list[str] | None:
    """Fields 3.. of <proc_root>/<pid>/stat, or None if there is no such process.

    Raises ``ProcUnreadableError`` when the file cannot be read for another reason (no procfs,
    no permission): a missing file must not be taken for a dead process then.
    """
    path = f"{proc_root}/{pid}/stat"
    try:
        with open(path, "rb") as f:
            raw = f.read().decode("ascii", errors="replace")
    except (FileNotFoundError, ProcessLookupError) as exc:
        if not proc_readable(proc_root):
            raise ProcUnreadableError(exc.errno, f"cannot read {path}: {proc_root} is not a readable procfs") from exc
        return None
    except OSError as exc:
        raise ProcUnreadableError(exc.errno, f"cannot read {path}: {exc.strerror}") from exc
    # comm (field 2) may contain spaces and parentheses; it ends at the last ')'.
    return raw[raw.rindex(")") + 1 :].split()


def pid_start_time(pid: int, proc_root: str = PROC_ROOT) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (stat field 22); None if it does not exist.

    Raises ``ProcUnreadableError`` if ``proc_root`` cannot be read (the start time is unknown,
    which is not the same as "no such process").
    """
    if pid <= 0:
        return None
    fields = _read_stat_fields(pid, proc_root)
    if fields is None:
        return None
    return int(fields[_STAT_STARTTIME_FIELD - _STAT_FIRST_FIELD_AFTER_COMM])


def process_alive(pid: int, start_time: int | None, proc_root: str = PROC_ROOT) -> bool:
    """True if ``pid`` runs, is not a zombie, and (when given) started at ``start_time``.

    The start time distinguishes the recorded owner from an unrelated process that got the
    same pid after the owner died. Without a readable ``proc_root`` only existence can be
    checked (signal 0, no zombie check): a missing pid is still reported dead, and so is an
    existing one when no ``start_time`` is asked for; but an existing pid with a ``start_time``
    raises ``ProcUnreadableError``, because it may be a reused pid and guessing either way is
    wrong (a lock would rob a live holder, or wait on an unrelated process forever).
    """
    if pid <= 0:
        return False
    if not proc_readable(proc_root):
        if not _signal_zero_alive(pid):
            return False
        if start_time is None:
            return True
        raise ProcUnreadableError(errno.EACCES, f"{proc_root} is not readable: cannot tell whether pid {pid} is "
                                  f"still the process that started at tick {start_time}")
    fields = _read_stat_fields(pid, proc_root)
    if fields is None:
        return False
    if fields[0] in _DEAD_STATES:
        return False
    if start_time is None:
        return True
    return int(fields[_STAT_STARTTIME_FIELD - _STAT_FIRST_FIELD_AFTER_COMM]) == start_time


def _signal_zero_alive(pid: int) -> bool:
    """Fallback without /proc: existence only (no zombie or start-time check)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def install_shutdown_handlers(callback: Callable[[], object]) -> None:
    """On the first SIGINT or SIGTERM, restore the default handlers and call ``callback`` once.

    Restoring first means a second Ctrl-C (or SIGTERM) kills the process even if the
    callback hangs. ``PARENT_DEATH_SIGNAL`` also calls ``callback`` once, without restoring
    anything, since the kernel may send it twice. Must be called from the main thread.
    """
    fired = threading.Event()

    def handle(signum: int, _frame: object) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        if fired.is_set():
            return
        fired.set()
        logger.info("received %s; shutting down (send it again to kill)", signal.Signals(signum).name)
        callback()

    def handle_parent_death(_signum: int, _frame: object) -> None:
        if fired.is_set():
            return
        fired.set()
        logger.warning("parent process died; shutting down")
        callback()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handle)
    signal.signal(PARENT_DEATH_SIGNAL, handle_parent_death)


class ShutdownDeadline(threading.Thread):
    """Daemon thread bounding a process's shutdown: once ``stop_event`` is set, the process has
    ``grace_s`` seconds to exit; after that the thread unlinks the IPC objects the process
    created (``shm.unlink_created``) and ends it with ``os._exit(1)``.

    Why: a process whose parent died must not outlive it even when one clean-up step blocks
    (a full-suite CI run once saw a cache transfer process stay alive 40 s after its parent's
    SIGKILL). An orderly exit simply ends the process and this daemon thread with it.
    """

    def __init__(self, stop_event: threading.Event, grace_s: float) -> None:
        super().__init__(name="shutdown-deadline", daemon=True)
        if grace_s <= 0:
            raise ValueError(f"ShutdownDeadline grace_s must be positive, got {grace_s}")
        self._stop_event = stop_event
        self.grace_s = grace_s

    def run(self) -> None:
        self._stop_event.wait()
        time.sleep(self.grace_s)
        logger.error("shutdown did not finish within %.0f s; unlinking this process's IPC objects and exiting",
                     self.grace_s)
        unlink_created()
        os._exit(1)


# Exit codes of an fdserve process (what its supervisor sees as the child's exitcode).
EXIT_CLEAN = 0  # stopped on request (signal, parent death, shutdown message)
EXIT_FAILURE = 1  # an error ended it, or the shutdown deadline cut its clean-up short
# An expert-parallel collective failed: the peers are out of step and the whole group must restart.
EXIT_COLLECTIVE_FAILURE = 3


def spawning_parent_pid() -> int:
    """Pid of the process that started us: multiprocessing's record when spawned by it, else our ppid.

    multiprocessing's pid is fixed at spawn time, so a parent that died before this call counts too.
    """
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None and parent.pid is not None else os.getppid()


class ProcessEntry:
    """The start and end of an fdserve process, as a context manager around its body.

    On enter, in order: logging with role and rank (``setup_logging(role, rank)``, passed in so this
    floor needs no logging policy), the stop handlers (SIGINT/SIGTERM and ``PARENT_DEATH_SIGNAL`` set
    ``stop_event`` once, see ``install_shutdown_handlers``; installed before the kernel is asked for the
    parent-death signal, which it sends at once if the parent is already gone), the parent-death signal
    with the spawning parent's pid, a ``ParentWatcher`` for what the signal misses, and a
    ``ShutdownDeadline``. On exit: ``stop_event`` is set (arming the deadline, so a clean-up that hangs
    still ends the process), the clean-ups registered with ``cleanup`` run last-in first-out, and the
    process ends with ``exit_code``: ``EXIT_CLEAN``, ``EXIT_FAILURE`` if the body raised, or what the
    body set with ``fail``.
    """

    def __init__(
        self,
        role: str,
        rank: int = 0,
        *,
        grace_s: float,
        setup_logging: Callable[[str, int], None] | None = None,
        on_stop: Callable[[], object] | None = None,
        parent_pid: int | None = None,
        watch_interval: float = 1.0,
    ) -> None:
        self.role = role
        self.rank = rank
        self.grace_s = grace_s
        self.stop_event = threading.Event()
        self.exit_code = EXIT_CLEAN
        self._setup_logging = setup_logging
        self._on_stop = on_stop
        self._parent_pid = parent_pid
        self._watch_interval = watch_interval
        self._cleanups: list[tuple[str, Callable[[], object]]] = []
        self._watcher: ParentWatcher | None = None

    def request_stop(self) -> None:
        """Ask the body to stop (signal handlers and the parent watcher call this; any thread may)."""
        self.stop_event.set()
        if self._on_stop is not None:
            self._on_stop()

    def cleanup(self, what: str, fn: Callable[[], object]) -> None:
        """Run ``fn`` at exit (last registered first); a failing one is logged and the rest still run."""
        self._cleanups.append((what, fn))

    def fail(self, code: int = EXIT_FAILURE) -> None:
        """End the process with ``code`` once the body and the clean-ups are done."""
        if code == EXIT_CLEAN:
            raise ValueError("fail() needs a non-zero exit code")
        self.exit_code = code

    def __enter__(self) -> "ProcessEntry":
        if self._setup_logging is not None:
            self._setup_logging(self.role, self.rank)
        parent_pid = self._parent_pid if self._parent_pid is not None else spawning_parent_pid()
        install_shutdown_handlers(self.request_stop)
        set_parent_death_signal(PARENT_DEATH_SIGNAL, parent_pid=parent_pid)
        self._watcher = ParentWatcher(interval=self._watch_interval, callback=self.request_stop,
                                      parent_pid=parent_pid)
        self._watcher.start()
        ShutdownDeadline(self.stop_event, self.grace_s).start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 _tb: TracebackType | None) -> bool:
        if isinstance(exc, Exception):
            logger.error("%s (rank %d) failed: %s: %s", self.role, self.rank, type(exc).__name__, exc, exc_info=exc)
            self.exit_code = EXIT_FAILURE
        # From here the deadline runs: the clean-ups below must finish within grace_s.
        self.stop_event.set()
        if self._watcher is not None:
            self._watcher.stop()
        for what, fn in reversed(self._cleanups):
            try:
                fn()
            except Exception:  # the other clean-ups (unlinking segments, closing sockets) must still run
                logger.exception("clean-up step %r failed", what)
                self.exit_code = self.exit_code or EXIT_FAILURE
        self._cleanups.clear()
        logger.info("%s exited (rank %d, code %d)", self.role, self.rank, self.exit_code)
        if exc is not None and not isinstance(exc, Exception):
            return False  # SystemExit / KeyboardInterrupt keep their own meaning
        if self.exit_code != EXIT_CLEAN:
            raise SystemExit(self.exit_code)
        return True
