"""Expert parallelism across the data-parallel ranks' worker processes (DP+EP).

This module owns:

- ``ExpertParallelGroup``: the process group that the worker of every DP rank joins
  (``ep_rank = dp_rank``, ``ep_size = dp_size``) and the collectives the worker and the
  MoE layers run in it. CPU: gloo, rendezvous through a TCP store that EP rank 0 hosts at
  ``config.parallel.master_addr:config.parallel.master_port``. GPU: NCCL through
  ``paddle.distributed.init_parallel_env`` (behind a device check; untested here, no GPU);
- ``shard_experts``: which experts an EP rank holds;
- ``DataParallelExpertParallel``: the MoE model's ``TokenExchangeExpertParallel`` for
  DP+EP, where every rank holds *different* tokens. CPU dispatch is all_gather based, because
  gloo has no alltoall/reduce_scatter (ARCHITECTURE.md): all_gather the token counts once per
  forward, then per sparse layer all_gather the rows [hidden | topk ids | topk weights]
  padded to the largest count, run the local experts on every rank's tokens, all_reduce(sum)
  the partial outputs and keep this rank's slice. On GPU each (token, slot) pair is sent only
  to the rank that owns its expert with two ``alltoall_single`` calls (untested).

Failure semantics: a collective that fails (peer died: its sockets close, the error is
immediate; peer hung: gloo's fixed 30 s context timeout) raises ``EPCommunicationError``
and the group is unusable from then on; the worker exits with an error. Rendezvous happens
after the model is loaded, so a slow loader cannot trip the 30 s collective timeout;
the rendezvous itself waits up to ``EP_RENDEZVOUS_TIMEOUT_S`` for the other ranks.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
import paddle

from config.engine_config import EngineConfig

logger = logging.getLogger(__name__)

# Time for every rank to load its model and reach the rendezvous (the engine allows 900 s to start).
EP_RENDEZVOUS_TIMEOUT_S = 600
# gloo's default context timeout (measured on Paddle 3.3.1: a collective whose peer never joins
# raises after 30 s); Paddle does not expose a setter for ProcessGroupGloo.
GLOO_COLLECTIVE_TIMEOUT_S = 30.0

SHARD_LAYOUTS = ("contiguous", "round_robin")


class EPCommunicationError(RuntimeError):
    """A collective of the EP group failed (a peer died or timed out); the group cannot be used again."""


def shard_experts(num_experts: int, ep_size: int, ep_rank: int, layout: str = "contiguous") -> list[int]:
    """Global ids of the experts EP rank ``ep_rank`` holds.

    ``contiguous``: balanced consecutive ranges (the first ``num_experts % ep_size`` ranks get
    one more); ``round_robin``: expert ``e`` goes to rank ``e % ep_size``. Every expert has
    exactly one owner; a rank may own none when there are more ranks than experts.
    """
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"EP rank {ep_rank} is outside a group of {ep_size}")
    if num_experts < 1:
        raise ValueError(f"cannot shard {num_experts} experts")
    if layout == "round_robin":
        return list(range(ep_rank, num_experts, ep_size))
    if layout != "contiguous":
        raise ValueError(f"unknown expert shard layout {layout!r}; expected one of {SHARD_LAYOUTS}")
    base, extra = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return list(range(start, start + base + (1 if ep_rank < extra else 0)))


def expert_owners(num_experts: int, ep_size: int, layout: str = "contiguous") -> np.ndarray:
    """[num_experts] int64: the EP rank that holds each expert."""
    owners = np.empty(num_experts, dtype=np.int64)
    for rank in range(ep_size):
        owners[shard_experts(num_experts, ep_size, rank, layout)] = rank
    return owners


@dataclass
class StepFlags:
    """The lockstep decision of one worker-loop round, the same on every rank."""

    any_batch: bool
    any_stop: bool


class ExpertParallelGroup:
    """One worker's membership in the EP group: rendezvous and collectives that fail loudly."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int,
                 rendezvous_timeout_s: int = EP_RENDEZVOUS_TIMEOUT_S) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"an EP group needs rank in 0..world_size-1 and world_size >= 2, "
                             f"got rank {rank} of {world_size}")
        if not 0 < master_port < 65536:
            raise ValueError(f"EP master port must be set (1..65535), got {master_port}; "
                             "the launcher picks a free port for config.parallel.master_port")
        self.rank = rank
        self.world_size = world_size
        self.master_addr = master_addr
        self.master_port = master_port
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.backend = "nccl" if _on_gpu() else "gloo"
        # Collectives run so far; the worker compares it around a failed forward to tell whether
        # this rank already entered the group's collectives for the step.
        self.num_collectives = 0
        self._store = None
        self._pg = None
        self._group = None
        self._broken: str | None = None

    @property
    def connected(self) -> bool:
        return self._pg is not None or self._group is not None

    def connect(self) -> None:
        """Rendezvous with the other ranks (blocks until all joined, or the rendezvous timeout)."""
        if self.connected:
            raise RuntimeError("the EP group is already connected")
        # Paddle's ProcessGroup reads the global rank from these; they must be set before creating it.
        os.environ["PADDLE_TRAINER_ID"] = str(self.rank)
        os.environ["PADDLE_TRAINERS_NUM"] = str(self.world_size)
        endpoint = f"{self.master_addr}:{self.master_port}"
        logger.info("joining the EP group as rank %d of %d (%s, master %s)", self.rank, self.world_size,
                    self.backend, endpoint)
        try:
            if self.backend == "nccl":
                self._connect_nccl(endpoint)
            else:
                self._connect_gloo()
        except Exception as exc:
            raise EPCommunicationError(f"EP rank {self.rank} could not join the group at {endpoint} within "
                                       f"{self.rendezvous_timeout_s} s: {exc}") from exc
        logger.info("EP group ready: rank %d of %d", self.rank, self.world_size)

    def _connect_gloo(self) -> None:
        from paddle.base import core

        # Rank 0 hosts the store; its constructor waits until every rank has connected.
        self._store = core.TCPStore(self.master_addr, self.master_port, self.rank == 0, self.world_size,
                                    self.rendezvous_timeout_s)
        self._pg = core.ProcessGroupGloo.create(self._store, self.rank, self.world_size, 0)

    def _connect_nccl(self, endpoint: str) -> None:
        """GPU path (untested here): the documented env-var rendezvous of paddle.distributed."""
        import paddle.distributed as dist

        os.environ["PADDLE_MASTER"] = endpoint
        os.environ["PADDLE_CURRENT_ENDPOINT"] = endpoint
        os.environ["PADDLE_TRAINER_ENDPOINTS"] = endpoint
        # The device this worker was placed on ("gpu:N"); init_parallel_env binds NCCL to it.
        os.environ["FLAGS_selected_gpus"] = paddle.device.get_device().split(":")[1]
        self._group = dist.init_parallel_env()

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, tensor: paddle.Tensor, op: str = "sum") -> paddle.Tensor:
        """In-place element-wise ``sum`` or ``max`` over all ranks; returns ``tensor``.

        Float16 is refused: gloo returns inf for it without an error (ARCHITECTURE.md).
        """
        if tensor.dtype == paddle.float16:
            raise TypeError("EP all_reduce refuses float16 (gloo silently returns inf); use float32 or bfloat16")
        if op not in ("sum", "max"):
            raise ValueError(f"unsupported reduce op {op!r}")

        def run() -> None:
            if self._pg is not None:
                from paddle.base import core

                self._pg.all_reduce(tensor, core.ReduceOp.SUM if op == "sum" else core.ReduceOp.MAX, True).wait()
            else:
                import paddle.distributed as dist

                dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX,
                                group=self._group)

        self._run(f"all_reduce({op}) of {list(tensor.shape)}", run)
        return tensor

    def all_gather(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """Every rank's ``tensor`` (same shape on all ranks) concatenated along axis 0, in rank order."""
        gathered = paddle.empty([self.world_size * tensor.shape[0], *tensor.shape[1:]], dtype=tensor.dtype)

        def run() -> None:
            if self._pg is not None:
                self._pg.all_gather_into_tensor(gathered, tensor, True).wait()
            else:
                import paddle.distributed as dist

                parts: list[paddle.Tensor] = []
                dist.all_gather(parts, tensor, group=self._group)
                paddle.assign(paddle.concat(parts, axis=0), output=gathered)

        self._run(f"all_gather of {list(tensor.shape)}", run)
        return gathered

    def all_to_all(self, tensor: paddle.Tensor, send_counts: list[int], recv_counts: list[int]) -> paddle.Tensor:
        """Rows ``send_counts[r]`` of ``tensor`` go to rank r; returns the rows received, by source rank.

        NCCL only (gloo raises NotImplementedError for alltoall); untested here.
        """
        if self.backend != "nccl":
            raise NotImplementedError("all_to_all needs the NCCL backend; gloo has no alltoall")
        received = paddle.empty([int(sum(recv_counts)), *tensor.shape[1:]], dtype=tensor.dtype)

        def run() -> None:
            import paddle.distributed as dist

            dist.alltoall_single(received, tensor, in_split_sizes=list(send_counts),
                                 out_split_sizes=list(recv_counts), group=self._group)

        self._run(f"all_to_all of {list(tensor.shape)}", run)
        return received

    def step_flags(self, has_batch: bool, stop_requested: bool) -> StepFlags:
        """The worker loop's per-round agreement: does any rank have a batch / want to stop?"""
        flags = paddle.to_tensor(np.array([int(has_batch), int(stop_requested)], dtype=np.int64))
        reduced = self.all_reduce(flags, "max").numpy()
        return StepFlags(any_batch=bool(reduced[0]), any_stop=bool(reduced[1]))

    def _run(self, what: str, collective: Callable[[], None]) -> None:
        if self._broken is not None:
            raise EPCommunicationError(f"EP group of rank {self.rank} is broken ({self._broken}); {what} refused")
        if not self.connected:
            raise RuntimeError(f"{what} called before the EP group was connected")
        self.num_collectives += 1
        try:
            collective()
        except Exception as exc:
            self._broken = f"{what} failed: {exc}"
            raise EPCommunicationError(
                f"EP rank {self.rank}: {what} failed; a peer rank died or did not join within "
                f"{GLOO_COLLECTIVE_TIMEOUT_S:.0f} s: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Drop the group; peers still inside a collective with us get an error, not a hang."""
        self._pg = None
        self._store = None
        self._group = None


class DataParallelExpertParallel:
    """``TokenExchangeExpertParallel`` for DP+EP: ranks hold different tokens and a shard of the experts.

    Used by ``MoEForCausalLM``: ``begin_forward`` once per forward on every rank, then per sparse
    layer ``dispatch_tokens`` (the tokens this rank's experts must process, with their routing)
    and ``combine_outputs`` (this rank's tokens' summed expert outputs). Every call is a
    collective, so every rank must run the same number of forwards (the worker's lockstep loop).
    """

    def __init__(self, group: ExpertParallelGroup, num_experts: int, layout: str = "contiguous") -> None:
        self.group = group
        self.num_experts = num_experts
        self.local_expert_ids = shard_experts(num_experts, group.world_size, group.rank, layout)
        self._owners = expert_owners(num_experts, group.world_size, layout)
        self._use_all_to_all = group.backend == "nccl"
        self._counts: np.ndarray | None = None
        self._valid_rows: paddle.Tensor | None = None
        self._pending_return: tuple[paddle.Tensor, list[int], list[int], int] | None = None

    @property
    def ep_rank(self) -> int:
        return self.group.rank

    @property
    def ep_size(self) -> int:
        return self.group.world_size

    # ------------------------------------------------------------------ per forward

    def begin_forward(self, num_tokens: int) -> None:
        """Learn every rank's token count for this forward (the same for all its sparse layers)."""
        if num_tokens < 1:
            raise ValueError(f"a forward needs at least one token, got {num_tokens}")
        if self._use_all_to_all:
            return  # per-layer counts are exchanged inside dispatch_tokens
        counts = self.group.all_gather(paddle.to_tensor(np.array([num_tokens], dtype=np.int64))).numpy()
        self._counts = counts
        padded = int(counts.max())
        self._valid_rows = None
        if int(counts.min()) != padded:
            rows = [rank * padded + np.arange(count, dtype=np.int64) for rank, count in enumerate(counts)]
            self._valid_rows = paddle.to_tensor(np.concatenate(rows))

    # ------------------------------------------------------------------ per sparse layer

    def dispatch_tokens(self, hidden: paddle.Tensor, topk_ids: paddle.Tensor, topk_weights: paddle.Tensor
                        ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """(hidden [N, H], topk_ids [N, k'] int64, topk_weights [N, k']) this rank's experts must process."""
        if self._use_all_to_all:
            return self._dispatch_all_to_all(hidden, topk_ids, topk_weights)
        if self._counts is None:
            raise RuntimeError("dispatch_tokens called before begin_forward")
        num_tokens, hidden_size = hidden.shape
        if num_tokens != int(self._counts[self.ep_rank]):
            raise ValueError(f"layer got {num_tokens} tokens, begin_forward announced {self._counts[self.ep_rank]}")
        top_k = topk_ids.shape[1]
        # One collective per layer: ids travel as float32 (exact below 2**24) beside the rows.
        packed = paddle.concat([hidden, topk_ids.astype("float32"), topk_weights.astype("float32")], axis=1)
        padded = int(self._counts.max())
        if num_tokens < padded:
            packed = paddle.concat([packed, paddle.zeros([padded - num_tokens, packed.shape[1]], "float32")])
        gathered = self.group.all_gather(packed)
        if self._valid_rows is not None:
            gathered = paddle.gather(gathered, self._valid_rows)
        tokens = gathered[:, :hidden_size]
        ids = gathered[:, hidden_size:hidden_size + top_k].round().astype("int64")
        weights = gathered[:, hidden_size + top_k:]
        return tokens, ids, weights

    def combine_outputs(self, outputs: paddle.Tensor) -> paddle.Tensor:
        """This rank's tokens' outputs [T, H] from the local experts' partial outputs of ``dispatch_tokens``' rows."""
        if self._use_all_to_all:
            return self._combine_all_to_all(outputs)
        total = self.group.all_reduce(outputs.contiguous(), "sum")
        start = int(self._counts[: self.ep_rank].sum())
        return total[start: start + int(self._counts[self.ep_rank])]

    # ------------------------------------------------------------------ GPU: alltoall (untested here)

    def _dispatch_all_to_all(self, hidden: paddle.Tensor, topk_ids: paddle.Tensor, topk_weights: paddle.Tensor
                             ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """Send each (token, slot) pair to its expert's owner; received pairs have top_k 1."""
        ids = topk_ids.numpy().astype(np.int64)
        num_tokens, top_k = ids.shape
        owners = self._owners[ids.reshape(-1)]
        order = np.argsort(owners, kind="stable").astype(np.int64)
        send_counts = np.bincount(owners, minlength=self.ep_size).astype(np.int64)
        recv_counts = self.group.all_to_all(paddle.to_tensor(send_counts.reshape(-1, 1)), [1] * self.ep_size,
                                            [1] * self.ep_size).numpy().reshape(-1)
        token_rows = paddle.to_tensor(order // top_k)
        pair_index = paddle.to_tensor(order)
        payload = paddle.concat([
            paddle.gather(hidden, token_rows),
            paddle.gather(topk_ids.reshape([-1]), pair_index).astype(hidden.dtype).unsqueeze(1),
            paddle.gather(topk_weights.reshape([-1]), pair_index).astype(hidden.dtype).unsqueeze(1),
        ], axis=1)
        received = self.group.all_to_all(payload, send_counts.tolist(), recv_counts.tolist())
        hidden_size = hidden.shape[1]
        self._pending_return = (token_rows, send_counts.tolist(), recv_counts.tolist(), num_tokens)
        return (received[:, :hidden_size], received[:, hidden_size:hidden_size + 1].round().astype("int64"),
                received[:, hidden_size + 1:])

    def _combine_all_to_all(self, outputs: paddle.Tensor) -> paddle.Tensor:
        if self._pending_return is None:
            raise RuntimeError("combine_outputs called without a dispatch_tokens before it")
        token_rows, send_counts, recv_counts, num_tokens = self._pending_return
        self._pending_return = None
        returned = self.group.all_to_all(outputs, recv_counts, send_counts)
        total = paddle.zeros([num_tokens, outputs.shape[1]], dtype=outputs.dtype)
        return paddle.index_add(total, token_rows, 0, returned)


def _on_gpu() -> bool:
    return paddle.is_compiled_with_cuda() and paddle.device.get_device().startswith("gpu")


def expert_parallel_enabled(config: EngineConfig) -> bool:
    """True when this worker must join an EP group (``--enable-expert-parallel`` with ``dp_size > 1``)."""
    return bool(config.parallel.enable_expert_parallel) and config.parallel.data_parallel_size > 1


def build_expert_parallel(config: EngineConfig) -> DataParallelExpertParallel:
    """This worker's (not yet connected) DP+EP handle from the engine config; ep_rank = dp_rank."""
    model_config = config.model
    if model_config.num_experts <= 0:
        raise ValueError(f"--enable-expert-parallel needs a mixture-of-experts model; {model_config.architecture!r} "
                         "has no experts")
    parallel = config.parallel
    group = ExpertParallelGroup(parallel.dp_rank, parallel.data_parallel_size, parallel.master_addr,
                                parallel.master_port)
    return DataParallelExpertParallel(group, model_config.num_experts)
