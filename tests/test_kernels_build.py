"""worker/kernels/build.py: native kernels compile once into the cache, load from it, rebuild a corrupt
entry, and fall back to None (one log line) when disabled, without a compiler, ISA, or on a build error.

Builds run in child processes where the test needs a fresh process (Paddle registers a library's
operators once per process); each cold build of the trivial operator takes ~10 s.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

TRIVIAL_OP = """
#include "paddle/extension.h"
std::vector<paddle::Tensor> AddOne(const paddle::Tensor& x) {
  auto out = paddle::empty_like(x);
  const float* in = x.data<float>();
  float* result = out.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i) result[i] = in[i] + 1.0f;
  return {out};
}
PD_BUILD_OP(fd_test_add_one).Inputs({"X"}).Outputs({"Out"}).SetKernelFn(PD_KERNEL(AddOne));
"""

# Loads the trivial op in a fresh process and reports what load_extension did.
CHILD = """
import json, sys
import paddle
from worker.kernels import build
module = build.load_extension("fd_test_kernel", [sys.argv[1]])
result = build.last_build("fd_test_kernel")
out = module.fd_test_add_one(paddle.to_tensor([1.0, 2.0])).numpy().tolist() if module else None
print(json.dumps({"compiled": result.compiled, "reason": result.reason, "out": out,
                  "entry": str(result.entry), "seconds": result.seconds}))
