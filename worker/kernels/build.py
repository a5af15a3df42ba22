"""Building, caching and loading native C++ kernels as Paddle custom operators.

This module owns the kernel *build infrastructure*: ``load_extension`` compiles a set of
C++ sources with ``paddle.utils.cpp_extension.load`` into a cache entry keyed by a hash of
everything the binary depends on (source contents, flags, Paddle version and commit, compiler
version, Python version, CPU flags since kernels are built with ``-march=native``), and loads it.
It also owns the CPU-feature helper (``cpu_has``) kernels use to decide whether they can run.

- Cache: ``FD_KERNEL_CACHE_DIR`` (default ``~/.cache/fdserve/kernels``), one directory per
  entry, ``<name>-<key>/``. An entry counts only once its ``complete.json`` stamp names the
  SHA-256 of the built library; a missing stamp or a library whose hash differs (a build killed
  half way, a corrupted file) is removed and rebuilt.
- Concurrency: an exclusive ``fcntl`` lock per entry, held while checking and building, so
  several workers starting together compile once and the others load the result.
- The compile runs in a child Python process (Paddle's ``load`` itself shells out to a
  setuptools build), so its output is captured into ``build.log`` and quoted when it fails,
  instead of landing on the worker's stderr.
- Fallback: ``load_extension`` returns None, logging the reason once per extension, when
  ``FD_NATIVE_KERNELS=0``, the compiler is missing, the CPU lacks a required feature or the
  build fails. With ``FD_NATIVE_KERNELS=1`` each of these raises ``NativeKernelUnavailable``.
- OpenMP: kernels compile with -fopenmp but link Paddle's libiomp5 (``openmp_ldflags``), the runtime
  its MKL matmuls already run on, so both share one thread pool. libiomp5 lacks gcc's
  ``GOMP_loop_nonmonotonic_*`` entry points (``omp for schedule(dynamic)``); a library calling them
  is refused at build time.
- A library is loaded at most once per process (Paddle registers its operators globally and
  a second registration of the same operators returns a module without them), so results,
  including failures, are memoised per process.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Iterator, Sequence

import envs

logger = logging.getLogger(__name__)

# Flags every kernel is compiled with: built for the host CPU (the cache key includes its flags) and
# parallelised with OpenMP.
BASE_CFLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fopenmp", "-std=c++17")
# Bound on one build (a cold build of a small kernel takes ~10-30 s on 2 cores); a hung compiler must
# not hold the cache lock, and with it every other worker, forever.
BUILD_TIMEOUT_S = 900.0
# gcc emits these for "omp for schedule(dynamic|guided|runtime)"; libiomp5 has no such entry points, so they
# would bind to libgomp, a different runtime than the one running the parallel region. Refused at build time.
_IOMP_MISSING_ENTRY = b"GOMP_loop_nonmonotonic"
_STAMP = "complete.json"
_BUILD_LOG = "build.log"
_LOG_TAIL_CHARS = 2000


class NativeKernelUnavailable(RuntimeError):
    """A native kernel cannot be used, and FD_NATIVE_KERNELS=1 asked for it to be."""


@dataclass(frozen=True)
class BuildResult:
    """What one ``load_extension`` call did, for tests and benchmarks (``last_build``)."""

    name: str
    entry: Path | None
    compiled: bool  # False: loaded from the cache (or not loaded at all)
    seconds: float
    reason: str | None  # why the extension is unavailable; None when it loaded


_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}  # entry key -> module (None: unavailable, already logged)
_results: dict[str, BuildResult] = {}  # extension name -> last result


# --------------------------------------------------------------------------- CPU features


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The host CPU's feature flags (``/proc/cpuinfo``, read once per process)."""
    return envs.cpu_flags()


def cpu_has(*features: str) -> bool:
    """True when the CPU lists every one of ``features`` (e.g. ``cpu_has("avx512_bf16")``)."""
    return set(features) <= cpu_flags()


# --------------------------------------------------------------------------- public API


def native_kernels_enabled() -> bool:
    """False when FD_NATIVE_KERNELS=0 (callers may skip even building their inputs)."""
    return envs.FD_NATIVE_KERNELS != "0"


def openmp_ldflags() -> list[str]:
    """Link kernels against the OpenMP runtime Paddle's MKL uses (libiomp5, which also serves the GOMP_*
    entry points gcc emits), so kernels and MKL share one thread pool. With libgomp (-fopenmp) the two
    runtimes' threads compete for the cores: MKL's keep spinning ~200 ms after each matmul while the
    kernel's wait for a core. Paddle builds without libiomp5 get libgomp."""
    import paddle

    libs = Path(paddle.__file__).parent / "libs"
    if (libs / "libiomp5.so").is_file():
        return [f"-L{libs}", "-l:libiomp5.so", f"-Wl,-rpath,{libs}"]
    return ["-fopenmp"]


