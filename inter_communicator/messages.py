"""Messages between the engine and its workers (pickled over ZMQ).

One ``StepBatch`` per engine step goes to the worker; one ``StepResult`` comes
back. Sequences carry everything the worker needs for the step, so the worker
keeps no per-request state besides the KV cache contents.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from config.sampling_params import SamplingParams


@dataclass
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # tokens whose K/V this step computes
    context_len: int  # KV length of the sequence after this step
    block_table: list[int]
    needs_sample: bool  # last token of the chunk is the sequence's newest: sample the next one
    sampling_params: SamplingParams | None = None  # set when needs_sample
    num_output_tokens: int = 0  # tokens generated so far; seeds the sampler deterministically


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


# ---- engine <-> cache transfer process ------------------------------------

TRANSFER_KINDS = ("swap_out", "swap_in", "write_back", "prefetch")


@dataclass
class TransferTask:
    """One batch of block copies for the cache transfer process.

    swap_out:   device_block_ids[i] -> host_block_ids[i]
    swap_in:    host_block_ids[i]   -> device_block_ids[i]
    write_back: device_block_ids[i] -> storage_keys[i]   (or host_block_ids[i] -> key when device ids are empty)
    prefetch:   storage_keys[i]     -> device_block_ids[i]
    """

    task_id: int
    kind: str
    device_block_ids: list[int] = field(default_factory=list)
    host_block_ids: list[int] = field(default_factory=list)
    storage_keys: list[str] = field(default_factory=list)


@dataclass
class TransferStarted:
    """Sent once the transfer process holds the KV-cache lock (if on) and is about to copy."""

    task_id: int


@dataclass
class TransferDone:
    task_id: int
    kind: str
    ok: list[bool] = field(default_factory=list)  # per block; False = miss / failed copy
    seconds: float = 0.0
    error: str | None = None


@dataclass
class ClearStorage:
    """Test/admin request: drop every object of this model from the storage tier."""
