"""Messages between the engine and its workers (pickled over ZMQ).

One ``StepBatch`` per engine step goes to the worker; one ``StepResult`` comes
back. Sequences carry everything the worker needs for the step, so the worker
keeps no per-request state besides the KV cache contents.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from config.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np


@dataclass
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # tokens whose K/V this step computes
    context_len: int  # KV length of the sequence after this step
    block_table: list[int]
    needs_sample: bool  # last token of the chunk is the sequence's newest: sample the next one
    sampling_params: SamplingParams | None = None  # set when needs_sample
    num_output_tokens: int = 0  # tokens generated so far; seeds the sampler deterministically
    # Set by the engine only when needs_sample and the request's sampling needs them:
    prompt_token_ids: list[int] | None = None  # repetition_penalty
    output_token_ids: list[int] | None = None  # penalties, bad_words
    banned_token_ids: list[int] | None = None  # min_tokens not reached yet: eos + stop ids
    allowed_token_bitmask: "np.ndarray | None" = None  # structured output: int32 words, bit set = allowed
    # Prompt log-probabilities: the chunk's positions predict the next token; the one after the
    # chunk's last position is this (None when the chunk ends the prompt, or logprobs are off).
    next_prompt_token_id: int | None = None
    prompt_logprobs: int | None = None  # top alternatives per prompt position; None = not wanted


@dataclass
class StepBatch:
    step_id: int
    seqs: list[ScheduledSeq]  # sequences with one new token come first (batched decode path)
    # Device block copies (src, dst) to run before the forward: copy-on-write of a shared partial block.
    block_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class TokenLogprobs:
    """The log-probability of one chosen token and of the ``top`` most likely tokens at its position."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class StepResult:
    step_id: int
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # request_id -> message (e.g. non-finite logits)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # of the sampled token
    # Per scheduled chunk: logprobs of the prompt tokens it predicts, in position order.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    execute_seconds: float = 0.0


@dataclass
class WorkerShutdown:
    reason: str = ""


# ---- engine <-> cache transfer process ------------------------------------

TRANSFER_KINDS = ("swap_out", "swap_in", "write_back", "prefetch", "remote_read")


@dataclass
class RemoteBlocks:
    """Where a ``remote_read`` task reads from: blocks of another instance's registered device KV pool.

    The peer's pool has the same layout as ours (same model, block size and KV layout; checked by the
    engine before the task is made) but its own block count, which sets the stride between its planes.
    """

    session: str  # "host:port" of the peer's transfer engine (Mooncake P2P handshake)
    kv_addr: int  # address of the peer's device pool in the peer's process (registered with its engine)
    num_blocks: int  # the peer pool's block count
    block_ids: list[int]  # peer blocks, aligned with the task's device_block_ids
    transfer_id: str = ""  # the peer's hold, released by the engine once the task reported
    expires_at: float = 0.0  # wall clock: the peer frees the blocks then at the latest (no read starts close to it)


@dataclass
class TransferTask:
    """One batch of block copies for the cache transfer process.

    swap_out:   device_block_ids[i] -> host_block_ids[i]
    swap_in:    host_block_ids[i]   -> device_block_ids[i]
    write_back: device_block_ids[i] -> storage_keys[i]   (or host_block_ids[i] -> key when device ids are empty)
    prefetch:   storage_keys[i]     -> device_block_ids[i]
    remote_read: remote.block_ids[i] (another instance's pool) -> device_block_ids[i]
    """

    task_id: int
    kind: str
    device_block_ids: list[int] = field(default_factory=list)
    host_block_ids: list[int] = field(default_factory=list)
    storage_keys: list[str] = field(default_factory=list)
    remote: RemoteBlocks | None = None  # remote_read only


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
