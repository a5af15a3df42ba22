"""Prefill/decode (P/D) disaggregation: the engine's bookkeeping on either side of a KV handover.

Roles (``--splitwise-role``, FastDeploy's flag): ``mixed`` (default, none of this runs), ``prefill``,
``decode``. One DP rank and TP = 1 per instance (config/engine_config.py refuses the rest). The data
plane (Mooncake transfer engine, the offer's wire form, block addresses) is cache_manager/pd_transfer.py;
the read itself is a ``remote_read`` task of the decode instance's cache transfer process.

Protocol (agreed with the router, which makes exactly two plain HTTP calls; /tmp/pd_protocol.md):

1. Router -> prefill instance: the client's request with ``max_tokens: 1``, ``stream: false``, ``n: 1``
   and ``kv_transfer_params: {"do_remote_decode": true}``. The instance prefills, samples one token and
   answers as usual; the response's top level carries ``kv_transfer_params``: the offer
   (``RemotePrefill.to_params``: ``do_remote_prefill: true``, a ``transfer_id``, its transfer engine's
   ``remote_session`` (host:rpc_port), its pool's address and block count, the block ids holding the
   prompt's full blocks with their chained hashes, block size, model fingerprint, KV layout,
   ``release_endpoint``, ``ttl_s``, ``expires_at``). Those blocks are held (one extra reference: not evicted, not
   reused) until released or ``FD_PD_HOLD_TTL_S`` (default 30 s) passed. No offer (``null``) when the
   prompt has no full block.
2. Router -> decode instance: the original request plus that ``kv_transfer_params``. At admission the
   decode engine matches the offered hashes against the prompt's own block hashes; the matching blocks
   after its device hits become fills from source "remote": fresh blocks in LOAD state, read by the
   cache transfer process with ``batch_transfer_sync_read`` under FD_USE_KVCACHE_LOCK, exactly like a
   storage prefetch (same deadline FD_KVCACHE_TRANSFER_TIMEOUT, same "a failed block is recomputed").
   The last partial block and the first token are computed locally, so the output is exactly a mixed
   instance's prefix-cache-hit output (greedy); ``usage.prompt_tokens_details.cached_tokens`` counts the
   transferred tokens. When the read reported (either way), or the offer was not used (device hits,
   no room, the request ended first), the decode engine sends the release of ``transfer_id`` to the
   prefill instance's ``release_endpoint`` (ZMQ PUSH over TCP, the transfer id as UTF-8 bytes, fire and forget;
   the TTL covers a lost one).

Trust: a prefill instance's transfer engine lets any peer that can reach it read its registered KV pool, and
its release socket accepts any transfer id (an unknown id is counted and ignored, and the ids are random
UUIDs): keep ``--pd-host`` on a network only the fleet reaches.

Failures: an offer that is malformed, describes another model / block size / layout, or whose hold ends
within PD_EXPIRY_MARGIN_S is logged and ignored (the request prefills locally; no read starts that close
to ``expires_at``, wall clock, so the prefill side never reuses blocks under a read); a peer that is gone or a transfer error fails the read, and the
blocks are recomputed locally (the request still succeeds: fallback to local prefill); a hung read runs
into the fill deadline (recompute) and the transfer process's watchdog. Blocks never leak: the decode
side's are released by the fill machinery, the prefill side's on release or TTL expiry, or dropped with
every other device block when its worker restarts.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from cache_manager.kv_cache_manager import KVCacheManager
from cache_manager.kv_layout import KV_LAYOUT_TAG, device_cache_segment, device_cache_shape
from cache_manager.pd_transfer import (PD_EXPIRY_MARGIN_S, KVTransferEngine, PDProtocolError, PDTransferError,
                                       RemotePrefill)
from config.engine_config import EngineConfig
from engine.sequence import Sequence
from inter_communicator.shm import SharedArray

logger = logging.getLogger(__name__)

# Releases one decode engine may queue for one prefill instance that is not reading them (gone, slow).
RELEASE_SNDHWM = 10000
# A release message is the transfer id as UTF-8, nothing else: the socket listens on the network, so it never
# unpickles (a pickle from a peer could run code). Longer messages are dropped.
MAX_RELEASE_BYTES = 256
FINISH_REASONS_HELD = ("stop", "length")


@dataclass
class _Hold:
    block_ids: list[int]
    expires: float  # monotonic


class PrefillSide:
    """A prefill instance's engine: holds finished requests' blocks and offers them to decode instances.

    The transfer engine runs in the engine process (its own threads serve the peers' reads from the
    registered device pool, which this process maps read-only in spirit: it never writes it); it is
    started on the first hold, after the worker created the pool.
    """

    def __init__(self, config: EngineConfig, cache: KVCacheManager, context: zmq.Context,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.cache = cache
        self._clock = clock
        self.release_socket = context.socket(zmq.PULL)
        self.release_socket.setsockopt(zmq.LINGER, 0)
        port = self.release_socket.bind_to_random_port(f"tcp://{config.pd.host}")
        self.release_endpoint = f"tcp://{config.pd.host}:{port}"
        self._engine: KVTransferEngine | None = None
        self._pool: SharedArray | None = None
        self._pool_addr = 0
        self._holds: dict[str, _Hold] = {}
        self.stats = {"pd_holds": 0, "pd_released": 0, "pd_expired": 0, "pd_unknown_releases": 0}

    @property
    def num_held_blocks(self) -> int:
        return sum(len(h.block_ids) for h in self._holds.values())

    def attach(self, seq: Sequence, params: dict[str, Any]) -> None:
        if params.get("do_remote_decode"):
            seq.pd_hold = True

    def on_finish(self, seq: Sequence, reason: str | None) -> None:
        """Before ``seq``'s blocks are freed: hold its full prompt blocks and put the offer on the sequence."""
        if not seq.pd_hold or seq.index != 0 or reason not in FINISH_REASONS_HELD:
            return
        seq.pd_hold = False
        full = min(len(seq.block_hashes), seq.num_prompt_tokens // self.cache.block_size)
        if full == 0:
            return  # nothing worth sending: the decode side computes a prompt this short itself
        try:
            engine = self._transfer_engine()
        except PDTransferError as exc:
            logger.error("%s: no KV offer for the decode instance: %s", seq.request_id, exc)
            return
        transfer_id = f"{self.config.instance_id}-{uuid.uuid4().hex}"
        block_ids = self.cache.hold(seq, full)
        self._holds[transfer_id] = _Hold(block_ids, self._clock() + self.config.pd.hold_ttl_s)
        self.stats["pd_holds"] += 1
        seq.kv_transfer_result = RemotePrefill(
            transfer_id=transfer_id, session=engine.session, release_endpoint=self.release_endpoint,
            kv_addr=self._pool_addr, num_blocks=self.config.cache.num_gpu_blocks, block_ids=block_ids,
            block_hashes=list(seq.block_hashes[:full]), block_size=self.cache.block_size,
            model_fingerprint=self.config.cache.model_fingerprint, kv_layout=KV_LAYOUT_TAG,
            ttl_s=self.config.pd.hold_ttl_s, expires_at=time.time() + self.config.pd.hold_ttl_s).to_params()

    def service(self) -> None:
        """Apply the releases that arrived and end the holds past their TTL."""
        while True:
            try:
                message = self.release_socket.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(message) > MAX_RELEASE_BYTES:
                logger.warning("a %d-byte message on the P/D release socket dropped", len(message))
                continue
            self._release(message.decode("utf-8", errors="replace"), "pd_released")
        now = self._clock()
        for transfer_id in [t for t, h in self._holds.items() if h.expires <= now]:
            logger.warning("P/D hold %s expired after %.0f s without a release; its blocks are freed",
                           transfer_id, self.config.pd.hold_ttl_s)
            self._release(transfer_id, "pd_expired")

    def _release(self, transfer_id: str, counter: str) -> None:
        hold = self._holds.pop(transfer_id, None)
        if hold is None:
            self.stats["pd_unknown_releases"] += 1  # expired already, or the worker restarted since
            return
        self.cache.release_held(hold.block_ids)
        self.stats[counter] += 1

    def _transfer_engine(self) -> KVTransferEngine:
        if self._engine is None:
            self._engine = KVTransferEngine(self.config.pd.host)
        if self._pool is None:
            model, cache = self.config.model, self.config.cache
            self._pool = SharedArray(device_cache_segment(self.config.instance_id, self.config.parallel.dp_rank, 0),
                                     device_cache_shape(model, cache.num_gpu_blocks, cache.block_size), "float32",
                                     create=False)
            self._pool_addr = self._engine.register(self._pool.array)
            logger.info("P/D prefill: transfer engine at %s serves the device pool; releases on %s",
                        self._engine.session, self.release_endpoint)
        return self._engine

    def on_device_reset(self) -> None:
        """The worker restarted: its pool is a new segment and every block is free again; drop holds and the mapping."""
        if self._holds:
            logger.warning("worker restart: %d P/D holds dropped (their decode instances recompute)", len(self._holds))
        self._holds.clear()
        self._unmap()

    def _unmap(self) -> None:
        if self._pool is not None:
            if self._engine is not None:
                self._engine.unregister(self._pool_addr)
            self._pool.close()
            self._pool = None

    def close(self) -> None:
        self._unmap()
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        self.release_socket.close(linger=0)


class DecodeSide:
    """A decode instance's engine: turns offers into the sequences' ``remote_prefill`` and sends the releases."""

    def __init__(self, config: EngineConfig, cache: KVCacheManager, context: zmq.Context) -> None:
        self.config = config
        self.cache = cache
        self._context = context
        self._peers: dict[str, zmq.Socket] = {}
        self.stats = {"pd_offers": 0, "pd_offers_refused": 0, "pd_releases_sent": 0}

    def attach(self, seq: Sequence, params: dict[str, Any]) -> None:
        if not params.get("do_remote_prefill"):
            return
        try:
            offer = RemotePrefill.parse(params)
            offer.check_compatible(self.cache.block_size, self.config.cache.model_fingerprint, KV_LAYOUT_TAG)
            if offer.remaining_s(time.time()) < PD_EXPIRY_MARGIN_S:
                raise PDProtocolError(f"the prefill instance's hold ends in {offer.remaining_s(time.time()):.1f} s "
                                      f"(FD_PD_HOLD_TTL_S there; P/D nodes need synchronised clocks)")
        except PDProtocolError as exc:
            self.stats["pd_offers_refused"] += 1
            logger.warning("%s: kv_transfer_params ignored, prefilling locally: %s", seq.request_id, exc)
            # Still tell the prefill side, if it said where, so its blocks are not held for the TTL.
            endpoint, transfer_id = params.get("release_endpoint"), params.get("transfer_id")
            if isinstance(endpoint, str) and isinstance(transfer_id, str):
                self._send_release(endpoint, transfer_id)
            return
        self.stats["pd_offers"] += 1
        seq.remote_prefill = offer

    def on_finish(self, seq: Sequence, reason: str | None) -> None:
        """A request that ends before its admission used the offer: release it now."""
        if seq.remote_prefill is not None:
            offer, seq.remote_prefill = seq.remote_prefill, None
            self._send_release(offer.release_endpoint, offer.transfer_id)

    def service(self) -> None:
        for offer in self.cache.take_finished_offers():
            self._send_release(offer.release_endpoint, offer.transfer_id)

    def _send_release(self, endpoint: str, transfer_id: str) -> None:
        sock = self._peers.get(endpoint)
        if sock is None:
            if not endpoint.startswith("tcp://"):
                logger.warning("P/D release of %s not sent: %r is not a tcp:// endpoint", transfer_id, endpoint[:100])
                return
            sock = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, RELEASE_SNDHWM)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                logger.warning("P/D release of %s not sent: cannot connect to %r: %s", transfer_id, endpoint[:100], exc)
                return
            self._peers[endpoint] = sock
        try:
            sock.send(transfer_id.encode("utf-8"), flags=zmq.NOBLOCK)
            self.stats["pd_releases_sent"] += 1
        except zmq.ZMQError as exc:  # the peer's queue is full (it is gone): its TTL frees the blocks
            logger.warning("P/D release of %s to %s not sent: %s", transfer_id, endpoint, exc)

    def on_device_reset(self) -> None:
        pass  # our fills are failed by fail_all_transfers; their offers come back through take_finished_offers

    def close(self) -> None:
        for sock in self._peers.values():
            sock.close(linger=0)
        self._peers.clear()


def create_disaggregation(config: EngineConfig, cache: KVCacheManager,
                          context: zmq.Context) -> PrefillSide | DecodeSide | None:
    """This instance's side of P/D, or None for a mixed instance."""
    if config.pd.role == "prefill":
        return PrefillSide(config, cache, context)
    if config.pd.role == "decode":
        return DecodeSide(config, cache, context)
    return None


def pd_stats(side: PrefillSide | DecodeSide | None) -> dict[str, int]:
    """Counters for ``/v1/cache/stats``; ``pd_held_blocks`` is the prefill side's current hold."""
    if side is None:
        return {}
    stats = dict(side.stats)
    if isinstance(side, PrefillSide):
        stats["pd_held_blocks"] = side.num_held_blocks
    return stats
