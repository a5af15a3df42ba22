"""One request as the engine sees it: token ids, progress, blocks, status."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from config.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
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

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output without building the concatenation."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]
