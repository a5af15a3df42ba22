"""Pure numpy copies of KV blocks between the device pool, the host pool and staging buffers.

Owns the copy routines the cache transfer process runs (no IPC, no locking, no paddle), and the
validation of block ids and layouts they need. Layouts (cache_manager/kv_layout.py):

- device pool ``[layers, 2, num_blocks, kv_heads, block_size, head_dim]``: one block is strided,
  ``layers * 2`` runs of ``kv_heads * block_size * head_dim`` floats;
- host pool and staging ``[num_blocks, layers, 2, kv_heads, block_size, head_dim]``: one block is
  one contiguous object, exactly the bytes one storage object holds.

Measured here (2-core EPYC, SmolLM2 blocks of 30 x 2 x 3 x 64 x 64 float32, 16 blocks): one
``copyto`` per block runs at memcpy speed (~13-18 GB/s), while whole-batch fancy indexing
(``host[h] = moveaxis(device[:, :, d], 2, 0)``) materialises a temporary and runs at ~5 GB/s,
and per-layer-pair fancy indexing or ``np.take`` sits in between (~8-10 GB/s). The runs of one
block are 48 KB each, so a per-block strided copy is already bandwidth-bound and the Python
loop over blocks costs nothing measurable.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

logger = logging.getLogger(__name__)

_DEVICE_BLOCK_AXIS = 2


class BlockCopyError(ValueError):
    """A copy request that cannot be executed as asked (bad ids, mismatched layouts)."""


def block_shape_of_device(device: np.ndarray) -> tuple[int, ...]:
    """Shape of one block in host/staging layout for this device pool."""
    _check_ndim("device pool", device)
    layers, kv, _blocks, block_size, heads, head_dim = device.shape
    return (layers, kv, block_size, heads, head_dim)


def check_block_ids(ids: Sequence[int], num_blocks: int, what: str, unique: bool = False) -> list[int]:
    """Return ``ids`` as plain ints, checked to lie in ``[0, num_blocks)`` (and distinct when ``unique``).

    Destinations must be distinct: two sources copied into one block would leave whichever ran last.
    """
    checked: list[int] = []
    for raw in ids:
        if isinstance(raw, (bool, np.bool_)) or not isinstance(raw, (int, np.integer)):
            raise BlockCopyError(f"{what} block id {raw!r} is not an integer")
        block = int(raw)
        if not 0 <= block < num_blocks:
            raise BlockCopyError(f"{what} block id {block} is outside the pool of {num_blocks} blocks")
        checked.append(block)
    if unique and len(set(checked)) != len(checked):
        raise BlockCopyError(f"{what} block ids repeat a destination: {checked}")
    return checked


def device_to_host(device: np.ndarray, host: np.ndarray, device_ids: Sequence[int],
                   host_ids: Sequence[int]) -> None:
    """host[host_ids[i]] = device block device_ids[i], for every i."""
    _check_pair(device, host, "host pool")
    src, dst = _check_pairs(device_ids, host_ids, device.shape[_DEVICE_BLOCK_AXIS], host.shape[0],
                            "device", "host", unique_dst=True)
    for d, h in zip(src, dst):
        np.copyto(host[h], device[:, :, d])


def host_to_device(host: np.ndarray, device: np.ndarray, host_ids: Sequence[int],
                   device_ids: Sequence[int]) -> None:
    """device block device_ids[i] = host[host_ids[i]], for every i."""
    _check_pair(device, host, "host pool")
    src, dst = _check_pairs(host_ids, device_ids, host.shape[0], device.shape[_DEVICE_BLOCK_AXIS],
                            "host", "device", unique_dst=True)
    for h, d in zip(src, dst):
        np.copyto(device[:, :, d], host[h])


def device_to_staging(device: np.ndarray, staging: np.ndarray, device_ids: Sequence[int]) -> None:
    """staging[i] = device block device_ids[i] for i < len(device_ids); later staging rows are left alone."""
    _check_pair(device, staging, "staging buffer")
    src = check_block_ids(device_ids, device.shape[_DEVICE_BLOCK_AXIS], "device")
    _check_capacity(staging, len(src))
    for row, d in enumerate(src):
        np.copyto(staging[row], device[:, :, d])


def staging_to_device(staging: np.ndarray, device: np.ndarray, staging_rows: Sequence[int],
                      device_ids: Sequence[int]) -> None:
    """device block device_ids[i] = staging[staging_rows[i]], for every i (only the listed rows move)."""
    _check_pair(device, staging, "staging buffer")
    src, dst = _check_pairs(staging_rows, device_ids, staging.shape[0], device.shape[_DEVICE_BLOCK_AXIS],
                            "staging", "device", unique_dst=True)
    for row, d in zip(src, dst):
        np.copyto(device[:, :, d], staging[row])


def _check_ndim(label: str, array: np.ndarray) -> None:
    if not isinstance(array, np.ndarray) or array.ndim != 6:
        shape = getattr(array, "shape", None)
        raise BlockCopyError(f"{label} must be a 6-d numpy array, got {type(array).__name__} of shape {shape}")


def _check_pair(device: np.ndarray, block_major: np.ndarray, label: str) -> None:
    """The block-major array must hold blocks of exactly the device pool's block shape and dtype."""
    expected = block_shape_of_device(device)
    _check_ndim(label, block_major)
    if tuple(block_major.shape[1:]) != expected:
        raise BlockCopyError(f"{label} blocks are shaped {tuple(block_major.shape[1:])}, the device pool's {expected}")
    if block_major.dtype != device.dtype:
        raise BlockCopyError(f"{label} dtype {block_major.dtype} differs from the device pool's {device.dtype}")


def _check_pairs(src_ids: Sequence[int], dst_ids: Sequence[int], src_blocks: int, dst_blocks: int,
                 src_what: str, dst_what: str, unique_dst: bool) -> tuple[list[int], list[int]]:
    if len(src_ids) != len(dst_ids):
        raise BlockCopyError(f"{len(src_ids)} {src_what} ids but {len(dst_ids)} {dst_what} ids; they pair up")
    return (check_block_ids(src_ids, src_blocks, src_what),
            check_block_ids(dst_ids, dst_blocks, dst_what, unique=unique_dst))


def _check_capacity(staging: np.ndarray, count: int) -> None:
    if count > staging.shape[0]:
        raise BlockCopyError(f"{count} blocks do not fit a staging buffer of {staging.shape[0]} blocks")
