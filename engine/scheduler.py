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

A request with n > 1 choices (``Sequence.pending_children``) prefills its prompt once: the parent
stops one token short of the prompt, then forks (``_fork``): each child shares the parent's full
blocks by reference count and gets a private copy of the partial last block (copy-on-write: the
copy rides in ``StepBatch.block_copies``, run by the worker before the forward). Every choice
then computes the last prompt token itself and samples from it. ``max_num_seqs`` counts choices,
forked or not.

Prompt logprobs: a sequence that still lacks them is admitted without prefix-cache hits (after a
preemption: none beyond the positions it scored already, so it keeps its progress), sends
``prompt_logprobs``/``next_prompt_token_id`` with each prefill chunk and collects the results by
position; the complete list goes out once, with the output that ends its prefill.

Structured output (optional ``structured_output`` manager): a waiting sequence whose grammar is
still compiling is passed over; sampled tokens are accepted into the grammar, whose bitmask goes
with the next sampling step.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Callable

from cache_manager.kv_cache_manager import KVCacheManager
from engine.request import RequestOutput
from engine.sequence import Sequence, SequenceStatus
from inter_communicator.messages import ScheduledSeq, StepBatch, StepResult, TokenLogprobs

if TYPE_CHECKING:
    from engine.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

STRUCTURED_OUTPUT_UNAVAILABLE = "structured output is not available in this engine"


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, schedule_on_fill_start: bool = False, lone_prefill_tokens: int = 0,
                 structured_output: "StructuredOutputManager | None" = None,
                 on_finish: Callable[[Sequence, str | None], None] | None = None) -> None:
        self.kv_cache = kv_cache
        # Called with a sequence and its finish reason (None: aborted) before its blocks are freed
        # (P/D: a prefill instance holds them for the decode instance, engine/disaggregation.py).
        self.on_finish = on_finish
        self.structured_output = structured_output
        # Test-only fault (FD_KVCACHE_FAULT_EARLY_SCHEDULE): run a sequence once its fills have started.
        self.schedule_on_fill_start = schedule_on_fill_start
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lone_prefill_tokens = lone_prefill_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._step_id = 0
        self._inflight: dict[int, list[tuple[Sequence, int]]] = {}
        self.num_preemptions = 0
        # Copy-on-write copies (src, dst, the child owning dst) not yet sent to the worker.
        self._pending_copies: list[tuple[int, int, Sequence]] = []
        # Outputs decided outside ``update`` (a grammar that failed to compile): ``take_outputs`` hands them out.
        self._early_outputs: list[RequestOutput] = []

    # ---- admission -------------------------------------------------------

    def add(self, seq: Sequence) -> RequestOutput | None:
        """Queue a sequence (with its unforked choices); returns an error output instead if it can never run."""
        problem = self._admission_problem(seq)
        if problem:
            return RequestOutput(seq.client_id, [], finished=True, finish_reason="error",
                                 num_prompt_tokens=seq.num_prompt_tokens, error=problem, index=seq.index)
        if seq.sampling_params.structured_output is not None:
            # Compiling starts now, off the loop; the sequence is admitted once its grammar is ready.
            self.structured_output.add(seq.request_id, seq.sampling_params.structured_output)
            seq.has_grammar = True
        self.waiting.append(seq)
        return None

    def _admission_problem(self, seq: Sequence) -> str | None:
        if seq.num_prompt_tokens == 0:
            return "the prompt is empty"
        if seq.num_prompt_tokens >= self.max_model_len:
            return f"prompt has {seq.num_prompt_tokens} tokens; the maximum model length is {self.max_model_len}"
        if seq.num_choices_held > self.max_num_seqs:
            return (f"n={seq.num_choices_held} choices exceed the {self.max_num_seqs} sequences the engine runs "
                    f"at once (--max-num-seqs)")
        if seq.sampling_params.structured_output is not None and self.structured_output is None:
            return STRUCTURED_OUTPUT_UNAVAILABLE
        problem = self._pool_problem(seq)
        if problem is None and seq.is_fork_pending:
            # The fork holds the prefilled prompt and one copy of its partial block per child at once.
            needed = (self.kv_cache.blocks_needed(seq.prefill_target)
                      + (seq.num_choices_held - 1) * (1 if seq.prefill_target % self.kv_cache.block_size else 0))
            if needed > self.kv_cache.num_blocks:
                problem = (f"{seq.client_id} needs {needed} KV blocks to share its prompt across "
                           f"{seq.num_choices_held} choices; the pool has {self.kv_cache.num_blocks}")
        return problem

    def _pool_problem(self, seq: Sequence) -> str | None:
        """Why ``seq`` can never run its next step, however many blocks are freed (the pool is too small)."""
        needed = self.kv_cache.blocks_needed(seq.num_tokens)
        if needed > self.kv_cache.num_blocks:
            return (f"{seq.request_id} needs {needed} KV blocks for {seq.num_tokens} tokens; "
                    f"the pool has {self.kv_cache.num_blocks}")
        return None

    def abort(self, request_id: str) -> Sequence | None:
        """End the sequence with internal id ``request_id`` (and its unforked choices, left in its
        ``pending_children``, all FINISHED); returns it, or None if it is not waiting or running."""
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq)
                    return seq
        return None

    def abort_request(self, client_id: str) -> list[Sequence]:
        """End every choice of the client's request (waiting, running or not yet forked); returns them all."""
        aborted: list[Sequence] = []
        for seq in [s for s in list(self.running) + list(self.waiting) if s.client_id == client_id]:
            if self.abort(seq.request_id) is seq:
                aborted.extend(choices_of(seq))
        return aborted

    def finish_stray(self, seq: Sequence) -> None:
        """End a sequence a failure left in neither queue: its blocks and grammar state are released."""
        self._finish(seq)

    def take_outputs(self) -> list[RequestOutput]:
        """Outputs decided while scheduling (requests failed before running); the engine sends them."""
        outputs, self._early_outputs = self._early_outputs, []
        return outputs

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

    def _num_running_choices(self) -> int:
        return sum(seq.num_choices_held for seq in self.running)

    def inflight_sequences(self, step_id: int) -> list[Sequence]:
        """The sequences scheduled in step ``step_id`` (still in flight)."""
        return [seq for seq, _ in self._inflight.get(step_id, [])]

    # ---- scheduling ------------------------------------------------------

    def schedule(self) -> StepBatch | None:
        self.preempt_expired_loads()
        budget = self._step_budget()
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
        messages = [self._to_message(seq, n) for seq, n in scheduled]
        self._attach_bitmasks(scheduled, messages)
        return StepBatch(self._step_id, messages, block_copies=self._take_copies())

    def _step_budget(self) -> int:
        """Tokens this step may compute: --max-num-batched-tokens, or --lone-prefill-tokens when one sequence is
        all there is (a lone prompt then prefills in fewer, larger chunks, which compute faster, and nobody's
        decode waits behind them; the next arrival brings the usual budget back at the next step)."""
        if len(self.running) + len(self.waiting) == 1:
            return max(self.max_num_batched_tokens, self.lone_prefill_tokens)
        return self.max_num_batched_tokens

    def _attach_bitmasks(self, scheduled: list[tuple[Sequence, int]], messages: list[ScheduledSeq]) -> None:
        """The grammar's allowed tokens for every structured-output sequence that samples: one batched call."""
        wanted = [(seq, msg) for (seq, _), msg in zip(scheduled, messages) if msg.needs_sample and seq.has_grammar]
        if not wanted:
            return
        masks = self.structured_output.fill_bitmasks([seq.request_id for seq, _ in wanted])
        for row, (seq, msg) in enumerate(wanted):
            # fill_bitmasks is None only if one of them is not ready; each then gets its own (or none).
            msg.allowed_token_bitmask = masks[row] if masks is not None else self.structured_output.bitmask(
                seq.request_id)

    def _take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies to run before this step's forward.

        A child preempted since its fork no longer owns its copy's destination (another sequence
        may have taken that block this very step): its copy is dropped.
        """
        copies = [(src, dst) for src, dst, child in self._pending_copies
                  if child.status is SequenceStatus.RUNNING and dst in child.block_table]
        self._pending_copies = []
        return copies

    def _schedule_running(self, budget: int, scheduled: list[tuple[Sequence, int]]) -> tuple[int, bool]:
        """Returns the remaining budget and whether anything was preempted."""
        preempted_any = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if self._is_loading(seq):
                index += 1
                continue
            if seq.is_fork_pending and seq.num_schedulable_tokens == 0:
                fits, preempted = self._make_room_for_fork(seq)
                preempted_any |= preempted
                if not fits:
                    index += 1  # the missing blocks are in transfers: the fork waits, keeping its prompt
                    continue
                self._fork(seq)
            num_new = min(seq.num_schedulable_tokens, budget)
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
        return self._preempt_until(seq, lambda: self.kv_cache.can_allocate(seq, num_tokens))

    def _make_room_for_fork(self, parent: Sequence) -> tuple[bool, bool]:
        """Preempt from the back of the running list until the parent's children can fork (as ``_make_room``).

        The parent itself is never the victim: when only blocks held by transfers are missing, it
        waits for them holding its prefilled prompt. Preempting it would throw the prompt away, and
        the same transfers (offload swapping out cached blocks) could take the blocks again on every
        retry. Its prompt plus the copies fit the pool (admission checked that).
        """
        return self._preempt_until(parent, lambda: self._fork_fits(parent), spare=True)

    def _fork_fits(self, parent: Sequence) -> bool:
        needed = len(parent.pending_children) * self.kv_cache.fork_cost(parent)
        return needed <= self.kv_cache.num_free_blocks

    def _preempt_until(self, seq: Sequence, fits: Callable[[], bool], spare: bool = False) -> tuple[bool, bool]:
        """Preempt from the back of the running list until ``fits()``; returns (seq fits, anything preempted).

        With ``spare``, ``seq`` itself is not preempted: (False, ...) when only it is left to take from.
        """
        preempted = False
        while not fits():
            if spare and self.running[-1] is seq:
                return False, preempted
            victim = self.running.pop()
            self._preempt(victim)
            preempted = True
            if victim is seq:
                return False, True
        return True, preempted

    def _fork(self, parent: Sequence) -> None:
        """The parent's prompt is prefilled up to its last token: its children join the running list behind it.

        Each child shares the parent's full blocks and owns a copy of its partial last block
        (queued for the next step's ``block_copies``); the prompt logprobs, complete by now, are copied.
        """
        children, parent.pending_children = parent.pending_children, []
        position = self.running.index(parent) + 1
        for offset, child in enumerate(children):
            copy = self.kv_cache.fork(parent, child)
            if copy is not None:
                self._pending_copies.append((copy[0], copy[1], child))
            child.status = SequenceStatus.RUNNING
            child.num_cached_tokens = parent.num_cached_tokens
            child.prompt_logprobs = list(parent.prompt_logprobs)
            if parent.has_grammar:
                self.structured_output.fork(parent.request_id, child.request_id)
                child.has_grammar = True
            self.running.insert(position + offset, child)
        logger.debug("%s forked into %d choices at %d prompt tokens", parent.client_id, len(children) + 1,
                     parent.num_computed_tokens)

    def _schedule_waiting(self, budget: int, scheduled: list[tuple[Sequence, int]]) -> None:
        position = 0
        while position < len(self.waiting) and budget > 0:
            seq = self.waiting[position]
            if self._num_running_choices() + seq.num_choices_held > self.max_num_seqs:
                break
            if seq.has_grammar and not self.structured_output.is_ready(seq.request_id):
                position += 1  # still compiling: the ones behind it need not wait
                continue
            if seq.has_grammar and self.structured_output.error(seq.request_id) is not None:
                del self.waiting[position]
                error = self.structured_output.error(seq.request_id)
                self._finish(seq)
                self._early_outputs.extend(self._outputs_of_choices(seq, "error", f"structured output: {error}"))
                continue
            # Decided on the need after the prefix match (hits that were evictable are no longer free,
            # fills take fresh blocks, the first chunk starts after the cached prefix), so the allocate
            # below cannot fail; a sequence that does not fit keeps waiting. Prompt logprobs need their
            # positions computed: no prefix-cache hits beyond the positions already scored.
            if not self.kv_cache.try_admit(seq, budget, max_hit_tokens=seq.max_prefix_hit_tokens):
                break
            del self.waiting[position]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if self._is_loading(seq):
                continue
            if seq.is_fork_pending and seq.num_schedulable_tokens == 0:
                if not self._fork_fits(seq):
                    continue  # no preemption for a new arrival: the running pass forks it next step
                self._fork(seq)
            for choice in self.running[self.running.index(seq):]:
                if budget <= 0:
                    break
                num_new = min(choice.num_schedulable_tokens, budget)
                if not self.kv_cache.try_allocate(choice, choice.num_computed_tokens + num_new):
                    # try_admit counted the first chunk; a fork's choices that do not fit run next step.
                    if choice is seq:
                        logger.error("%s: admitted but its first chunk does not fit; retrying next step",
                                     seq.request_id)
                    return
                scheduled.append((choice, num_new))
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

    def _to_message(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        end = start + num_new
        needs_sample = end == seq.num_tokens
        message = ScheduledSeq(
            request_id=seq.request_id,
            token_ids=seq.token_ids_slice(start, end),
            context_len=end,
            block_table=list(seq.block_table),
            needs_sample=needs_sample,
            sampling_params=seq.sampling_params if needs_sample else None,
            num_output_tokens=len(seq.output_token_ids),
        )
        if seq.needs_all_prompt_positions and start < seq.num_prompt_tokens:
            message.prompt_logprobs = seq.sampling_params.prompt_logprobs
            message.next_prompt_token_id = seq.prompt_token_ids[end] if end < seq.num_prompt_tokens else None
        if needs_sample:
            self._add_sampling_context(seq, message)
        return message

    def _add_sampling_context(self, seq: Sequence, message: ScheduledSeq) -> None:
        """What the worker's logits processors need, only for the requests that use it (messages stay small)."""
        params = seq.sampling_params
        if params.repetition_penalty != 1.0:
            message.prompt_token_ids = seq.prompt_token_ids
        if (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
                or params.bad_words_token_ids):
            message.output_token_ids = list(seq.output_token_ids)
        if len(seq.output_token_ids) < params.min_tokens:
            # vLLM: the stop ids (eos unless ignore_eos, plus stop_token_ids) cannot be sampled before min_tokens.
            banned = [] if params.ignore_eos else list(seq.eos_token_ids)
            banned += [t for t in params.stop_token_ids if t not in banned]
            message.banned_token_ids = banned or None

    # ---- results ---------------------------------------------------------

    def update(self, result: StepResult) -> list[RequestOutput]:
        scheduled = self._inflight.pop(result.step_id, None)
        if scheduled is None:
            raise RuntimeError(f"result for unknown step {result.step_id}")
        outputs: list[RequestOutput] = self.take_outputs()
        for seq, num_new in scheduled:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            start = seq.num_computed_tokens
            seq.num_computed_tokens += num_new
            self.kv_cache.on_tokens_computed(seq)
            error = result.errors.get(seq.request_id)
            if error is not None:
                outputs.extend(self._finish_with(seq, "error", error))
                continue
            if seq.needs_all_prompt_positions:
                self._record_prompt_logprobs(seq, start, result.prompt_logprobs.get(seq.request_id))
            token = result.sampled_token_ids.get(seq.request_id)
            if token is not None:
                outputs.extend(self._append_token(seq, token, result.logprobs.get(seq.request_id)))
        return outputs

    @staticmethod
    def _record_prompt_logprobs(seq: Sequence, start: int, entries: list[TokenLogprobs] | None) -> None:
        """Entry j of a chunk starting at ``start`` is the logprob of prompt position start + 1 + j.

        Only the next missing position is appended, so a chunk recomputed after a preemption
        records nothing twice.
        """
        for offset, entry in enumerate(entries or ()):
            position = start + 1 + offset
            if position >= seq.num_prompt_tokens:
                break
            if position == len(seq.prompt_logprobs):
                seq.prompt_logprobs.append(entry)

    def discard_inflight(self) -> list[Sequence]:
        """Forget every in-flight step (the worker died); returns the sequences that were in them."""
        seqs = [seq for steps in self._inflight.values() for seq, _ in steps]
        self._inflight.clear()
        return seqs

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprobs | None) -> list[RequestOutput]:
        params = seq.sampling_params
        # vLLM: before min_tokens, a stop id is an ordinary token (the worker bans them; this holds regardless).
        may_stop = len(seq.output_token_ids) >= params.min_tokens
        if may_stop and ((not params.ignore_eos and token in seq.eos_token_ids) or token in params.stop_token_ids):
            # vLLM's rule: the stopping token is part of the output (ids, logprob, completion_tokens);
            # the API server shows no text for it. Scoring harnesses read its logprob.
            self._record_token(seq, token, logprob)
            return self._finish_with(seq, "stop")
        if seq.has_grammar and not self.structured_output.accept(seq.request_id, token):
            return self._finish_with(seq, "error", f"structured output: token {token} is not allowed by the grammar")
        self._record_token(seq, token, logprob)
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return self._finish_with(seq, "length")
        if seq.has_grammar and self.structured_output.is_finished(seq.request_id):
            return self._finish_with(seq, "stop")
        # Its next step must hold every token's K/V: end it now rather than preempting it forever.
        problem = self._pool_problem(seq)
        if problem is not None:
            return self._finish_with(seq, "error", problem)
        return [self._output(seq)]

    @staticmethod
    def _record_token(seq: Sequence, token: int, logprob: TokenLogprobs | None) -> None:
        seq.output_token_ids.append(token)
        if seq.sampling_params.logprobs is not None and logprob is not None:
            seq.unsent_logprobs.append(logprob)

    def _finish_with(self, seq: Sequence, reason: str, error: str | None = None) -> list[RequestOutput]:
        self.running.remove(seq)
        self._finish(seq, reason)
        return self._outputs_of_choices(seq, reason, error)

    def _outputs_of_choices(self, seq: Sequence, reason: str, error: str | None) -> list[RequestOutput]:
        """The finishing output of ``seq`` and of every choice that had not forked off it yet."""
        return [self._output(seq, finish_reason=reason, error=error)] + [
            self._output(child, finish_reason=reason, error=error) for child in seq.pending_children]

    def _finish(self, seq: Sequence, reason: str | None = None) -> None:
        if self.on_finish is not None:
            self.on_finish(seq, reason)
        self.kv_cache.free(seq)
        for choice in choices_of(seq):
            choice.status = SequenceStatus.FINISHED
        if seq.has_grammar:
            self.structured_output.remove(seq.request_id)
            seq.has_grammar = False

    @staticmethod
    def _output(seq: Sequence, finish_reason: str | None = None, error: str | None = None) -> RequestOutput:
        new_tokens = seq.output_token_ids[seq.num_output_tokens_sent:]
        seq.num_output_tokens_sent = len(seq.output_token_ids)
        logprobs = None
        if seq.sampling_params.logprobs is not None:
            logprobs, seq.unsent_logprobs = seq.unsent_logprobs, []
        prompt_logprobs = None
        if (seq.wants_prompt_logprobs and not seq.prompt_logprobs_sent
                and len(seq.prompt_logprobs) == seq.num_prompt_tokens):
            prompt_logprobs = seq.prompt_logprobs
            seq.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=seq.client_id,
            new_token_ids=new_tokens,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            error=error,
            index=seq.index,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            kv_transfer_params=seq.kv_transfer_result if finish_reason is not None else None,
        )


def choices_of(seq: Sequence) -> list[Sequence]:
    """``seq`` and the choices that have not forked off it yet."""
    return [seq, *seq.pending_children]