def cache_root() -> Path:
    configured = envs.FD_KERNEL_CACHE_DIR
    return Path(configured) if configured else Path.home() / ".cache" / "fdserve" / "kernels"


def load_extension(
    name: str,
    sources: Sequence[str],
    extra_cflags: Sequence[str] = (),
    extra_ldflags: Sequence[str] = (),
    required_cpu_flags: Sequence[str] = (),
) -> ModuleType | None:
    """Build (or find in the cache) and load the custom operators in ``sources``.

    Returns the module whose attributes are the operators, or None when native kernels are
    unavailable (reason logged once; raises ``NativeKernelUnavailable`` under FD_NATIVE_KERNELS=1).
    ``required_cpu_flags`` are /proc/cpuinfo flags the kernels need (checked before building).
    """
    mode = envs.FD_NATIVE_KERNELS
    if mode == "0":
        return _unavailable(name, "FD_NATIVE_KERNELS=0", mode, key="disabled:" + name)
    missing = sorted(set(required_cpu_flags) - cpu_flags())
    if missing:
        return _unavailable(name, f"the CPU lacks {', '.join(missing)}", mode, key="isa:" + name)
    compiler = _compiler()
    if compiler is None:
        return _unavailable(name, "no C++ compiler found (g++ / build-essential)", mode, key="cxx:" + name)

    cflags = list(BASE_CFLAGS) + list(extra_cflags)
    ldflags = openmp_ldflags() + list(extra_ldflags)
    paths = [str(Path(source).resolve()) for source in sources]
    key = _entry_key(name, paths, cflags, ldflags, compiler)
    with _lock:  # threads of one process: one loader at a time (the file lock is per process)
        if key in _loaded:
            module = _loaded[key]
            if module is None and mode == "1":
                raise NativeKernelUnavailable(f"native kernel {name}: {_results[name].reason}")
            return module
        module = _load_or_build(name, key, paths, cflags, ldflags)
        _loaded[key] = module
    if module is None and mode == "1":
        raise NativeKernelUnavailable(f"native kernel {name}: {_results[name].reason}")
    return module


class Extension:
    """One kernel library of this package, built or taken from the cache on its first use in a process.

    ``load()`` is the module of operators, or None where native kernels are unavailable. FD_NATIVE_KERNELS=0
    is read again on every call (not remembered), so a benchmark can switch the kernels off and on in one process.
    """

    def __init__(self, name: str, sources: Sequence[str | Path], required_cpu_flags: Sequence[str] = ()) -> None:
        self.name = name
        self.sources = [str(source) for source in sources]
        self.required_cpu_flags = tuple(required_cpu_flags)
        self._module: ModuleType | None = None
        self._tried = False

    def load(self) -> ModuleType | None:
        if not native_kernels_enabled():
            return None
        if not self._tried:
            self._module = load_extension(self.name, self.sources, required_cpu_flags=self.required_cpu_flags)
            self._tried = True
        return self._module

    def available(self) -> bool:
        return self.load() is not None


def last_build(name: str) -> BuildResult | None:
    """What the last ``load_extension(name, ...)`` of this process did (None: never called)."""
    return _results.get(name)


# --------------------------------------------------------------------------- internals


_reported: set[str] = set()


def _unavailable(name: str, reason: str, mode: str, key: str) -> None:
    _results[name] = BuildResult(name, None, False, 0.0, reason)
    if mode == "1":
        raise NativeKernelUnavailable(f"native kernel {name}: {reason}")
    if key not in _reported:  # once per extension and reason, not once per call
        _reported.add(key)
        logger.warning("native kernel %s unavailable, using the Paddle fallback: %s", name, reason)
    return None


def _compiler() -> str | None:
    """Path of the C++ compiler the setuptools build will run, or None when it is not on PATH."""
    configured = sysconfig.get_config_var("CXX") or "g++"
    return shutil.which(configured.split()[0])


@functools.lru_cache(maxsize=4)
def _compiler_version(compiler: str) -> str:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


def _paddle_identity() -> str:
    import paddle

    commit = getattr(paddle.version, "commit", "")
    return f"{paddle.__version__}:{commit}"