"""


def _start_child(source: Path, cache_dir: Path) -> subprocess.Popen:
    env = dict(os.environ, FD_KERNEL_CACHE_DIR=str(cache_dir), FD_NATIVE_KERNELS="auto", PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", CHILD, str(source)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)


def _child_result(proc: subprocess.Popen) -> dict:
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{stderr[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def _child_load(source: Path, cache_dir: Path) -> dict:
    return _child_result(_start_child(source, cache_dir))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("kernel_src") / "add_one.cc"
    path.write_text(TRIVIAL_OP)
    return path


@pytest.fixture(scope="module")
def concurrent_loads(tmp_path_factory, source) -> tuple[Path, list[dict]]:
    """Two child processes started together on an empty cache (like the workers of one server)."""
    cache_dir = tmp_path_factory.mktemp("kernel_cache")
    children = [_start_child(source, cache_dir) for _ in range(2)]
    try:
        results = [_child_result(child) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    return cache_dir, results


@pytest.fixture(scope="module")
def built_cache(concurrent_loads) -> tuple[Path, dict]:
    """The cache directory and the result of the child that compiled."""
    cache_dir, results = concurrent_loads
    compiled = [result for result in results if result["compiled"]]
    return cache_dir, (compiled[0] if compiled else results[0])


@pytest.mark.integration  # spawns compiler / loader processes
def test_processes_starting_together_compile_once(concurrent_loads):
    _cache_dir, results = concurrent_loads
    assert sorted(result["compiled"] for result in results) == [False, True], results
    assert results[0]["entry"] == results[1]["entry"]
    assert all(result["out"] == [2.0, 3.0] for result in results)


@pytest.fixture
def build_module(monkeypatch, tmp_path):
    """worker.kernels.build with a private cache and fresh per-process memo and log-once state."""
    from worker.kernels import build

    monkeypatch.setenv("FD_KERNEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_results", {})
    monkeypatch.setattr(build, "_reported", set())
    return build


@pytest.mark.integration  # spawns compiler / loader processes
def test_cold_build_runs_the_op(built_cache):
    _cache_dir, first = built_cache
    assert first["reason"] is None
    assert first["compiled"] is True
    assert first["out"] == [2.0, 3.0]
    assert (Path(first["entry"]) / "complete.json").is_file()


@pytest.mark.integration  # spawns compiler / loader processes
def test_second_process_loads_from_the_cache_without_compiling(built_cache, source):
    cache_dir, first = built_cache
    second = _child_load(source, cache_dir)
    assert second["compiled"] is False, second
    assert second["entry"] == first["entry"]
    assert second["out"] == [2.0, 3.0]
    assert second["seconds"] < first["seconds"]


@pytest.mark.integration  # spawns compiler / loader processes
def test_corrupt_cache_entry_is_rebuilt(built_cache, source, tmp_path):
    cache_dir, first = built_cache
    own_cache = tmp_path / "cache"
    shutil.copytree(cache_dir, own_cache)
    entry = own_cache / Path(first["entry"]).name
    library = entry / "fd_test_kernel" / "fd_test_kernel.so"
    library.write_bytes(b"not an ELF file")  # e.g. a disk error or a half-written copy
    rebuilt = _child_load(source, own_cache)
    assert rebuilt["compiled"] is True, rebuilt
    assert rebuilt["out"] == [2.0, 3.0]


def test_source_change_gets_a_new_entry(build_module, source, tmp_path):
    changed = tmp_path / "add_one.cc"
    changed.write_text(TRIVIAL_OP + "\n// changed\n")
    compiler = build_module._compiler()
    key_a = build_module._entry_key("k", [str(source)], ["-O3"], [], compiler)
    key_b = build_module._entry_key("k", [str(changed)], ["-O3"], [], compiler)
    key_c = build_module._entry_key("k", [str(source)], ["-O2"], [], compiler)
    assert len({key_a, key_b, key_c}) == 3


def _fallback_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "worker.kernels.build" and "unavailable" in r.getMessage()]


def test_disabled_returns_none_and_logs_once(build_module, source, monkeypatch, caplog):
    monkeypatch.setenv("FD_NATIVE_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger="worker.kernels.build"):
        assert build_module.load_extension("fd_test_kernel", [str(source)]) is None
        assert build_module.load_extension("fd_test_kernel", [str(source)]) is None
    records = _fallback_records(caplog)
    assert len(records) == 1 and "FD_NATIVE_KERNELS=0" in records[0].getMessage()
    assert not build_module.native_kernels_enabled()


def test_missing_compiler_returns_none_and_logs_once(build_module, source, monkeypatch, caplog, tmp_path):
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    with caplog.at_level(logging.INFO, logger="worker.kernels.build"):
        assert build_module.load_extension("fd_test_kernel", [str(source)]) is None
        assert build_module.load_extension("fd_test_kernel", [str(source)]) is None
    records = _fallback_records(caplog)
    assert len(records) == 1 and "compiler" in records[0].getMessage()
    assert not (tmp_path / "cache").exists()  # nothing was attempted


def test_missing_compiler_with_mode_1_fails_loudly(build_module, source, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("FD_NATIVE_KERNELS", "1")
    with pytest.raises(build_module.NativeKernelUnavailable, match="compiler"):
        build_module.load_extension("fd_test_kernel", [str(source)])


def test_missing_cpu_feature_returns_none(build_module, source, caplog):
    with caplog.at_level(logging.INFO, logger="worker.kernels.build"):
        module = build_module.load_extension("fd_test_kernel", [str(source)], required_cpu_flags=["no_such_isa"])
    assert module is None
    assert "no_such_isa" in _fallback_records(caplog)[0].getMessage()


@pytest.mark.integration  # spawns compiler / loader processes
def test_build_error_returns_none_with_the_compiler_message(build_module, tmp_path, caplog):
    broken = tmp_path / "broken.cc"
    broken.write_text('#include "paddle/extension.h"\nthis is not C++;\n')
    with caplog.at_level(logging.INFO, logger="worker.kernels.build"):
        assert build_module.load_extension("fd_test_broken", [str(broken)]) is None
        assert build_module.load_extension("fd_test_broken", [str(broken)]) is None
    records = _fallback_records(caplog)
    assert len(records) == 1
    assert "build failed" in records[0].getMessage() and "error" in records[0].getMessage()


def test_cpu_has_reads_proc_cpuinfo(build_module):
    flags = build_module.cpu_flags()
    assert build_module.cpu_has() is True
    assert build_module.cpu_has("no_such_isa") is False
    if flags:
        assert build_module.cpu_has(next(iter(flags)))
