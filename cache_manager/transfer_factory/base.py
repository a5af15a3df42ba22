"""The KV-cache storage backend interface and the object format every backend stores.

This module owns:
- ``KVStorageBackend``: the batch interface the cache-transfer process uses to write whole KV
  blocks to a storage tier and read them back (prefetch);
- ``BackendStats``: the counters every backend keeps;
- the stored object format: a fixed 32-byte header (magic, version, payload length, crc32 of
  the payload, crc32 of the key) followed by the raw payload bytes. The key checksum binds an
  object to its key, so a file renamed or copied under another key is rejected too;
- argument validation shared by the backends (key alphabet, contiguous arrays).

Miss semantics (all backends): a missing, failed, corrupt, wrong-size or unreachable object
is a miss (``False``), never an exception, and the caller's buffer is written only after the
object has been verified. Programming errors (a key outside ``[A-Za-z0-9_-]``, mismatched
list lengths, a non-contiguous or read-only array, use after ``close``) raise ``ValueError``
or ``RuntimeError``.

Thread safety: a backend instance is meant to be used from one thread (the cache-transfer
loop); it has no internal locking. Use one instance per thread if you need more.
"""
from __future__ import annotations

import abc
import dataclasses
import logging
import re
import struct
import zlib
from typing import Sequence

import numpy as np

logger = logging.getLogger(__name__)

OBJECT_MAGIC = b"FDKV"
OBJECT_VERSION = 1
# magic, version, header size, payload length, payload crc32, key crc32, reserved.
_HEADER = struct.Struct("<4sHHQII8x")
HEADER_SIZE = _HEADER.size  # 32: keeps the payload 16-byte aligned behind the header

MAX_KEY_LEN = 200  # file names are limited to 255 bytes; leave room for suffixes
_KEY_PATTERN = re.compile(r"[A-Za-z0-9_-]+")


class CorruptObject(Exception):
    """A stored object failed verification (bad magic/version/length/checksum/key)."""


@dataclasses.dataclass(frozen=True)
class ObjectHeader:
    payload_len: int
    payload_crc32: int
    key_crc32: int


@dataclasses.dataclass
class BackendStats:
    """Counters of one backend instance (``KVStorageBackend.stats``).

    puts/gets count keys requested; put_bytes/get_bytes count payload bytes actually stored
    or delivered; hits + misses == gets; corrupt and errors are included in misses (for gets)
    or put_errors (for puts); errors also counts failed exists/remove/clear calls.
    """

    puts: int = 0
    put_bytes: int = 0
    put_errors: int = 0
    gets: int = 0
    get_bytes: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class KVStorageBackend(abc.ABC):
    """Stores opaque byte objects (whole KV blocks) under string keys.

    See the module docstring for miss semantics and thread safety.
    """

    name: str = "abstract"

    @abc.abstractmethod
    def batch_put(self, keys: list[str], values: list[np.ndarray]) -> list[bool]:
        """Store each contiguous array's raw bytes under its key (overwriting); True per success."""

    @abc.abstractmethod
    def batch_get(self, keys: list[str], buffers: list[np.ndarray]) -> list[bool]:
        """Fill each buffer in place with its key's object; True per verified hit.

        An object whose payload size differs from the buffer's byte size is a miss, and a
        missed buffer is left untouched.
        """

    @abc.abstractmethod
    def exists(self, keys: list[str]) -> list[bool]:
        """Whether each key currently has a stored object (not verified)."""

    @abc.abstractmethod
    def remove(self, keys: list[str]) -> int:
        """Remove the keys' objects; returns how many existed and were removed."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Remove every object of this instance's namespace."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections and buffers; idempotent. Other calls raise afterwards."""

    @abc.abstractmethod
    def stats(self) -> dict[str, int]:
        """A copy of the counters (see ``BackendStats``)."""


def validate_key(key: str) -> None:
    if not isinstance(key, str) or not _KEY_PATTERN.fullmatch(key) or len(key) > MAX_KEY_LEN:
        raise ValueError(
            f"storage key {key!r} is invalid: use 1..{MAX_KEY_LEN} characters of [A-Za-z0-9_-]")


def validate_namespace(namespace: str) -> None:
    if not isinstance(namespace, str) or not _KEY_PATTERN.fullmatch(namespace) or len(namespace) > 64:
        raise ValueError(f"storage namespace {namespace!r} is invalid: use 1..64 characters of [A-Za-z0-9_-]")


def validate_keys(keys: Sequence[str], arrays: Sequence[np.ndarray] | None = None) -> None:
    if arrays is not None and len(keys) != len(arrays):
        raise ValueError(f"got {len(keys)} keys but {len(arrays)} arrays")
    for key in keys:
        validate_key(key)


def byte_view(array: np.ndarray, *, writable: bool = False) -> memoryview:
    """The array's raw bytes as a flat memoryview, without copying.

    Mooncake's ``put(key, ndarray)`` stores ``len(array)`` bytes, not ``nbytes``; going
    through a byte view everywhere avoids that class of bug.
    """
    if not isinstance(array, np.ndarray):
        raise ValueError(f"expected a numpy array, got {type(array).__name__}")
    if not array.flags.c_contiguous:
        raise ValueError("storage backends need C-contiguous arrays (got a non-contiguous view)")
    if writable and not array.flags.writeable:
        raise ValueError("the destination buffer is read-only")
    return memoryview(array.reshape(-1).view(np.uint8))


def key_checksum(key: str) -> int:
    return zlib.crc32(key.encode("ascii"))


def encode_header(key: str, payload: memoryview) -> bytes:
    return _HEADER.pack(OBJECT_MAGIC, OBJECT_VERSION, HEADER_SIZE, payload.nbytes,
                        zlib.crc32(payload), key_checksum(key))


def decode_header(key: str, raw: bytes | memoryview) -> ObjectHeader:
    """Parse and check a header read back for ``key``; raises ``CorruptObject``."""
    if len(raw) < HEADER_SIZE:
        raise CorruptObject(f"header truncated ({len(raw)} of {HEADER_SIZE} bytes)")
    magic, version, header_size, payload_len, payload_crc, key_crc = _HEADER.unpack(raw[:HEADER_SIZE])
    if magic != OBJECT_MAGIC:
        raise CorruptObject(f"bad magic {bytes(magic)!r}")
    if version != OBJECT_VERSION or header_size != HEADER_SIZE:
        raise CorruptObject(f"unsupported object version {version} (header size {header_size})")
    if key_crc != key_checksum(key):
        raise CorruptObject("object was stored under another key")
    return ObjectHeader(payload_len=payload_len, payload_crc32=payload_crc, key_crc32=key_crc)


def verify_payload(header: ObjectHeader, payload: memoryview) -> None:
    if payload.nbytes != header.payload_len:
        raise CorruptObject(f"payload is {payload.nbytes} bytes, header says {header.payload_len}")
    if zlib.crc32(payload) != header.payload_crc32:
        raise CorruptObject("payload checksum mismatch")


class StagingBuffer:
    """A reusable byte buffer objects are read into and verified in before the caller sees them.

    Grows geometrically and never shrinks; ``ensure`` reports a reallocation so a backend can
    register the new memory (Mooncake) before it is used.
    """

    def __init__(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)

    def ensure(self, nbytes: int) -> bool:
        """Make room for ``nbytes``; True if the buffer was reallocated."""
        if nbytes <= self.array.nbytes:
            return False
        capacity = max(nbytes, 2 * self.array.nbytes)
        self.array = np.empty(capacity, dtype=np.uint8)
        return True

    def view(self, start: int, length: int) -> memoryview:
        return memoryview(self.array)[start:start + length]
