"""bfloat16-weight linear layers: the packed weight format and the native GEMM operator that reads it.

This module owns ``--dtype bfloat16``'s matmul: weights rounded to bf16 and packed once at load
(``pack_bf16``: chunks of 64 output columns with the rows interleaved in pairs, the operand layout
of AVX512-BF16's ``vdpbf16ps``) and ``bf16_linear``, float32 in and out with float32 accumulation,
run by the custom operator in ``gemm_bf16.cc``. Paddle 3.3's CPU ``matmul`` has no bfloat16
kernel, so there is no Paddle fallback: ``require_bf16_gemm`` raises ``Bf16Unavailable`` with the
reason (CPU without avx512_bf16, no compiler, FD_NATIVE_KERNELS=0) and the model refuses to load.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import paddle

from worker.kernels.build import cpu_has, last_build, load_extension
from worker.weight_memory import weight_tensor

logger = logging.getLogger(__name__)

_SOURCES = [str(Path(__file__).with_name("gemm_bf16.cc"))]
_EXTENSION = "fd_gemm_bf16"
# The kernel's instructions: vdpbf16ps / vcvtneps2bf16 (avx512_bf16) on 512-bit registers.
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")
CHUNK = 64  # output columns per packed chunk (gemm_bf16.cc kBlocks * kBlock); columns are zero-padded to a multiple


class Bf16Unavailable(RuntimeError):
    """bfloat16 mode cannot run here (the message says why)."""


@dataclass
class PackedBf16:
    """A [in_features, out_features] weight in bf16, packed for ``bf16_linear``."""

    packed: paddle.Tensor  # int16 view of bf16, [ceil(out / 64), ceil(in / 2), 128]
    in_features: int
    out_features: int


def bf16_gemm_module() -> ModuleType | None:
    """The compiled operator module, or None (reason logged by the build) where it cannot run."""
    if not cpu_has(*REQUIRED_CPU_FLAGS):
        return None
    return load_extension(_EXTENSION, _SOURCES, required_cpu_flags=REQUIRED_CPU_FLAGS)


def require_bf16_gemm() -> ModuleType:
    """The operator module, or ``Bf16Unavailable`` naming why bfloat16 mode cannot run on this machine."""
    missing = [flag for flag in REQUIRED_CPU_FLAGS if not cpu_has(flag)]
    if missing:
        raise Bf16Unavailable(f"--dtype bfloat16 needs a CPU with {', '.join(REQUIRED_CPU_FLAGS)}; "
                              f"this one lacks {', '.join(missing)} (use --dtype float32)")
    module = load_extension(_EXTENSION, _SOURCES, required_cpu_flags=REQUIRED_CPU_FLAGS)
    if module is None:
        result = last_build(_EXTENSION)
        reason = result.reason if result is not None else "unknown reason"
        raise Bf16Unavailable(f"--dtype bfloat16 needs the native bf16 GEMM kernel, which is unavailable: {reason} "
                              "(use --dtype float32)")
    return module


def to_bf16_bits(array: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounded to nearest even as the CPU's vcvtneps2bf16 does."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns -> the float32 values they stand for."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def pack_bf16(weight: np.ndarray) -> PackedBf16:
    """Round a float32 [in, out] weight to bf16 and pack it (rows paired, 64-column chunks, zero padding)."""
    if weight.ndim != 2:
        raise ValueError(f"pack_bf16 takes a 2-D [in, out] weight, got shape {weight.shape}")
    in_features, out_features = weight.shape
    rows = in_features + in_features % 2
    cols = -(-out_features // CHUNK) * CHUNK
    padded = np.zeros((rows, cols), dtype=np.uint16)
    padded[:in_features, :out_features] = to_bf16_bits(weight)
    # [k/2, 2, chunk, 64] -> [chunk, k/2, 64, 2]: a chunk is one stream over K; 16 columns' pairs = one operand.
    packed = padded.reshape(rows // 2, 2, cols // CHUNK, CHUNK).transpose(2, 0, 3, 1)
    packed = np.ascontiguousarray(packed).reshape(cols // CHUNK, rows // 2, 2 * CHUNK)
    return PackedBf16(weight_tensor(packed.view(np.int16)), in_features, out_features)


def unpack_bf16(weight: PackedBf16) -> np.ndarray:
    """The float32 [in, out] values a packed weight holds (tests and accuracy checks)."""
    chunks, pairs, _ = weight.packed.shape
    packed = weight.packed.numpy().view(np.uint16).reshape(chunks, pairs, CHUNK, 2)
    plain = packed.transpose(1, 3, 0, 2).reshape(2 * pairs, chunks * CHUNK)
    return from_bf16_bits(plain[: weight.in_features, : weight.out_features])


def bf16_linear(module: ModuleType, x: paddle.Tensor, weight: PackedBf16) -> paddle.Tensor:
    """x [..., in] float32 @ weight -> [..., out] float32 (x rounded to bf16, float32 accumulation)."""
    return module.fd_bf16_linear(x, weight.packed, weight.out_features)


# --------------------------------------------------------------------------- int8 (experimental)
# Not used by the model: measured by benchmarks/gemm.py --int8 as the path toward an 8-bit weight mode.

_INT8_SOURCES = [str(Path(__file__).with_name("gemm_int8.cc"))]
_INT8_EXTENSION = "fd_gemm_int8"
INT8_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")


@dataclass
class PackedInt8:
    """A [in_features, out_features] weight quantised per output column to int8, packed for ``int8_linear``."""

    packed: paddle.Tensor  # int8 [ceil(out / 64), ceil(in / 4), 256]
    scales: paddle.Tensor  # float32 [padded out]: column max |w| / 127
    column_sums: paddle.Tensor  # int32 [padded out]: sum of the column's int8 values (undoes the +128 shift of x)
    in_features: int
    out_features: int


def int8_gemm_module() -> ModuleType | None:
    """The experimental int8 operator module, or None where the CPU lacks VNNI or the build fails."""
    if not cpu_has(*INT8_CPU_FLAGS):
        return None
    return load_extension(_INT8_EXTENSION, _INT8_SOURCES, required_cpu_flags=INT8_CPU_FLAGS)


def pack_int8(weight: np.ndarray) -> PackedInt8:
    """Quantise a float32 [in, out] weight per column (symmetric, 127 levels) and pack it (rows in quads)."""
    in_features, out_features = weight.shape
    rows = -(-in_features // 4) * 4
    cols = -(-out_features // CHUNK) * CHUNK
    peak = np.abs(weight).max(axis=0)
    scales = np.ones(cols, dtype=np.float32)
    scales[:out_features] = np.where(peak > 0, peak / 127.0, 1.0)
    quantised = np.zeros((rows, cols), dtype=np.int8)
    quantised[:in_features, :out_features] = np.rint(weight / scales[:out_features]).astype(np.int8)
    sums = quantised.astype(np.int32).sum(axis=0).astype(np.int32)
    packed = quantised.reshape(rows // 4, 4, cols // CHUNK, CHUNK).transpose(2, 0, 3, 1)
    packed = np.ascontiguousarray(packed).reshape(cols // CHUNK, rows // 4, 4 * CHUNK)
    return PackedInt8(paddle.to_tensor(packed), paddle.to_tensor(scales), paddle.to_tensor(sums),
                      in_features, out_features)


def int8_linear(module: ModuleType, x: paddle.Tensor, weight: PackedInt8) -> paddle.Tensor:
    """x [..., in] float32 @ weight -> [..., out] float32 (x quantised per row to 8 bits inside)."""
    return module.fd_int8_linear(x, weight.packed, weight.scales, weight.column_sums, weight.out_features)
