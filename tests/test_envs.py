"""envs.py: parsing of variables and the MKL code path chosen for compute processes."""
from __future__ import annotations

import pytest

import envs

AVX512 = frozenset({"fpu", "avx2", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})


def test_avx512_cpu_gets_mkl_type_7(monkeypatch):
    monkeypatch.delenv("FD_MKL_CPU_TYPE", raising=False)
    assert envs.mkl_cpu_type(AVX512) == 7


def test_cpu_missing_one_avx512_subset_gets_type_5(monkeypatch):
    monkeypatch.delenv("FD_MKL_CPU_TYPE", raising=False)
    assert envs.mkl_cpu_type(AVX512 - {"avx512vl"}) == 5
    assert envs.mkl_cpu_type(frozenset({"avx2", "fma"})) == 5


def test_configured_type_wins(monkeypatch):
    monkeypatch.setenv("FD_MKL_CPU_TYPE", "5")
    assert envs.mkl_cpu_type(AVX512) == 5
    assert envs.compute_thread_env(3) == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3", "MKL_DEBUG_CPU_TYPE": "5"}


def test_cpu_flags_reads_the_first_flags_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert envs.cpu_flags(str(cpuinfo)) == frozenset({"fpu", "avx2", "avx512f"})
    assert envs.cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_invalid_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("FD_MKL_CPU_TYPE", "avx")
    with pytest.raises(ValueError, match="FD_MKL_CPU_TYPE"):
        envs.mkl_cpu_type(AVX512)


def test_unknown_variable_is_an_attribute_error():
    with pytest.raises(AttributeError, match="FD_NO_SUCH"):
        envs.FD_NO_SUCH  # noqa: B018
