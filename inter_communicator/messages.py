"""Messages between the engine and its workers (pickled over ZMQ).

One ``StepBatch`` per engine step goes to the worker; one ``StepResult`` comes
back. Sequences carry everything the worker needs for the step, so the worker
keeps no per-request state besides the KV cache contents.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


@dataclass
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # tokens whose K/V this step computes
    context_len: int  # KV length of the sequence after this step
    block_table: list[int]
    sample: bool  # last token of the chunk is the sequence's newest: sample the next one
    sampling_params: SamplingParams | None = None
    step_index: int = 0  # tokens generated so far; seeds the sampler deterministically


@dataclass
class StepBatch:
    step_id: int
    seqs: list[ScheduledSeq]  # sequences with one new token come first (batched decode path)


@dataclass
class StepResult:
    step_id: int
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # request_id -> message (e.g. non-finite logits)
    execute_seconds: float = 0.0


@dataclass
class WorkerShutdown:
    reason: str = ""
