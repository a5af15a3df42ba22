"""Every environment variable fdserve reads, in one place.

Each entry: name -> (parser, default, doc). Values are read lazily, at attribute
access (``envs.FD_USE_KVCACHE_LOCK``), so a test or a parent process can set a
variable before the child reads it. Nothing else in the code base calls
``os.environ.get`` for configuration; a process that must *set* variables before
it imports paddle (thread counts) does so through ``apply_compute_thread_env``,
which then imports paddle with its start-up notices (ccache, OMP banner) filtered.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import sys
import threading
import warnings
from typing import Any, Callable

logger = logging.getLogger(__name__)


def _bool(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def _opt_str(value: str) -> str | None:
    return value or None


def _native_kernels_mode(value: str) -> str:
    mode = value.strip().lower()
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"expected auto, 0 or 1, got {value!r}")
    return mode


_VARIABLES: dict[str, tuple[Callable[[str], Any], Any, str]] = {
    "FD_USE_KVCACHE_LOCK": (_bool, False, "Hold a cross-process lock around execute_model and KV-cache transfers."),
    "FD_KVCACHE_LOCK_TIMEOUT": (float, 10.0, "Seconds a lock waiter waits before checking whether the holder died."),
    "FD_KVCACHE_LOCK_FAULT": (_opt_str, None, "TEST ONLY: '<point>[:kill|stop][@n]' makes a process SIGKILL (or "
                              "SIGSTOP) itself the n-th time (default 1) it passes <point> of the KV-cache lock: "
                              "after_sem_wait, after_claim, release_cleared, release_posted."),
    "FD_KVCACHE_SANITIZER": (_bool, False, "Check block states before every KV-cache access; fail loudly on violation."),
    "FD_KVCACHE_FAULT_EARLY_SCHEDULE": (_bool, False, "TEST ONLY: schedule a request once its prefetch/swap-in has "
                                        "started instead of finished (the race the sanitizer must catch)."),
    "FD_KVCACHE_FAULT_SLOW_FILL_S": (float, 0.0, "TEST ONLY: the cache transfer process sleeps this long between "
                                                  "announcing a fill and copying it."),
    "FD_KVCACHE_FAULT_RAISE_IN_STEP": (int, 0, "TEST ONLY: the worker raises inside the KV-cache lock bracket "
                                                "on this execute_model call (1-based; 0 = never)."),
    "FD_KVCACHE_TRANSFER_TIMEOUT": (float, 30.0, "Seconds a KV fill (swap-in/prefetch) may take before it counts "
                                                 "as a miss and the request recomputes."),
    "FD_CACHE_TRANSFER_TIMEOUT": (float, 120.0, "Seconds the cache transfer process may show no progress (its "
                                  "heartbeat stands still while one task runs, or the process is stopped) before "
                                  "the engine kills and restarts it, failing its transfers."),
    "FD_ENGINE_FAULT_RAISE_IN_UPDATE": (_opt_str, None, "TEST ONLY: the engine raises while processing the "
                                        "results of a step that holds a request whose id contains this string."),
    "FD_PD_HOLD_TTL_S": (float, 30.0, "Seconds a P/D prefill instance keeps a finished request's KV blocks for "
                         "the decode instance to read, unless the decode side releases them earlier."),
    "FD_LOG_LEVEL": (str, "INFO", "Log level of every fdserve process."),
    "FD_INSTANCE_ID": (_opt_str, None, "Namespace for shared-memory and semaphore names (default: derived from the port)."),
    "FD_NUM_THREADS": (int, 0, "Compute threads per worker (0: the cores available to the process)."),
    "FD_MKL_CPU_TYPE": (int, 0, "MKL_DEBUG_CPU_TYPE given to compute processes (0: 7, MKL's AVX-512 path, "
                                "when the CPU has AVX-512 F/CD/BW/DQ/VL, else 5, its AVX2 path)."),
    "FD_HEARTBEAT_TIMEOUT": (float, 120.0, "Seconds without a worker heartbeat before the engine declares it dead."),
    "FD_WORKER_STEP_TIMEOUT": (float, 600.0, "Seconds the engine waits for one execute_model step before failing requests."),
    "FD_API_KEY": (_opt_str, None, "If set, the API requires 'Authorization: Bearer <key>'."),
    "FD_MAX_REQUEST_BYTES": (int, 8 * 1024 * 1024, "Largest accepted HTTP request body in bytes."),
    "FD_STORAGE_LOOKUP_TIMEOUT_S": (float, 0.05, "Seconds the engine waits for the storage tier to say which of a "
                                    "request's blocks it holds; a slower answer counts as a miss, not a stall."),
    "FILE_BACKEND_STORAGE_DIR": (_opt_str, None, "Directory of the file KV-cache storage backend."),
    "MOONCAKE_MASTER_SERVER_ADDR": (_opt_str, None, "host:port of the Mooncake master."),
    "MOONCAKE_METADATA_SERVER": (str, "P2PHANDSHAKE", "Mooncake metadata server."),
    "MOONCAKE_PROTOCOL": (str, "tcp", "Mooncake transfer protocol."),
    "MOONCAKE_GLOBAL_SEGMENT_SIZE": (int, 512 << 20, "Bytes of memory this process contributes to the Mooncake store."),
    "MOONCAKE_LOCAL_BUFFER_SIZE": (int, 64 << 20, "Bytes of the Mooncake client's local transfer buffer."),
    "MOONCAKE_LOCAL_HOSTNAME": (str, "127.0.0.1", "Address other Mooncake clients reach this process at."),
    "FD_KVCACHE_STORAGE_NAMESPACE": (str, "fdserve", "Namespace (directory / key prefix) of this server's "
                                     "objects in the KV-cache storage tier; clear() removes only it."),
    "FD_SHUTDOWN_DRAIN_S": (float, 5.0, "Seconds a stopping server lets requests in flight finish before it "
                                        "ends them with an error (new requests get 503 meanwhile)."),
    "FD_METRICS_ENGINE_TIMEOUT": (float, 1.0, "Seconds GET /metrics waits for the engine's cache_stats reply "
                                  "before serving the previous values."),
    "FD_NATIVE_KERNELS": (_native_kernels_mode, "auto", "Native C++ CPU kernels (worker/kernels): 'auto' builds "
                          "and uses them where possible, falling back to the Paddle ops (logged once) when the "
                          "compiler or a needed CPU feature is missing or the build fails; '0' never uses them; "
                          "'1' uses them and fails loudly when they are unavailable."),
    "FD_KERNEL_CACHE_DIR": (_opt_str, None, "Directory of compiled native kernels, one entry per hash of sources, "
                            "flags, Paddle and compiler version (default: ~/.cache/fdserve/kernels)."),
}


def __getattr__(name: str) -> Any:
    if name not in _VARIABLES:
        raise AttributeError(f"envs has no variable {name!r}")
    parser, default, _doc = _VARIABLES[name]
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parser(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not a valid {parser.__name__}") from exc


def check_all() -> None:
    """Parse every variable that is set, so a bad value fails at start-up (launch.py prints the
    ValueError, which names the variable, as one line) rather than later in a child process."""
    for name in _VARIABLES:
        __getattr__(name)


def describe() -> list[tuple[str, Any, str]]:
    """(name, default, doc) for every variable, for --help and the README."""
    return [(name, default, doc) for name, (_p, default, doc) in _VARIABLES.items()]


_AVX512_FLAGS = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})


def cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags of the first CPU listed in ``cpuinfo_path`` (empty if unreadable)."""
    try:
        with open(cpuinfo_path, encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        return frozenset()  # no procfs: the caller falls back to the AVX2 path
    return frozenset()


def mkl_cpu_type(flags: frozenset[str] | None = None) -> int:
    """The MKL code path for this CPU.

    MKL picks a slow generic path on AMD CPUs unless told otherwise. On these Zen
    machines type 5 (AVX2) made GEMMs ~3x faster than the default, and type 7
    (AVX-512, needs F/CD/BW/DQ/VL) made batch-32 decode steps faster again while
    the greedy float32 outputs still match the reference. Type 6 (AVX-512 MIC)
    is never chosen: it is for Xeon Phi.
    """
    configured = __getattr__("FD_MKL_CPU_TYPE")
    if configured:
        return configured
    if flags is None:
        flags = cpu_flags()
    return 7 if _AVX512_FLAGS <= flags else 5


def compute_thread_env(num_threads: int) -> dict[str, str]:
    """Variables a process must have before it imports paddle (ARCHITECTURE.md, CPU facts)."""
    return {
        "OMP_NUM_THREADS": str(num_threads),
        "MKL_NUM_THREADS": str(num_threads),
        "MKL_DEBUG_CPU_TYPE": str(mkl_cpu_type()),
    }


# Paddle's import-time notices that tell a server's user nothing: ``paddle.base`` prints this two-line
# banner to stderr whenever OMP_NUM_THREADS > 1 (which fdserve sets on purpose, for speed), and
# ``paddle.utils.cpp_extension`` warns that ccache is missing (it matters only when building custom
# C++ operators). Everything else paddle prints at import still goes through.
_PADDLE_IMPORT_BANNER = ("WARNING: OMP_NUM_THREADS set to", "PLEASE USE OMP_NUM_THREADS WISELY.")
_PADDLE_CCACHE_WARNING = r"No ccache found"


def apply_compute_thread_env(num_threads: int) -> None:
    """Set the thread variables in this process, then import paddle without its start-up notices.

    The variables must be in place before paddle is first imported (ARCHITECTURE.md, CPU facts), so
    this is also the one place that imports it for a compute process; later ``import paddle``
    statements find it loaded. If paddle was already imported, the variables came too late: say so.
    The process's SIGTERM handler survives the import (paddle would replace it).
    """
    os.environ.update(compute_thread_env(num_threads))
    if "paddle" in sys.modules:
        logger.warning("paddle was imported before the compute thread variables were set; "
                       "OMP_NUM_THREADS=%d may not apply", num_threads)
        return
    warnings.filterwarnings("ignore", message=_PADDLE_CCACHE_WARNING, category=UserWarning)
    sigterm_handler = signal.getsignal(signal.SIGTERM)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            import paddle  # noqa: F401  (loaded here so the notices above are filtered)
    finally:
        # Whatever paddle printed besides the banner (or before failing to import) is passed on.
        sys.stderr.writelines(line for line in captured.getvalue().splitlines(keepends=True)
                              if not line.startswith(_PADDLE_IMPORT_BANNER))
    # Importing paddle installs its C++ SIGTERM handler, which prints a "FatalError: Termination signal"
    # block and aborts, over the process's own shutdown handler (still listed by getsignal, no longer
    # called). Put the process's handler back; paddle keeps its crash handlers (SIGSEGV, SIGABRT, ...).
    if sigterm_handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, sigterm_handler)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
