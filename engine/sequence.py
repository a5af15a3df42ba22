"""One sequence as the engine sees it: token ids, progress, blocks, status, and its place in its request.

A request with ``SamplingParams.n`` > 1 becomes n sequences (choices): the parent (index 0,
internal id = the client's request id) and n-1 children (internal id ``f"{client_id}#{index}"``)
that wait in ``pending_children`` until the parent's prompt is prefilled and then fork off it
(``Scheduler._fork``). The worker and ``StepResult`` key everything by the internal id; outputs
to the API server carry ``client_id`` and ``index``.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from typing import Any

from cache_manager.pd_transfer import RemotePrefill
from config.sampling_params import SamplingParams
from inter_communicator.messages import TokenLogprobs

# The seed space of SamplingParams.seed: choice i of a seeded request samples with (seed + i) mod this.
SEED_MODULUS = 2**63


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str  # internal id: unique per choice
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V are in the cache. After a decode step this is
    # num_tokens - 1: the newest sampled token is fed to the next step.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Chained hashes of the leading full blocks of block_table (prefix cache).
    block_hashes: list[str] = field(default_factory=list)
    # Prompt tokens served from a cache tier at first admission (usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0
    # Set after a cache fill timed out: the next admission recomputes instead of retrying lower tiers.
    skip_cache_once: bool = False
    # Outputs produced since the last RequestOutput was sent to the API server.
    num_output_tokens_sent: int = 0
    # The request this choice belongs to (the id the API server knows) and its choice index.
    client_id: str = ""
    index: int = 0
    # Choices 1..n-1 of a parent that has not forked yet (its prompt is not prefilled).
    pending_children: list["Sequence"] = field(default_factory=list)
    # Prompt logprobs collected so far, one per prompt position from 0 (None for position 0).
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # Logprobs of the output tokens not sent yet (one per entry of output_token_ids[num_output_tokens_sent:]).
    unsent_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # The structured-output manager holds a grammar under request_id (remove it when the sequence ends).
    has_grammar: bool = False
    # P/D (engine/disaggregation.py). Prefill side: hold the prompt's blocks for a decode instance when done,
    # and the offer made then (the response's kv_transfer_params). Decode side: a prefill instance's offer,
    # read at admission (the cache manager sets it to None once used).
    pd_hold: bool = False
    kv_transfer_result: dict[str, Any] | None = None
    remote_prefill: RemotePrefill | None = None

    def __post_init__(self) -> None:
        if not self.client_id:
            self.client_id = self.request_id
        if self.wants_prompt_logprobs and not self.prompt_logprobs:
            self.prompt_logprobs = [None]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_fork_pending(self) -> bool:
        return bool(self.pending_children)

    @property
    def num_choices_held(self) -> int:
        """Sequences this one stands for in ``max_num_seqs``: itself and its unforked children."""
        return 1 + len(self.pending_children)

    @property
    def prefill_target(self) -> int:
        """Tokens whose K/V this sequence computes before its next sample (or fork).

        A parent waiting to fork stops one token short of its prompt: every choice computes the last
        prompt token itself, in a 1-token step that samples its first token.
        """
        if self.pending_children:
            return self.num_prompt_tokens - 1
        return self.num_tokens

    @property
    def num_schedulable_tokens(self) -> int:
        return self.prefill_target - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    @property
    def needs_all_prompt_positions(self) -> bool:
        """Prompt logprobs still missing: the prompt positions that predict them must be computed."""
        return self.wants_prompt_logprobs and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def max_prefix_hit_tokens(self) -> int | None:
        """How much of the prompt the prefix cache may serve at admission (None: no limit).

        Position q - 1 predicts prompt token q: while logprobs are missing from position L =
        len(prompt_logprobs) on, computing must start at L - 1 at the latest. So a first admission
        takes nothing from the cache, and a recompute after a preemption keeps what it scored.
        """
        if not self.needs_all_prompt_positions:
            return None
        return len(self.prompt_logprobs) - 1

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output without building the concatenation."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]


def make_choices(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), arrival_time: float = 0.0) -> Sequence:
    """The parent sequence of a request, holding its n-1 children (unforked) when ``params.n`` > 1.

    Each choice gets its own seed stream: choice i of a seeded request samples with seed + i.
    """
    parent = Sequence(request_id, prompt_token_ids, params, eos_token_ids, arrival_time)
    for index in range(1, max(1, params.n)):
        child_params = params
        if params.seed is not None:
            child_params = dataclasses.replace(params, seed=(params.seed + index) % SEED_MODULUS)
        parent.pending_children.append(Sequence(f"{request_id}#{index}", prompt_token_ids, child_params,
                                                eos_token_ids, arrival_time, client_id=request_id, index=index))
    return parent
