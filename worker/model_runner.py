"""The model runner: owns the model, the KV cache memory and the sampler of one worker rank.

``execute_model`` turns one ``StepBatch`` into tensors, runs the forward pass
over the paged KV cache, samples the sequences that need a next token and
returns a ``StepResult``. On CPU the KV cache is a POSIX shared-memory segment
so the cache-transfer process can map the same bytes (ARCHITECTURE.md).
With expert parallelism (DP+EP) the model holds only this rank's experts and every
forward is a collective of the EP group; ``execute_dummy`` runs the one-token forward an
idle rank contributes so the others' collectives complete. Its KV goes to a private
one-block scratch cache, never to the shared pool: appending a block to the shared segment
would change the strides of the [layers, 2, blocks, ...] layout the cache-transfer process
maps with ``num_gpu_blocks``.
With tensor parallelism (``tp_size`` > 1) the model holds this rank's shard, its KV segment holds
this rank's KV heads of every block, and ``all_reduce`` (the TP group's) sums the partial outputs;
only rank 0 samples (the LM head is replicated, so its logits are the whole vocabulary).
Import this module only after the compute-thread variables are set.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import paddle

from config.engine_config import EngineConfig
from inter_communicator.messages import ScheduledSeq, StepBatch, StepResult, TokenLogprobs
from cache_manager.kv_layout import device_cache_segment, device_cache_shape
from inter_communicator.shm import SharedArray
from worker.attention import AttentionMetadata, build_attention_metadata, kv_cache_views
from worker.loader import load_weights
from worker.models import get_model_class
from worker.logprobs import token_logprobs
from worker.sampler import NON_FINITE_LOGITS, Sampler, SamplingError, as_float32_numpy

if TYPE_CHECKING:
    from worker.expert_parallel import DataParallelExpertParallel

logger = logging.getLogger(__name__)

# Prompt positions per LM-head slice for prompt logprobs: 256 x 49152 float32 logits = 48 MiB.
PROMPT_LOGPROBS_ROWS = 256


def kv_cache_segment_name(config: EngineConfig, tp_rank: int) -> str:
    return device_cache_segment(config.instance_id, config.parallel.dp_rank, tp_rank)


@dataclass
class PreparedStep:
    """A step's device inputs, built on the host before the forward (no collective involved)."""

    batch: StepBatch
    input_ids: paddle.Tensor
    positions: paddle.Tensor
    meta: AttentionMetadata
    started: float