def _entry_key(name: str, sources: list[str], cflags: list[str], ldflags: list[str], compiler: str) -> str:
    digest = hashlib.sha256()
    for part in (name, _paddle_identity(), _compiler_version(compiler), platform.python_version(),
                 " ".join(cflags), " ".join(ldflags), " ".join(sorted(cpu_flags()))):
        digest.update(part.encode() + b"\0")
    for source in sources:
        digest.update(Path(source).name.encode() + b"\0")
        digest.update(Path(source).read_bytes())
    return f"{name}-{digest.hexdigest()[:20]}"


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # blocks while another process builds this entry
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load_or_build(name: str, key: str, sources: list[str], cflags: list[str], ldflags: list[str]) -> ModuleType | None:
    root = cache_root()
    entry = root / key
    started = time.perf_counter()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _file_lock(root / f"{key}.lock"):
            compiled = False
            if not _entry_complete(entry, name):
                shutil.rmtree(entry, ignore_errors=True)
                _build(name, entry, sources, cflags, ldflags)
                compiled = True
            module = _import(name, entry)
    except (OSError, ImportError, RuntimeError, subprocess.SubprocessError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        return _unavailable(name, reason, envs.FD_NATIVE_KERNELS, key=f"build:{key}")
    seconds = time.perf_counter() - started
    _results[name] = BuildResult(name, entry, compiled, seconds, None)
    if compiled:
        logger.info("native kernel %s compiled in %.1f s into %s", name, seconds, entry)
    return module


def _library(entry: Path, name: str) -> Path:
    return entry / name / f"{name}.so"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _entry_complete(entry: Path, name: str) -> bool:
    """True when the entry was fully built and its library is the one the build produced."""
    stamp, library = entry / _STAMP, _library(entry, name)
    if not stamp.is_file() or not library.is_file():
        if entry.exists():
            logger.warning("native kernel cache entry %s is incomplete; rebuilding", entry)
        return False
    try:
        recorded = json.loads(stamp.read_text())["sha256"]
    except (ValueError, KeyError, TypeError):
        recorded = None
    if recorded != _sha256(library):
        logger.warning("native kernel cache entry %s does not match its stamp (corrupt); rebuilding", entry)
        return False
    return True


# The child process runs Paddle's JIT build; it imports the built library too (Paddle's load does),
# which checks that it links before the parent records it as complete.
_BUILD_SCRIPT = """
import json, sys
from paddle.utils.cpp_extension import load
name, build_dir, sources, cflags, ldflags = json.loads(sys.argv[1])
load(name, sources, extra_cxx_cflags=cflags, extra_ldflags=ldflags, build_directory=build_dir, verbose=True)
"""


def _build(name: str, entry: Path, sources: list[str], cflags: list[str], ldflags: list[str]) -> None:
    entry.mkdir(parents=True)
    log_path = entry / _BUILD_LOG
    arguments = json.dumps([name, str(entry), sources, cflags, ldflags])
    with open(log_path, "wb") as log:
        try:
            process = subprocess.run([sys.executable, "-c", _BUILD_SCRIPT, arguments], cwd=entry, stdout=log,
                                     stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"build timed out after {BUILD_TIMEOUT_S:.0f} s (log: {log_path})") from exc
    library = _library(entry, name)
    if process.returncode != 0 or not library.is_file():
        tail = log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        raise RuntimeError(f"build failed (exit {process.returncode}, log: {log_path}):\n{tail}")
    if "-l:libiomp5.so" in ldflags and _IOMP_MISSING_ENTRY in library.read_bytes():
        raise RuntimeError(f"{name} calls {_IOMP_MISSING_ENTRY.decode()}* (an OpenMP dynamic/guided/runtime "
                           "schedule), which libiomp5 lacks; distribute the work by hand or use schedule(static) "
                           "or schedule(monotonic: dynamic)")
    (entry / _STAMP).write_text(json.dumps({"sha256": _sha256(library), "sources": sources,
                                            "cflags": cflags, "ldflags": ldflags}))


def _import(name: str, entry: Path) -> ModuleType:
    # Paddle's loader (what ``load`` runs after compiling): registers the library's operators and returns a
    # module with one Python function per operator. Its INFO chatter ("using custom operator only") is muted.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="No ccache found")  # matters only to the build
        from paddle.utils.cpp_extension.extension_utils import _import_module_from_library

    paddle_logger = logging.getLogger("utils.cpp_extension")
    level = paddle_logger.level
    paddle_logger.setLevel(logging.WARNING)
    try:
        return _import_module_from_library(name, str(entry / name))
    finally:
        paddle_logger.setLevel(level)
