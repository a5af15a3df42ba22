"""P/D disaggregation's data plane: the Mooncake transfer engine, the wire form of a KV offer, block addresses.

Owns three things, none of which knows a process role or the engine:

- ``KVTransferEngine``: a thin wrapper of Mooncake's ``TransferEngine`` (``mooncake.engine``) over TCP with
  the "P2PHANDSHAKE" metadata mode (no etcd: peers find each other by ``host:rpc_port``). A prefill
  instance's engine process registers its device KV pool with one so peers can read it; a decode
  instance's cache transfer process uses one to read (``batch_transfer_sync_read``) into its own pool.
  Every failure (peer gone, address outside the peer's registered memory, TE error) is a
  ``PDTransferError``; the caller turns it into a miss, never into garbage KV.
- ``RemotePrefill``: the offer a prefill instance returns in ``kv_transfer_params`` (which of its blocks
  hold which prompt blocks, where its pool is), its JSON form (``to_params`` / ``parse``) and the checks a
  decode instance runs before trusting it (same model fingerprint, KV layout and block size).
- ``block_segments``: the (local address, remote address, length) runs one block copy needs. The device
  pool is ``[layers, 2, num_blocks, ...]`` (kv_layout.py), so one block is ``2 * layers`` strided pieces;
  runs of consecutive block ids on both sides merge into one piece per plane.

Why pull (the decode side reads) rather than push (the prefill side writes): with pull the decode
instance allocates its target blocks when it admits the request, in its own scheduler, exactly like a
storage prefetch (LOAD state, the FD_USE_KVCACHE_LOCK bracket in its cache transfer process, the fill
deadline, a failure = recompute). Push would need the target blocks before the prefill ran, i.e. a
third call (reserve on the decode instance first) and a reservation that leaks if the router dies in
between. The prefill side only pins the finished request's full blocks until the decode side says
"released" or a TTL ends (engine/disaggregation.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

TE_METADATA_SERVER = "P2PHANDSHAKE"
TE_PROTOCOL = "tcp"
# Pieces per transfer-engine batch call. Larger batches over TCP failed intermittently here (thousands of
# pieces of 48 KiB at a high load: "connection reset by peer", or the peer refusing addresses inside its
# registered pool); a long read is made of several batches instead.
MAX_PIECES_PER_BATCH = 240
# A read of a peer's blocks starts only while its hold has at least this long to run (``expires_at``): a
# hold that ends mid-read could let the peer reuse the blocks under us. Wall clocks: P/D nodes need NTP.
PD_EXPIRY_MARGIN_S = 2.0
# Bumped when the offer's fields change meaning: a decode instance refuses an offer of another version.
PD_PROTOCOL_VERSION = 1


class PDTransferError(RuntimeError):
    """The transfer engine could not start, register memory or move bytes (the peer is gone, ...)."""


class PDProtocolError(ValueError):
    """A ``kv_transfer_params`` offer is malformed or describes KV this instance cannot use."""


class KVTransferEngine:
    """One Mooncake ``TransferEngine`` on ``local_host`` (TCP, P2P handshake); see the module docstring."""

    def __init__(self, local_host: str) -> None:
        try:
            from mooncake.engine import TransferEngine  # optional package: only P/D instances need it
        except ImportError as exc:
            raise PDTransferError("P/D disaggregation needs the Mooncake transfer engine "
                                  "(pip install mooncake-transfer-engine-non-cuda; apt-get install libibverbs1)"
                                  ) from exc
        self.local_host = local_host
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(local_host, TE_METADATA_SERVER, TE_PROTOCOL, "")
        if rc != 0:
            raise PDTransferError(f"Mooncake TransferEngine.initialize({local_host!r}, {TE_METADATA_SERVER!r}, "
                                  f"{TE_PROTOCOL!r}) failed with {rc}")
        self.rpc_port = int(self._engine.get_rpc_port())
        self._registered: dict[int, int] = {}  # address -> length

    @property
    def session(self) -> str:
        """How peers name this engine in their transfers."""
        return f"{self.local_host}:{self.rpc_port}"

    def register(self, array: np.ndarray) -> int:
        """Make ``array``'s memory readable by peers (and usable as a local buffer); returns its address."""
        if not array.flags.c_contiguous:
            raise PDTransferError("only a C-contiguous array can be registered")
        address, length = int(array.ctypes.data), int(array.nbytes)
        rc = self._live().register_memory(address, length)
        if rc != 0:
            raise PDTransferError(f"registering {length} bytes at {address:#x} failed with {rc}")
        self._registered[address] = length
        return address

    def unregister(self, address: int) -> None:
        if self._registered.pop(address, None) is None:
            return
        rc = self._live().unregister_memory(address)
        if rc != 0:
            logger.warning("unregistering the KV pool at %#x failed with %d", address, rc)

    def read(self, session: str, local: list[int], remote: list[int], lengths: list[int]) -> None:
        """Copy ``lengths[i]`` bytes from ``remote[i]`` on peer ``session`` to ``local[i]``; all or an error."""
        for start in range(0, len(local), MAX_PIECES_PER_BATCH):
            end = start + MAX_PIECES_PER_BATCH
            rc = self._live().batch_transfer_sync_read(session, local[start:end], remote[start:end],
                                                       lengths[start:end])
            if rc != 0:
                raise PDTransferError(f"reading {len(local[start:end])} pieces ({sum(lengths[start:end])} bytes) "
                                      f"from {session} failed with {rc} (the peer is gone, or it no longer holds "
                                      "that memory)")

    def write(self, session: str, local: list[int], remote: list[int], lengths: list[int]) -> None:
        """The push direction (benchmarks only): ``local[i]`` -> ``remote[i]`` on ``session``."""
        for start in range(0, len(local), MAX_PIECES_PER_BATCH):
            end = start + MAX_PIECES_PER_BATCH
            rc = self._live().batch_transfer_sync_write(session, local[start:end], remote[start:end],
                                                        lengths[start:end])
            if rc != 0:
                raise PDTransferError(f"writing {len(local[start:end])} pieces to {session} failed with {rc}")

    def _live(self) -> Any:
        if self._engine is None:
            raise PDTransferError(f"the transfer engine at {self.session} is closed")
        return self._engine

    def close(self) -> None:
        """Unregister everything and drop the engine: its destructor stops its threads and closes its port (~1 s)."""
        if self._engine is None:
            return
        for address in list(self._registered):
            self.unregister(address)
        self._engine = None


