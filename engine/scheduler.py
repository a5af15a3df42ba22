"""Continuous batching with chunked prefill, prefix caching and recompute preemption.

Each step spends a token budget (``--max-num-batched-tokens``): running
sequences first (one token for a decode, a chunk for an unfinished prefill),
then waiting ones while sequences and blocks allow. A sequence entering the
running set gets its cached prefix from the ``KVCacheManager``; admission
is decided on what it needs after the prefix match, so a waiting sequence that
does not fit stays waiting and ``schedule`` never fails for lack of blocks.
While blocks of it are still being filled from host memory or storage it is not
scheduled; if the fills outlast the transfer timeout, the next ``schedule``
preempts it and it is recomputed without the lower tiers. When a running
sequence needs a block and none is free, the most recently admitted sequence is
preempted: its blocks are released and it is recomputed from its tokens later
(its full blocks usually stay cached). A sequence that would need more blocks
than the whole pool ends with an error.
"""
from __future__ import annotations

import logging
from collections import deque

from cache_manager.kv_cache_manager import KVCacheManager
from engine.request import RequestOutput
from engine.sequence import Sequence, SequenceStatus
from inter_communicator.messages import ScheduledSeq, StepBatch, StepResult

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, schedule_on_fill_start: bool = False) -> None:
        self.kv_cache = kv_cache
        # Test-only fault (FD_KVCACHE_FAULT_EARLY_SCHEDULE): run a sequence once its fills have started.
        self.schedule_on_fill_start = schedule_on_fill_start
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._step_id = 0
        self._inflight: dict[int, list[tuple[Sequence, int]]] = {}
        self.num_preemptions = 0

    # ---- admission -------------------------------------------------------

    def add(self, seq: Sequence) -> RequestOutput | None:
        """Queue a sequence; returns an error output instead if it can never run."""
        problem = self._admission_problem(seq)
        if problem:
            return RequestOutput(seq.request_id, [], finished=True, finish_reason="error",
                                 num_prompt_tokens=seq.num_prompt_tokens, error=problem)
        self.waiting.append(seq)
        return None

    def _admission_problem(self, seq: Sequence) -> str | None:
        if seq.num_prompt_tokens == 0:
            return "the prompt is empty"
        if seq.num_prompt_tokens >= self.max_model_len:
            return f"prompt has {seq.num_prompt_tokens} tokens; the maximum model length is {self.max_model_len}"
        return self._pool_problem(seq)

    def _pool_problem(self, seq: Sequence) -> str | None:
        """Why ``seq`` can never run its next step, however many blocks are freed (the pool is too small)."""
        needed = self.kv_cache.blocks_needed(seq.num_tokens)
        if needed > self.kv_cache.num_blocks:
            return (f"{seq.request_id} needs {needed} KV blocks for {seq.num_tokens} tokens; "
                    f"the pool has {self.kv_cache.num_blocks}")
        return None

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq)
                    return seq
        return None

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_steps(self) -> int:
        return self._step_id

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- scheduling ------------------------------------------------------

    def schedule(self) -> StepBatch | None:
        self.preempt_expired_loads()
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        budget, preempted = self._schedule_running(budget, scheduled)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        if not scheduled:
            return None
        # Single-token sequences first: the worker's attention batches them in one path.
        scheduled.sort(key=lambda item: item[1] != 1)
        self._step_id += 1
        self._inflight[self._step_id] = scheduled
        return StepBatch(self._step_id, [self._to_message(seq, n) for seq, n in scheduled])

    def _schedule_running(self, budget: int, scheduled: list[tuple[Sequence, int]]) -> tuple[int, bool]:
        """Returns the remaining budget and whether anything was preempted."""
        preempted_any = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if self._is_loading(seq):
                index += 1
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            fits, preempted = self._make_room(seq, seq.num_computed_tokens + num_new)
            preempted_any |= preempted
            if not fits:
                break  # seq itself was preempted; it was the last running one
            if not self.kv_cache.try_allocate(seq, seq.num_computed_tokens + num_new):
                # _make_room just checked the same need; never reached, but never worth a crash either.
                logger.error("%s: blocks vanished after room was made; trying again next step", seq.request_id)
                break
            scheduled.append((seq, num_new))
            budget -= num_new
            index += 1
        return budget, preempted_any

    def _make_room(self, seq: Sequence, num_tokens: int) -> tuple[bool, bool]:
        """Preempt from the back of the running list until ``seq`` fits.

        Returns (seq fits, anything preempted). The victims come from behind
        ``seq`` in the list, so none of them was scheduled earlier this step. When
        ``seq`` is the victim (blocks held by transfers, not by sequences), it waits
        for them like any new request.
        """
        preempted = False
        while not self.kv_cache.can_allocate(seq, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            preempted = True
            if victim is seq:
                return False, True
        return True, preempted

    def _schedule_waiting(self, budget: int, scheduled: list[tuple[Sequence, int]]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Decided on the need after the prefix match (hits that were evictable are no longer free,
            # fills take fresh blocks, the first chunk starts after the cached prefix), so the allocate
            # below cannot fail; a sequence that does not fit keeps waiting.
            if not self.kv_cache.try_admit(seq, budget):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if self._is_loading(seq):
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.kv_cache.try_allocate(seq, seq.num_computed_tokens + num_new):
                # try_admit counted this chunk; never reached. The running pass deals with it next step.
                logger.error("%s: admitted but its first chunk does not fit; retrying next step", seq.request_id)
                break
            scheduled.append((seq, num_new))
            budget -= num_new

    def _is_loading(self, seq: Sequence) -> bool:
        return self.kv_cache.is_loading(seq, started_is_enough=self.schedule_on_fill_start)

    def preempt_expired_loads(self) -> None:
        """Sequences whose cache fills outlasted the transfer timeout go back to waiting, to be recomputed.

        ``schedule`` calls it first; a fill timeout is a scheduling decision, not the engine loop's.
        """
        for seq in self.kv_cache.expired_loads():
            if seq in self.running:
                self.running.remove(seq)
                self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.info("preempted %s (%d tokens) to free blocks; it will be recomputed", seq.request_id, seq.num_tokens)

    @staticmethod
    def _to_message(seq: Sequence, num_new: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        needs_sample = start + num_new == seq.num_tokens
        return ScheduledSeq(
            request_id=seq.request_id,
            token_ids=seq.token_ids_slice(start, start + num_new),
            context_len=start + num_new,
            block_table=list(seq.block_table),
            needs_sample=needs_sample,
            sampling_params=seq.sampling_params if needs_sample else None,
            num_output_tokens=len(seq.output_token_ids),
        )

    # ---- results ---------------------------------------------------------

    def update(self, result: StepResult) -> list[RequestOutput]:
        scheduled = self._inflight.pop(result.step_id, None)
        if scheduled is None:
            raise RuntimeError(f"result for unknown step {result.step_id}")
        outputs: list[RequestOutput] = []
        for seq, num_new in scheduled:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            seq.num_computed_tokens += num_new
            self.kv_cache.on_tokens_computed(seq)
            error = result.errors.get(seq.request_id)
            if error is not None:
                outputs.append(self._finish_with(seq, "error", error))
                continue
            token = result.sampled_token_ids.get(seq.request_id)
            if token is not None:
                outputs.append(self._append_token(seq, token))
        return outputs

    def discard_inflight(self) -> list[Sequence]:
        """Forget every in-flight step (the worker died); returns the sequences that were in them."""
        seqs = [seq for steps in self._inflight.values() for seq, _ in steps]
        self._inflight.clear()
        return seqs

    def _append_token(self, seq: Sequence, token: int) -> RequestOutput:
        params = seq.sampling_params
        if not params.ignore_eos and token in seq.eos_token_ids:
            return self._finish_with(seq, "stop")
        if token in params.stop_token_ids:
            return self._finish_with(seq, "stop")
        seq.output_token_ids.append(token)
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return self._finish_with(seq, "length")
        # Its next step must hold every token's K/V: end it now rather than preempting it forever.
        problem = self._pool_problem(seq)
        if problem is not None:
            return self._finish_with(seq, "error", problem)
        return self._output(seq)

    def _finish_with(self, seq: Sequence, reason: str, error: str | None = None) -> RequestOutput:
        self.running.remove(seq)
        self._finish(seq)
        return self._output(seq, finish_reason=reason, error=error)

    def _finish(self, seq: Sequence) -> None:
        self.kv_cache.free(seq)
        seq.status = SequenceStatus.FINISHED

    @staticmethod
    def _output(seq: Sequence, finish_reason: str | None = None, error: str | None = None) -> RequestOutput:
        new_tokens = seq.output_token_ids[seq.num_output_tokens_sent:]
        seq.num_output_tokens_sent = len(seq.output_token_ids)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            error=error,
        )
