"""The cross-process KV-cache lock (``FD_USE_KVCACHE_LOCK``), one per DP rank.

This module owns the lock that serialises ``execute_model`` in the worker against KV-cache
copies in the cache-transfer process (swap, storage write-back, prefetch), its shared owner
record and counters, and the recovery of a lock whose holder died. Correctness of fdserve does
not depend on it (block states do); it is defence in depth and must be cheap.

Objects (instance ``I``, DP rank ``r``):

- ``fd.I.kvcache_lock.r`` -- POSIX named semaphore, initial value 1, mode 0600 (``sem.fd.I...``
  in /dev/shm). Its single unit *is* the lock.
- ``fd.I.kvcache_lock_record.r`` -- a small int64 shared-memory record: owner pid, owner
  thread, owner start time, owner role code, acquire time (CLOCK_MONOTONIC ns, system-wide on
  Linux), a generation number bumped on every acquisition, and the counters read by ``stats()``.
  "No owner recorded" means owner pid 0; a release zeroes all four owner fields.
- The *guard*: ``flock`` on the record segment's file. Every write of the record happens under
  it. A second semaphore as guard would have the very problem we solve here (a process killed
  while holding it blocks everybody); the kernel drops an ``flock`` when its holder dies, so
  the guard can never be orphaned. ``flock`` belongs to an open file description, not to a
  thread, so threads of one process are serialised by a ``threading.Lock`` in front of it. It is
  held for a few microseconds of straight-line code.

Protocol:

- Fast path (uncontended): under the guard, ``sem.acquire(0)``; on success write the owner
  record before leaving the guard. Holding the lock without a recorded owner is therefore only
  possible for a process that dies inside that guard section.
- Release: under the guard, add the hold time, clear every owner field, ``sem.release()``.
  Clearing and posting are one step for anyone who looks at the record under the guard; a
  holder killed between the two (inside the guard) leaves an ownerless taken lock, recovered
  like the claim window below.
- Slow path: block in ``sem.acquire(T)`` (``T`` = ``FD_KVCACHE_LOCK_TIMEOUT``; never spins).
  On success the waiter "claims" its unit under the guard (records itself). Each time a full
  period ``T`` passes without the unit, the waiter looks at the record:
  * owner recorded and alive (pid + start time, so a reused pid does not count): keep waiting,
    log a warning (at most one per period);
  * owner recorded and dead: recover. Under the guard, compare-and-swap: if the record still
    names the same owner pid and generation (the pair names one hold; the generation changes on
    every acquisition), that owner is still dead and the semaphore is still 0, write ourselves as
    owner. The semaphore is not touched: the dead process's unit simply becomes ours, so its
    value never exceeds 1. Two waiters that detect the same dead owner serialise on the guard;
    the second sees the record changed and keeps waiting -- only one proceeds;
  * no owner recorded (pid 0) while the semaphore is taken: some process is between
    ``sem_wait`` returning and its claim, or died in release between clearing and posting. If
    the record stays ownerless with the same generation for a whole further period ``T``, that
    process died there (a claim takes microseconds): recover as above (expecting pid 0 and that
    generation, whatever was held before), and stamp ``last ownerless recovery`` with the time.
- A live waiter that was merely *stalled* between ``sem_wait`` and its claim for that long would
  now find, under the guard, either another owner recorded or an ownerless recovery stamped at
  or after the moment it woke. It then knows its unit was handed to the recoverer: it does not
  record itself and does not post (the recoverer's release returns the unit), and waits again
  (counted in ``handed_over``). The one residual gap: a process stopped for at least 2*T between
  ``sem_wait`` returning and reading the clock right after it (re-taking the GIL, one bytecode)
  would miss the stamp. With the default T of 10 s this needs a process frozen (SIGSTOP, swap
  storm, another thread keeping the GIL) for 20 s at that exact point. The stamp and the wake
  time are CLOCK_MONOTONIC readings, comparable across the processes of one host.

The lock is not fair: a releasing process may take it again before a woken waiter runs. The
worker releases between steps and then waits for its next batch, which leaves waiters room.

A holder that dies between taking the semaphore and writing its owner record, or inside
release between clearing it and posting, therefore costs waiters about 2*T, then one of them
recovers the lock and logs it; it never deadlocks. A live holder that is just slow is never
robbed.

Identity: a holder is its pid plus its start time read from /proc (so a pid reused after the
holder died is not taken for it). A handle is refused (``KVCacheLockError`` at create/attach)
when the process cannot read its own start time, so no owner is ever recorded without one. If
/proc becomes unreadable later, a waiter recovers from an owner whose pid no longer exists
(signal 0) but never from one whose pid exists: it logs an error each period and keeps waiting,
because it cannot tell the live holder from a reused pid.

Fault injection (tests only): ``FD_KVCACHE_LOCK_FAULT=<point>[:kill|stop][@n]`` makes a process
send itself SIGKILL or SIGSTOP the n-th time one handle passes a point: ``after_sem_wait`` (unit
taken, owner not recorded; inside the guard on the fast path, outside it after a blocking wait),
``after_claim`` (owner recorded, guard dropped), ``release_cleared`` (owner cleared, not yet
posted, inside the guard), ``release_posted`` (posted, still inside the guard). SIGSTOP inside
the guard freezes every user of the lock for as long as the process stays stopped.

Misuse raises ``KVCacheLockError`` (never ``assert``, which ``python -O`` strips): release by a
thread or process that does not hold it, re-entrant acquire by the holding thread (also through
a second handle on the same lock), use after ``close()``, use of a handle inherited across
``fork`` (the guard's file description would be shared with the parent).
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import threading
import time
import weakref
from types import TracebackType
from typing import Any

import numpy as np
import posix_ipc

import envs
from inter_communicator.process_utils import PROC_ROOT, ProcUnreadableError, pid_start_time, process_alive
from inter_communicator.shm import SharedArray, ipc_name, register_created_semaphore

logger = logging.getLogger(__name__)

LOCK_NAME = "kvcache_lock"
RECORD_NAME = "kvcache_lock_record"
# Role codes are the index + 1 (0 means "no owner"); the record stores the code.
ROLES = ("engine", "launch", "worker", "cache_transfer", "metrics", "benchmark", "test")

# Record layout (int64 fields).
_F_MAGIC = 0
_F_OWNER_PID = 1
_F_OWNER_TID = 2
_F_OWNER_START = 3
_F_OWNER_ROLE = 4
_F_ACQUIRED_NS = 5
_F_GENERATION = 6
_F_ACQUISITIONS = 7
_F_CONTENDED = 8
_F_WAIT_NS_TOTAL = 9
_F_HOLD_NS_TOTAL = 10
_F_MAX_WAIT_NS = 11
_F_MAX_HOLD_NS = 12
_F_RECOVERIES = 13
_F_HANDED_OVER = 14
_F_LAST_OWNERLESS_RECOVERY_NS = 15
_NUM_FIELDS = 16
_MAGIC = 0x46444B564C4B3031  # "FDKVLK01": layout version, checked on attach

_NS_PER_S = 1_000_000_000

_COUNTERS = {
    "generation": _F_GENERATION,
    "acquisitions": _F_ACQUISITIONS,
    "contended": _F_CONTENDED,
    "wait_ns_total": _F_WAIT_NS_TOTAL,
    "hold_ns_total": _F_HOLD_NS_TOTAL,
    "max_wait_ns": _F_MAX_WAIT_NS,
    "max_hold_ns": _F_MAX_HOLD_NS,
    "recoveries": _F_RECOVERIES,
    "handed_over": _F_HANDED_OVER,
}


class KVCacheLockError(RuntimeError):
    """Misuse of the KV-cache lock, or a broken lock state."""


class KVCacheLockTimeout(KVCacheLockError):
    """``hold(..., timeout=...)`` did not get the lock in time."""


# Test-only fault points (FD_KVCACHE_LOCK_FAULT), in protocol order.
FAULT_POINTS = ("after_sem_wait", "after_claim", "release_cleared", "release_posted")
_FAULT_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


class _Fault:
    """A test-only fault: the process sends itself SIGKILL (dies) or SIGSTOP (freezes, alive) the
    ``nth`` time this handle passes ``point``. Real signals, so recovery is tested against what a
    crash or a frozen process really leaves behind (guard dropped by the kernel or kept)."""

    __slots__ = ("point", "action", "nth", "passes")

    def __init__(self, spec: str) -> None:
        body, _, nth = spec.strip().partition("@")
        point, _, action = body.partition(":")
        action = action or "kill"
        if point not in FAULT_POINTS or action not in _FAULT_SIGNALS:
            raise ValueError(f"FD_KVCACHE_LOCK_FAULT={spec!r}: expected <point>[:kill|stop][@n] with point one of "
                             f"{FAULT_POINTS}")
        self.point, self.action = point, action
        self.nth = int(nth) if nth else 1
        if self.nth < 1:
            raise ValueError(f"FD_KVCACHE_LOCK_FAULT={spec!r}: n must be >= 1")
        self.passes = 0

    def hit(self, point: str) -> None:
        if point != self.point:
            return
        self.passes += 1
        if self.passes == self.nth:
            logger.warning("kvcache lock fault injection: pid %d sends itself SIG%s at %s (pass %d)", os.getpid(),
                           self.action.upper(), point, self.passes)
            os.kill(os.getpid(), _FAULT_SIGNALS[self.action])


# Handles of this process, so a forked child can disable the ones it inherited.
_live_locks: "weakref.WeakSet[KVCacheLock]" = weakref.WeakSet()
# gettid() costs a system call; cache it per thread (reset in a forked child).
_thread_ids = threading.local()


def _native_thread_id() -> int:
    try:
        return _thread_ids.tid
    except AttributeError:
        _thread_ids.tid = threading.get_native_id()
        return _thread_ids.tid


def _after_fork_in_child() -> None:
    global _thread_ids
    _thread_ids = threading.local()
    for lock in list(_live_locks):
        lock._unusable = "handle inherited across fork; attach a new one in the child process"


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _role_code(role: str) -> int:
    if role not in ROLES:
        raise ValueError(f"unknown kvcache lock role {role!r}; expected one of {ROLES}")
    return ROLES.index(role) + 1


def _role_name(code: int) -> str | None:
    return ROLES[code - 1] if 1 <= code <= len(ROLES) else None


def _check_timeout(timeout: float) -> float:
    timeout = float(timeout)
    if not timeout > 0:
        raise ValueError(f"kvcache lock timeout must be a positive number of seconds, got {timeout}")
    return timeout


class _Holding:
    """The context manager returned by ``KVCacheLock.hold``."""

    __slots__ = ("_lock", "_what", "_timeout")

    def __init__(self, lock: "KVCacheLock", what: str, timeout: float | None) -> None:
        self._lock = lock
        self._what = what
        self._timeout = timeout

    def __enter__(self) -> "KVCacheLock":
        if not self._lock.acquire(self._timeout, self._what):
            raise KVCacheLockTimeout(f"kvcache lock {self._lock.name}: not acquired within {self._timeout}s "
                                     f"for {self._what!r}")
        return self._lock

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._lock.release()


class KVCacheLock:
    """The cross-process lock of one DP rank; see the module docstring for the protocol.

    Build it with ``create`` (launch/engine, once per rank) or ``attach`` (every user), or
    through ``kvcache_lock_for``. Callers use ``with lock.hold("execute_model"): ...``.
    """

    enabled = True

    def __init__(self, instance_id: str, dp_rank: int, role: str, *, create: bool,
                 timeout: float | None = None, proc_root: str = PROC_ROOT) -> None:
        self.role = role
        self._role_code = _role_code(role)
        self.timeout = _check_timeout(envs.FD_KVCACHE_LOCK_TIMEOUT if timeout is None else timeout)
        self._timeout_ns = int(self.timeout * _NS_PER_S)
        self.name = ipc_name(instance_id, LOCK_NAME, dp_rank)
        self.created = bool(create)
        self._pid = os.getpid()
        self._proc_root = proc_root
        self._start_time = self._own_start_time()
        spec = envs.FD_KVCACHE_LOCK_FAULT
        self._fault = _Fault(spec) if spec else None
        self._unusable: str | None = None
        self._local = threading.Lock()
        self._holder_ident: int | None = None
        self._held_generation = 0
        self._acquired_ns = 0
        self._record: SharedArray | None = None
        self._rec: memoryview | None = None
        self._guard_fd = -1
        self._sem: posix_ipc.Semaphore | None = None
        # Only names this handle really created are unlinked: a failed create() must not remove
        # the objects of the server that already owns them.
        self._sem_created = False
        try:
            self._open(ipc_name(instance_id, RECORD_NAME, dp_rank))
        except BaseException:
            self._teardown()
            if self.created:
                self.unlink()
            raise
        _live_locks.add(self)

    @classmethod
    def create(cls, instance_id: str, dp_rank: int, role: str = "engine", timeout: float | None = None,
               proc_root: str = PROC_ROOT) -> "KVCacheLock":
        """Create the semaphore and record of this rank (fails if they exist: ``sweep_stale`` first).

        The names are registered for ``shm.unlink_created``; ``unlink()`` removes them too.
        ``proc_root`` is where process start times are read (a parameter for tests).
        """
        return cls(instance_id, dp_rank, role, create=True, timeout=timeout, proc_root=proc_root)

    @classmethod
    def attach(cls, instance_id: str, dp_rank: int, role: str, timeout: float | None = None,
               proc_root: str = PROC_ROOT) -> "KVCacheLock":
        """Open the lock created by launch/engine. ``role`` is one of ``ROLES``."""
        return cls(instance_id, dp_rank, role, create=False, timeout=timeout, proc_root=proc_root)

    def _own_start_time(self) -> int:
        """This process's start time; refuses to build a handle without it (see "Identity")."""
        try:
            start = pid_start_time(self._pid, self._proc_root)
        except ProcUnreadableError as exc:
            reason = str(exc)
        else:
            if start is not None:
                return start
            reason = f"{self._proc_root}/{self._pid}/stat does not exist"
        raise KVCacheLockError(
            f"kvcache lock {self.name}: cannot read this process's start time ({reason}). The lock tells a live "
            f"holder from a dead one (or from a reused pid) by pid + start time and will not run without a "
            f"readable {self._proc_root}; mount procfs or run with FD_USE_KVCACHE_LOCK=0")

    def _open(self, record_name: str) -> None:
        self._record = SharedArray(record_name, _NUM_FIELDS, np.int64, create=self.created)
        self._rec = memoryview(self._record.array).cast("B").cast("q")
        if self.created:
            self._rec[_F_MAGIC] = _MAGIC
        elif self._rec[_F_MAGIC] != _MAGIC:
            raise ValueError(f"shared memory {record_name} is not a kvcache lock record of this version")
        shm = posix_ipc.SharedMemory("/" + record_name)
        try:
            # Our own descriptor (non-inheritable) for flock; SharedArray closed its one after mmap.
            self._guard_fd = os.dup(shm.fd)
        finally:
            shm.close_fd()
        if self.created:
            try:
                self._sem = posix_ipc.Semaphore("/" + self.name, posix_ipc.O_CREX, mode=0o600, initial_value=1)
            except posix_ipc.ExistentialError as exc:
                raise FileExistsError(f"semaphore {self.name} already exists (another server with this instance "
                                      "id, or a stale one: sweep_stale removes leftovers)") from exc
            self._sem_created = True
            register_created_semaphore(self.name)
        else:
            try:
                self._sem = posix_ipc.Semaphore("/" + self.name)
            except posix_ipc.ExistentialError as exc:
                raise FileNotFoundError(f"semaphore {self.name} does not exist (has the engine created the "
                                        "kvcache lock?)") from exc

    # --- acquire ---------------------------------------------------------------------------

    def hold(self, what: str, timeout: float | None = None) -> _Holding:
        """Context manager: acquire (waiting, recovering from a dead holder), yield, always release.

        ``what`` names the critical section in log messages. With ``timeout`` (seconds) it
        raises ``KVCacheLockTimeout`` instead of waiting longer.
        """
        return _Holding(self, what, timeout)

    def acquire(self, timeout: float | None = None, what: str = "acquire") -> bool:
        """Take the lock; False if ``timeout`` seconds passed first (None: wait as long as needed)."""
        self._check_usable()
        if self._holder_ident == threading.get_ident():
            raise KVCacheLockError(f"kvcache lock {self.name}: re-entrant acquire for {what!r} by the thread that "
                                   "already holds it (it would deadlock); release it first")
        if timeout is not None and timeout < 0:
            raise ValueError(f"acquire timeout must be >= 0 or None, got {timeout}")
        acquired = False
        with self._local:
            fcntl.flock(self._guard_fd, fcntl.LOCK_EX)
            try:
                try:
                    self._sem.acquire(0)
                except posix_ipc.BusyError:
                    pass
                else:
                    if self._fault is not None:
                        self._fault.hit("after_sem_wait")
                    self._record_claim(time.monotonic_ns(), wait_ns=0, contended=False)
                    acquired = True
            finally:
                fcntl.flock(self._guard_fd, fcntl.LOCK_UN)
        if not acquired:
            if timeout == 0:
                return False
            acquired = self._acquire_blocking(timeout, what)
        if acquired and self._fault is not None:
            self._fault.hit("after_claim")
        return acquired

    def _acquire_blocking(self, timeout: float | None, what: str) -> bool:
        self._refuse_self_deadlock(what)
        start = time.monotonic_ns()
        deadline = None if timeout is None else start + int(timeout * _NS_PER_S)
        ownerless: tuple[int, int] | None = None  # (generation, first seen) of a taken-but-unowned lock
        while True:
            period_ns = self._timeout_ns
            if deadline is not None:
                remaining = deadline - time.monotonic_ns()
                if remaining <= 0:
                    return False
                period_ns = min(period_ns, remaining)
            try:
                self._sem.acquire(period_ns / _NS_PER_S)
            except posix_ipc.BusyError:
                if period_ns < self._timeout_ns:
                    continue  # cut short by the caller's deadline: no full period to judge the owner by
                taken, ownerless = self._after_period(start, what, ownerless)
                if taken:
                    return True
                continue
            except posix_ipc.SignalError:
                logger.debug("kvcache lock %s: wait interrupted by a signal; waiting again", self.name)
                continue
            woke_ns = time.monotonic_ns()
            if self._fault is not None:
                # After reading the clock: a process frozen here is one the hand-over rule covers.
                self._fault.hit("after_sem_wait")
            if self._claim_woken_unit(start, woke_ns, what):
                return True

    def _refuse_self_deadlock(self, what: str) -> None:
        """The holder's thread asking again through another handle would wait for itself forever."""
        rec = self._rec
        if rec[_F_OWNER_PID] == self._pid and rec[_F_OWNER_TID] == _native_thread_id():
            raise KVCacheLockError(f"kvcache lock {self.name}: re-entrant acquire for {what!r}: this thread already "
                                   "holds the lock through another handle (it would deadlock)")

    def _after_period(self, start: int, what: str,
                      ownerless: tuple[int, int] | None) -> tuple[bool, tuple[int, int] | None]:
        """One full period passed without the lock: judge the owner. Returns (acquired, ownerless)."""
        rec = self._rec
        # Unguarded reads (may be torn): _recover re-checks under the guard before acting.
        pid, owner_start, generation = rec[_F_OWNER_PID], rec[_F_OWNER_START], rec[_F_GENERATION]
        now = time.monotonic_ns()
        if pid == 0:
            if ownerless is None or ownerless[0] != generation:
                logger.info("kvcache lock %s: taken but no owner recorded (a claim in progress?); %s rechecks in "
                            "%.1fs", self.name, what, self.timeout)
                return False, (generation, now)
            if now - ownerless[1] < self._timeout_ns:
                return False, ownerless
            return self._recover(start, what, (0, generation)), None
        alive = self._owner_alive(pid, owner_start)
        if alive is None:
            logger.error("kvcache lock %s: %s has waited %.1fs; cannot tell whether holder pid %d is alive because "
                         "%s is unreadable, so the lock is not taken from it", self.name, what,
                         (now - start) / _NS_PER_S, pid, self._proc_root)
            return False, None
        if alive:
            held_s = (now - rec[_F_ACQUIRED_NS]) / _NS_PER_S
            logger.warning("kvcache lock %s: %s has waited %.1fs; held by pid %d (%s) for %.1fs", self.name, what,
                           (now - start) / _NS_PER_S, pid, _role_name(rec[_F_OWNER_ROLE]), held_s)
            return False, None
        return self._recover(start, what, (pid, generation)), None

    def _owner_alive(self, pid: int, owner_start: int) -> bool | None:
        """Whether the recorded owner still runs; None if that cannot be known (procfs unreadable
        and the pid exists: it may be reused, or the live owner)."""
        try:
            return process_alive(pid, owner_start or None, self._proc_root)
        except ProcUnreadableError:
            return None

    def _recover(self, start: int, what: str, expected: tuple[int, int]) -> bool:
        """Take over the unit of a dead (or never recorded) holder: compare-and-swap under the guard.

        ``expected`` is (owner pid, generation): the generation is bumped by every acquisition, so
        the pair names one hold; the pid is 0 for "no owner recorded" whatever the other owner
        fields say (a holder can die inside release with some of them not yet cleared).
        """
        with self._local:
            fcntl.flock(self._guard_fd, fcntl.LOCK_EX)
            try:
                rec = self._rec
                pid, owner_start = rec[_F_OWNER_PID], rec[_F_OWNER_START]
                if (pid, rec[_F_GENERATION]) != expected:
                    return False  # another waiter recovered first, or the lock changed hands
                if self._sem.value != 0:
                    return False  # released meanwhile: the ordinary wait gets it
                if pid != 0 and self._owner_alive(pid, owner_start) is not False:
                    return False
                role = _role_name(rec[_F_OWNER_ROLE]) if pid else None
                now = time.monotonic_ns()
                rec[_F_RECOVERIES] += 1
                if pid == 0:
                    rec[_F_LAST_OWNERLESS_RECOVERY_NS] = now
                self._record_claim(now, now - start, contended=True)
            finally:
                fcntl.flock(self._guard_fd, fcntl.LOCK_UN)
        if pid:
            logger.warning("kvcache lock %s: holder pid %d (%s) is dead; recovered the lock for %s (pid %d, %s)",
                           self.name, pid, role, what, self._pid, self.role)
        else:
            logger.warning("kvcache lock %s: taken with no owner recorded for over %.1fs (a process died between "
                           "taking the semaphore and recording itself); recovered it for %s (pid %d, %s)",
                           self.name, self.timeout, what, self._pid, self.role)
        return True

    def _claim_woken_unit(self, start: int, woke_ns: int, what: str) -> bool:
        """Record ourselves as owner of the unit sem_wait gave us, unless a recovery took it over."""
        with self._local:
            fcntl.flock(self._guard_fd, fcntl.LOCK_EX)
            try:
                rec = self._rec
                owner = rec[_F_OWNER_PID]
                if owner == 0 and rec[_F_LAST_OWNERLESS_RECOVERY_NS] < woke_ns:
                    now = time.monotonic_ns()
                    self._record_claim(now, now - start, contended=True)
                    return True
                # We sat unrecorded long enough for a waiter to recover our unit: it is theirs now,
                # and their release posts it back. Posting it ourselves would make the value 2.
                rec[_F_HANDED_OVER] += 1
            finally:
                fcntl.flock(self._guard_fd, fcntl.LOCK_UN)
        logger.warning("kvcache lock %s: %s (pid %d) took the semaphore but was recovered from before recording "
                       "itself (now owned by pid %d); waiting again", self.name, what, self._pid, owner)
        return False

    def _record_claim(self, now: int, wait_ns: int, contended: bool) -> None:
        """Write this thread as owner and count the acquisition; caller holds the guard and the unit."""
        rec = self._rec
        rec[_F_OWNER_TID] = _native_thread_id()
        rec[_F_OWNER_START] = self._start_time
        rec[_F_OWNER_ROLE] = self._role_code
        rec[_F_ACQUIRED_NS] = now
        rec[_F_OWNER_PID] = self._pid
        generation = rec[_F_GENERATION] + 1
        rec[_F_GENERATION] = generation
        rec[_F_ACQUISITIONS] += 1
        if contended:
            rec[_F_CONTENDED] += 1
            rec[_F_WAIT_NS_TOTAL] += wait_ns
            if wait_ns > rec[_F_MAX_WAIT_NS]:
                rec[_F_MAX_WAIT_NS] = wait_ns
        self._holder_ident = threading.get_ident()
        self._held_generation = generation
        self._acquired_ns = now

    # --- release ---------------------------------------------------------------------------

    def release(self) -> None:
        """Release the lock; only the thread that acquired it through this handle may."""
        self._check_usable()
        holder = self._holder_ident
        if holder != threading.get_ident():
            if holder is None:
                raise KVCacheLockError(f"kvcache lock {self.name}: release() by pid {os.getpid()} which does not hold "
                                       "it (no matching acquire, or released twice)")
            raise KVCacheLockError(f"kvcache lock {self.name}: release() by thread {threading.get_ident()}, but "
                                   f"thread {holder} of this process holds it; the acquiring thread must release")
        self._release_held()

    def _release_held(self) -> None:
        with self._local:
            fcntl.flock(self._guard_fd, fcntl.LOCK_EX)
            try:
                rec = self._rec
                if rec[_F_OWNER_PID] != self._pid or rec[_F_GENERATION] != self._held_generation:
                    self._holder_ident = None
                    raise KVCacheLockError(
                        f"kvcache lock {self.name}: the owner record names pid {rec[_F_OWNER_PID]} generation "
                        f"{rec[_F_GENERATION]}, not this holder (pid {self._pid} generation "
                        f"{self._held_generation}); the lock was taken over, so it is not released here")
                held_ns = time.monotonic_ns() - self._acquired_ns
                rec[_F_HOLD_NS_TOTAL] += held_ns
                if held_ns > rec[_F_MAX_HOLD_NS]:
                    rec[_F_MAX_HOLD_NS] = held_ns
                # Every owner field goes, so the record of a released lock looks the same after any
                # number of holds (the owner pid alone is what recovery reads as "no owner").
                rec[_F_OWNER_PID] = 0
                rec[_F_OWNER_TID] = 0
                rec[_F_OWNER_START] = 0
                rec[_F_OWNER_ROLE] = 0
                self._holder_ident = None
                if self._fault is not None:
                    self._fault.hit("release_cleared")
                self._sem.release()
                if self._fault is not None:
                    self._fault.hit("release_posted")
            finally:
                fcntl.flock(self._guard_fd, fcntl.LOCK_UN)

    # --- observation and lifetime ----------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Owner and counters, readable from any process that attached.

        ``contended``, ``wait_ns_total`` and ``max_wait_ns`` count waits for the semaphore (the
        slow path); the microseconds an acquirer may spend on the guard are not counted.
        Read without the guard, so a metrics endpoint can never block on the lock: every field
        is exact, but fields may come from moments a few microseconds apart.
        """
        self._check_usable()
        values = self._rec.tolist()
        owner = values[_F_OWNER_PID]
        result: dict[str, Any] = {
            "enabled": True,
            "name": self.name,
            "semaphore_value": self._sem.value,
            "held": owner != 0,
            "owner_pid": owner,
            "owner_tid": values[_F_OWNER_TID] if owner else 0,
            "owner_role": _role_name(values[_F_OWNER_ROLE]) if owner else None,
            "held_for_ns": max(0, time.monotonic_ns() - values[_F_ACQUIRED_NS]) if owner else 0,
        }
        result.update({key: values[field] for key, field in _COUNTERS.items()})
        return result

    def close(self) -> None:
        """Drop this handle (releasing the lock first if this handle holds it). Idempotent."""
        if self._unusable is None and self._holder_ident is not None:
            logger.warning("kvcache lock %s: closed while held by this handle; releasing it", self.name)
            try:
                self._release_held()
            except KVCacheLockError as exc:
                logger.error("%s", exc)
        if self._unusable is None or self._sem is not None:
            self._unusable = "used after close()"
        self._teardown()

    def _teardown(self) -> None:
        if self._rec is not None:
            self._rec.release()
            self._rec = None
        if self._record is not None:
            self._record.close()
        if self._guard_fd >= 0:
            os.close(self._guard_fd)
            self._guard_fd = -1
        if self._sem is not None:
            self._sem.close()
            self._sem = None

    def unlink(self) -> bool:
        """Remove the semaphore and record names (creator only; idempotent). True if removed now.

        Handles that are still open keep working until closed.
        """
        if not self.created:
            logger.debug("kvcache lock %s: unlink ignored, this handle only attached", self.name)
            return False
        removed = self._record.unlink() if self._record is not None else False
        if self._sem_created:
            self._sem_created = False
            try:
                posix_ipc.unlink_semaphore("/" + self.name)
                removed = True
            except posix_ipc.ExistentialError:
                logger.debug("semaphore %s was already unlinked", self.name)
        return removed

    def _check_usable(self) -> None:
        if self._unusable is not None:
            raise KVCacheLockError(f"kvcache lock {self.name}: {self._unusable}")

    def __repr__(self) -> str:
        return f"KVCacheLock({self.name!r}, role={self.role!r}, timeout={self.timeout})"


_NULL_HOLD = contextlib.nullcontext()


class NullKVCacheLock:
    """The lock when ``FD_USE_KVCACHE_LOCK`` is off: same interface, ``hold()`` does nothing.

    No misuse checks either: they only fire with the real lock.
    """

    enabled = False

    def __init__(self, role: str = "test") -> None:
        _role_code(role)
        self.role = role
        self.name = "kvcache_lock(disabled)"

    def hold(self, what: str, timeout: float | None = None) -> contextlib.nullcontext:
        return _NULL_HOLD

    def acquire(self, timeout: float | None = None, what: str = "acquire") -> bool:
        return True

    def release(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = {"enabled": False, "name": self.name, "semaphore_value": None, "held": False,
                                  "owner_pid": 0, "owner_tid": 0, "owner_role": None, "held_for_ns": 0}
        result.update({key: 0 for key in _COUNTERS})
        return result

    def close(self) -> None:
        return None

    def unlink(self) -> bool:
        return False


def kvcache_lock_for(instance_id: str, dp_rank: int, role: str, enabled: bool | None = None,
                     timeout: float | None = None) -> KVCacheLock | NullKVCacheLock:
    """The lock a process should use: attach the real one if enabled (default: ``FD_USE_KVCACHE_LOCK``)."""
    if enabled is None:
        enabled = envs.FD_USE_KVCACHE_LOCK
    if not enabled:
        return NullKVCacheLock(role)
    return KVCacheLock.attach(instance_id, dp_rank, role, timeout=timeout)