@dataclass
class RemotePrefill:
    """A prefill instance's offer: its blocks ``block_ids[i]`` hold the prompt block whose hash is ``block_hashes[i]``."""

    transfer_id: str
    session: str  # "host:port" of the prefill instance's transfer engine
    release_endpoint: str  # zmq address the decode side sends the release of ``transfer_id`` to
    kv_addr: int  # the prefill instance's device pool, in its engine process's address space
    num_blocks: int  # that pool's block count (its plane stride)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[str] = field(default_factory=list)
    block_size: int = 0
    model_fingerprint: str = ""
    kv_layout: str = ""
    ttl_s: float = 0.0
    expires_at: float = 0.0  # wall-clock time (time.time()) the prefill instance frees the blocks at the latest

    def remaining_s(self, now: float) -> float:
        return self.expires_at - now

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` object of the prefill instance's response (JSON-ready)."""
        return {
            "do_remote_prefill": True, "version": PD_PROTOCOL_VERSION, "transfer_id": self.transfer_id,
            "remote_session": self.session, "release_endpoint": self.release_endpoint,
            "remote_kv_addr": self.kv_addr, "remote_num_blocks": self.num_blocks,
            "remote_block_ids": list(self.block_ids), "block_hashes": list(self.block_hashes),
            "block_size": self.block_size, "model_fingerprint": self.model_fingerprint,
            "kv_layout": self.kv_layout, "ttl_s": self.ttl_s, "expires_at": self.expires_at,
        }

    @classmethod
    def parse(cls, params: dict[str, Any]) -> "RemotePrefill":
        """The offer in ``params`` (a prefill response's ``kv_transfer_params``); ``PDProtocolError`` if malformed."""
        if params.get("version") != PD_PROTOCOL_VERSION:
            raise PDProtocolError(f"kv_transfer_params version {params.get('version')!r} is not "
                                  f"{PD_PROTOCOL_VERSION}")
        try:
            offer = cls(transfer_id=_typed(params, "transfer_id", str), session=_typed(params, "remote_session", str),
                        release_endpoint=_typed(params, "release_endpoint", str),
                        kv_addr=_typed(params, "remote_kv_addr", int),
                        num_blocks=_typed(params, "remote_num_blocks", int),
                        block_ids=[int(b) for b in _typed(params, "remote_block_ids", list)],
                        block_hashes=[str(h) for h in _typed(params, "block_hashes", list)],
                        block_size=_typed(params, "block_size", int),
                        model_fingerprint=_typed(params, "model_fingerprint", str),
                        kv_layout=_typed(params, "kv_layout", str),
                        ttl_s=float(params.get("ttl_s", 0.0)),
                        expires_at=float(_typed(params, "expires_at", (int, float))))
        except (TypeError, ValueError) as exc:
            raise PDProtocolError(f"malformed kv_transfer_params: {exc}") from exc
        if len(offer.block_ids) != len(offer.block_hashes):
            raise PDProtocolError(f"kv_transfer_params offers {len(offer.block_ids)} blocks but "
                                  f"{len(offer.block_hashes)} hashes")
        if any(not 0 <= b < offer.num_blocks for b in offer.block_ids):
            raise PDProtocolError(f"kv_transfer_params names blocks outside the peer's {offer.num_blocks}")
        return offer

    def check_compatible(self, block_size: int, model_fingerprint: str, kv_layout: str) -> None:
        """Raise ``PDProtocolError`` unless the offered blocks have exactly this instance's shape and meaning."""
        if (self.block_size, self.model_fingerprint, self.kv_layout) != (block_size, model_fingerprint, kv_layout):
            raise PDProtocolError(
                f"the prefill instance's KV (block size {self.block_size}, model {self.model_fingerprint[:12]}, "
                f"layout {self.kv_layout!r}) does not match this instance's (block size {block_size}, model "
                f"{model_fingerprint[:12]}, layout {kv_layout!r})")


def _typed(params: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = params.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise PDProtocolError(f"kv_transfer_params.{name} must be a {names}, got {value!r}")
    return value


def block_segments(num_planes: int, block_bytes: int, local_base: int, local_num_blocks: int,
                   remote_base: int, remote_num_blocks: int,
                   pairs: list[tuple[int, int]]) -> tuple[list[int], list[int], list[int]]:
    """Addresses and lengths copying remote block ``r`` to local block ``l`` for every ``(l, r)`` in ``pairs``.

    ``num_planes`` = layers x 2 (k, v); plane ``p`` of block ``b`` starts at ``base + (p * num_blocks + b) *
    block_bytes``. Consecutive pairs whose ids both step by one merge into one piece per plane.
    """
    runs: list[tuple[int, int, int]] = []  # (local start, remote start, length in blocks)
    for local_id, remote_id in pairs:
        if runs and runs[-1][0] + runs[-1][2] == local_id and runs[-1][1] + runs[-1][2] == remote_id:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((local_id, remote_id, 1))
    local: list[int] = []
    remote: list[int] = []
    lengths: list[int] = []
    for plane in range(num_planes):
        for local_id, remote_id, count in runs:
            local.append(local_base + (plane * local_num_blocks + local_id) * block_bytes)
            remote.append(remote_base + (plane * remote_num_blocks + remote_id) * block_bytes)
            lengths.append(count * block_bytes)
    return local, remote, lengths