class ModelRunner:
    def __init__(self, config: EngineConfig, tp_rank: int = 0, ep: DataParallelExpertParallel | None = None,
                 all_reduce: Callable[[paddle.Tensor], paddle.Tensor] | None = None) -> None:
        """``ep``: this rank's expert-parallel handle (``worker.expert_parallel``), None without EP;
        ``all_reduce``: the TP group's sum over ranks, needed when ``tensor_parallel_size`` > 1."""
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = config.parallel.tensor_parallel_size
        self.block_size = config.cache.block_size
        self.ep = ep
        self.model = self._load_model(all_reduce)
        shape = device_cache_shape(config.model, config.cache.num_gpu_blocks, self.block_size, self.tp_size)
        self.kv_segment = SharedArray(kv_cache_segment_name(config, tp_rank), shape, np.float32, create=True)
        # Touch every page now: the pool's memory is committed at start-up (a full /dev/shm fails here, not
        # mid-request) and serving neither page-faults nor shows first-touch growth as RSS creep.
        self.kv_segment.array.fill(0.0)
        self.kv_caches = kv_cache_views(self.kv_segment.array)
        self._scratch_kv: np.ndarray | None = None
        self._scratch_kv_caches: list[tuple[paddle.Tensor, paddle.Tensor]] = []
        if ep is not None:
            self._scratch_kv = np.zeros(device_cache_shape(config.model, 1, self.block_size), dtype=np.float32)
            self._scratch_kv_caches = kv_cache_views(self._scratch_kv)
        self.sampler = Sampler()
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB) in shared memory %s",
                    config.cache.num_gpu_blocks, self.block_size, self.kv_segment.array.nbytes / 2**20,
                    kv_cache_segment_name(config, tp_rank))

    def _load_model(self, all_reduce: Callable[[paddle.Tensor], paddle.Tensor] | None) -> paddle.nn.Layer:
        model_config = self.config.model
        model_class = get_model_class(model_config.architecture)
        if self.ep is not None:
            model = model_class(model_config, ep=self.ep)
        elif self.tp_size > 1:
            # Every rank reads the whole checkpoint; the model keeps its shard (tensor_parallel.ShardPlan).
            model = model_class(model_config, tp_rank=self.tp_rank, tp_size=self.tp_size, all_reduce=all_reduce)
        else:
            model = model_class(model_config)
        # An expert-parallel rank reads only its own experts' tensors from the checkpoint.
        model.load_weights(load_weights(model_config, keep=model.needs_weight))
        model.eval()
        return model

    @paddle.no_grad()
    def execute_model(self, batch: StepBatch) -> StepResult:
        """Run one engine step: forward every scheduled token, sample where asked."""
        step = self.prepare_step(batch)
        return self.sample_step(step, self.forward(step))

    def prepare_step(self, batch: StepBatch) -> PreparedStep:
        """Host-side inputs and attention metadata; raises ValueError on an inconsistent batch."""
        started = time.perf_counter()
        input_ids, positions = self._flatten_inputs(batch)
        meta = build_attention_metadata(
            query_lens=[len(s.token_ids) for s in batch.seqs],
            context_lens=[s.context_len for s in batch.seqs],
            block_tables=[s.block_table for s in batch.seqs],
            block_size=self.block_size,
        )
        return PreparedStep(batch, paddle.to_tensor(input_ids), paddle.to_tensor(positions), meta, started)

    @paddle.no_grad()
    def forward(self, step: PreparedStep) -> paddle.Tensor:
        """The model forward over the shared KV cache (a collective of the EP group under EP)."""
        self._copy_blocks(step.batch.block_copies)
        return self.model(step.input_ids, step.positions, self.kv_caches, step.meta)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of shared partial blocks: every layer's K and V of block src into dst."""
        if not pairs:
            return
        num_blocks = self.config.cache.num_gpu_blocks
        for src, dst in pairs:
            if not (0 <= src < num_blocks and 0 <= dst < num_blocks) or src == dst:
                raise ValueError(f"block copy {src} -> {dst} is outside the pool of {num_blocks} blocks")
        src_ids = np.asarray([src for src, _ in pairs], dtype=np.int64)
        dst_ids = np.asarray([dst for _, dst in pairs], dtype=np.int64)
        # Layout [layers, 2, blocks, ...] (kv_layout.device_cache_shape).
        cache = self.kv_segment.array
        cache[:, :, dst_ids] = cache[:, :, src_ids]

    @paddle.no_grad()
    def sample_step(self, step: PreparedStep, hidden: paddle.Tensor) -> StepResult:
        result = StepResult(step_id=step.batch.step_id)
        self._sample(step.batch, hidden, result)
        result.execute_seconds = time.perf_counter() - step.started
        return result

    @paddle.no_grad()
    def execute_dummy(self) -> None:
        """A one-token forward into the private scratch block, output discarded (EP idle ranks)."""
        if self.ep is None:
            raise RuntimeError("execute_dummy is only for expert-parallel workers")
        meta = build_attention_metadata(query_lens=[1], context_lens=[1], block_tables=[[0]],
                                        block_size=self.block_size)
        token = paddle.to_tensor(np.zeros(1, dtype=np.int64))
        self.model(token, meta.positions, self._scratch_kv_caches, meta)

    @staticmethod
    def _flatten_inputs(batch: StepBatch) -> tuple[np.ndarray, np.ndarray]:
        total = sum(len(s.token_ids) for s in batch.seqs)
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        offset = 0
        for seq in batch.seqs:
            n = len(seq.token_ids)
            input_ids[offset:offset + n] = seq.token_ids
            positions[offset:offset + n] = np.arange(seq.context_len - n, seq.context_len)
            offset += n
        return input_ids, positions

    def _sample(self, batch: StepBatch, hidden: paddle.Tensor, result: StepResult) -> None:
        """Sample the sequences that need a token (with their logprobs if asked) and compute the
        prompt logprobs of the chunks that ask for them; per-request failures go to ``result.errors``."""
        last_rows: list[tuple[int, ScheduledSeq]] = []
        offset = 0
        for seq in batch.seqs:
            if seq.prompt_logprobs is not None:
                self._prompt_logprobs(seq, hidden, offset, result)
            offset += len(seq.token_ids)
            if seq.needs_sample:
                last_rows.append((offset - 1, seq))
        # A request whose prompt logprobs failed is stopped: it gets no token either.
        last_rows = [(row, seq) for row, seq in last_rows if seq.request_id not in result.errors]
        if not last_rows:
            return
        rows = [row for row, _ in last_rows]
        sampled = [seq for _, seq in last_rows]
        last_hidden = paddle.index_select(hidden, paddle.to_tensor(np.asarray(rows, dtype=np.int64)))
        logits = as_float32_numpy(self.model.compute_logits(last_hidden))
        params = [seq.sampling_params for seq in sampled]
        num_output_tokens = [seq.num_output_tokens for seq in sampled]
        reasons: dict[int, str] = {}
        try:
            tokens = self.sampler.sample(logits, params, num_output_tokens, sampled)
        except SamplingError as exc:
            # Rows that cannot be sampled fail their request; the others keep the tokens already drawn.
            tokens, reasons = exc.tokens, exc.reasons
            for row, reason in reasons.items():
                seq = sampled[row]
                result.errors[seq.request_id] = (f"{reason} at output position {seq.num_output_tokens}; "
                                                 "the request was stopped")
        want = [i for i, p in enumerate(params) if p.logprobs is not None and i not in reasons]
        if want:
            # Raw logprobs: ``logits`` is the model's output, untouched by the sampler's processors.
            for i, lp in zip(want, token_logprobs(logits[want], tokens[want], [params[i].logprobs for i in want])):
                result.logprobs[sampled[i].request_id] = lp
        for seq, token in zip(sampled, tokens):
            if seq.request_id not in result.errors:
                result.sampled_token_ids[seq.request_id] = int(token)

    def _prompt_logprobs(self, seq: ScheduledSeq, hidden: paddle.Tensor, offset: int, result: StepResult) -> None:
        """Logprobs of the prompt tokens this chunk predicts: position p of the chunk predicts the
        token at p + 1, the chunk's last position predicts ``next_prompt_token_id`` (skipped when
        None: it is the sampled position, or there is nothing after the prompt)."""
        targets = list(seq.token_ids[1:])
        if seq.next_prompt_token_id is not None:
            targets.append(seq.next_prompt_token_id)
        vocab = self.config.model.vocab_size
        outside = [t for t in targets if not 0 <= t < vocab]
        if outside:
            result.errors[seq.request_id] = (f"prompt token id {outside[0]} is outside the vocabulary of {vocab} "
                                             "tokens; the request was stopped")
            return
        out: list[TokenLogprobs] = []
        # The LM head over a whole chunk would be [chunk, vocab] float32 (a 4k chunk: 800 MB): slice it.
        for start in range(0, len(targets), PROMPT_LOGPROBS_ROWS):
            stop = min(start + PROMPT_LOGPROBS_ROWS, len(targets))
            logits = as_float32_numpy(self.model.compute_logits(hidden[offset + start: offset + stop]))
            finite = np.isfinite(logits).all(axis=1)
            if not finite.all():
                position = seq.context_len - len(seq.token_ids) + start + int(np.flatnonzero(~finite)[0])
                result.errors[seq.request_id] = (f"{NON_FINITE_LOGITS} at prompt position {position}; "
                                                 "the request was stopped")
                return
            out.extend(token_logprobs(logits, targets[start:stop], [seq.prompt_logprobs] * (stop - start)))
        result.prompt_logprobs[seq.request_id] = out

    def close(self) -> None:
        self.kv_caches = []
        self._scratch_kv_caches = []
        self.kv_segment.close()
        self.kv_segment.unlink()
