"""Token sampling for one batch of last-position logits (runs in the worker process).

Owns the choice of the next token per request: greedy argmax, or temperature / min-p / top-k /
top-p sampling with per-request seeds, and the guard against non-finite logits.

Order (vLLM's v1 sampler): rows that use a logits control (penalties, bias, bad words, min_tokens
bans, structured-output mask) are copied and processed by ``worker/logits_processors.py``; greedy
rows then take the argmax of the PROCESSED logits; random rows apply temperature, then min_p (in
the probability domain: tokens with p < min_p * max p weigh 0), then top-k, then top-p. Rows with
no control are sampled from the logits as given, with no extra full-vocabulary copy.

Exactness: every random row samples exactly from the truncated, renormalised distribution
(temperature first, then top-k, then top-p on the top-k renormalised mass). Speed comes from
never sorting the whole vocabulary in the common case:
- top-k: one argpartition (O(vocab)); only the k winners are sorted, and only if top-p follows;
- top-p: the support is a prefix of the tokens ordered by probability. Walking probability
  thresholds ``tau`` down (2^-10, 2^-13, ... 2^-22, then 0 = all tokens), the first threshold
  whose token set holds top_p of the mass contains the support; every token above the previous
  threshold is in it, and only the values of the band between the two thresholds are sorted.
  A near-uniform row ends with a large band to sort: still exact, just slower;
- without truncation the draw is two-level: a block of 1024 tokens by its mass, then a token
  in it, so no cumulative sum over the whole vocabulary is needed.

Determinism: a seeded row draws its one uniform number from
``Generator(PCG64([seed, num_output_tokens]))``, so its tokens depend only on its own logits, seed
and position, not on the other requests in the batch. Unseeded rows share one process RNG.

Non-finite logits: ``sample`` raises ``SamplingError`` naming the bad rows (with a reason per row)
and carrying the tokens of all other rows, so the caller fails only those requests and keeps the
rest of the step. A NaN/inf row would otherwise yield an arbitrary token (argmax of NaN) silently.
A row whose controls exclude every token fails the same way.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import paddle

from config.sampling_params import SamplingParams
from worker.logits_processors import RowHistory, apply_logits_processors, needs_processing

logger = logging.getLogger(__name__)

INVALID_TOKEN = -1
# Probability thresholds of the candidate levels; after the last one, all tokens are candidates.
DEFAULT_CANDIDATE_THRESHOLDS = (2.0**-10, 2.0**-13, 2.0**-16, 2.0**-19, 2.0**-22)
# Dividing by a temperature below this would turn 0/T into NaN in float32.
_MIN_TEMPERATURE = float(np.finfo(np.float32).tiny)


class SamplingError(RuntimeError):
    """Some rows could not be sampled. ``rows`` are their batch indices, ``reasons`` says why per
    row; ``tokens`` holds the sampled tokens of the other rows and ``INVALID_TOKEN`` at ``rows``."""

    def __init__(self, rows: list[int], tokens: np.ndarray, reasons: dict[int, str] | None = None) -> None:
        self.rows = rows
        self.tokens = tokens
        self.reasons = reasons if reasons is not None else {row: NON_FINITE_LOGITS for row in rows}
        super().__init__(f"sampling failed in batch rows {rows}: " + "; ".join(
            f"row {row}: {self.reasons[row]}" for row in rows))


NON_FINITE_LOGITS = "the model produced non-finite logits (NaN/inf)"


class Sampler:
    """Samples one token per row of a [batch, vocab] logits tensor."""

    def __init__(self, seed: int | None = None, candidate_thresholds: Sequence[float] = DEFAULT_CANDIDATE_THRESHOLDS) -> None:
        if any(not 0.0 < t < 1.0 for t in candidate_thresholds):
            raise ValueError(f"candidate thresholds must be in (0, 1), got {candidate_thresholds}")
        self._rng = np.random.default_rng(seed)
        self._thresholds = tuple(sorted(candidate_thresholds, reverse=True))
        # Reused across steps: a fresh multi-MB array per step would page-fault on every call.
        self._scratch = np.empty((0, 0), dtype=np.float32)

    def sample(
        self,
        logits: paddle.Tensor | np.ndarray,
        params: list[SamplingParams],
        num_output_tokens: list[int],
        histories: Sequence[RowHistory | None] | None = None,
    ) -> np.ndarray:
        """One int64 token per row. ``num_output_tokens[i]``: tokens request i generated so far.
        ``histories[i]``: row i's token history, bans and mask (``ScheduledSeq`` fits), for the
        logits processors (``worker/logits_processors.py``); None = no per-step inputs.

        ``logits`` is never modified: rows with a control are processed in a copy.
        Raises ``SamplingError`` if any row cannot be sampled: non-finite logits, or a processor
        that excluded every token (see module doc); the other rows' tokens travel in the error.
        """
        x = as_float32_numpy(logits)
        if x.ndim != 2 or x.shape[0] != len(params) or len(params) != len(num_output_tokens):
            raise ValueError(
                f"logits {x.shape} must be [batch, vocab] with batch == len(params) == len(num_output_tokens) "
                f"({len(params)}, {len(num_output_tokens)})"
            )
        if histories is not None and len(histories) != len(params):
            raise ValueError(f"{len(histories)} histories for a batch of {len(params)}")
        finite = np.isfinite(x).all(axis=1)
        reasons = {int(row): NON_FINITE_LOGITS for row in np.flatnonzero(~finite)}
        tokens = np.full(x.shape[0], INVALID_TOKEN, dtype=np.int64)
        # Rows with a control leave the fast path: their logits are processed in a copy ``y``;
        # the others are sampled straight from ``x`` with no extra full-vocabulary pass.
        processed = [i for i, p in enumerate(params)
                     if finite[i] and needs_processing(p, histories[i] if histories is not None else None)]
        in_processed = set(processed)
        plain = [i for i in range(len(params)) if finite[i] and i not in in_processed]
        self._sample_rows(x, plain, plain, params, num_output_tokens, tokens)
        if processed:
            y = x[processed]  # fancy indexing: a C-contiguous copy, x stays raw (logprobs need it)
            failed = apply_logits_processors(
                y, [params[i] for i in processed],
                [histories[i] for i in processed] if histories is not None else [None] * len(processed))
            for local, message in failed.items():
                reasons[processed[local]] = message
            ok = [j for j in range(len(processed)) if j not in failed]
            self._sample_rows(y, ok, [processed[j] for j in ok], params, num_output_tokens, tokens)
        if reasons:
            bad = sorted(reasons)
            logger.error("cannot sample batch rows %s: %s", bad, reasons)
            raise SamplingError(bad, tokens, {row: reasons[row] for row in bad})
        return tokens

    def _sample_rows(self, src: np.ndarray, src_rows: list[int], batch_rows: list[int], params: list[SamplingParams],
                     num_output_tokens: list[int], tokens: np.ndarray) -> None:
        """Sample batch rows ``batch_rows`` from the rows ``src_rows`` of ``src`` into ``tokens``."""
        if not batch_rows:
            return
        greedy = [k for k, i in enumerate(batch_rows) if params[i].greedy]
        random = [k for k, i in enumerate(batch_rows) if not params[i].greedy]
        if greedy:
            # argmax of every row costs less than gathering the greedy ones first.
            tokens[[batch_rows[k] for k in greedy]] = src.argmax(axis=1)[[src_rows[k] for k in greedy]]
        if random:
            tokens[[batch_rows[k] for k in random]] = self._sample_random(
                src, [src_rows[k] for k in random], [params[batch_rows[k]] for k in random],
                [num_output_tokens[batch_rows[k]] for k in random])

    def _sample_random(
        self, x: np.ndarray, rows: list[int], params: list[SamplingParams], num_output_tokens: list[int]
    ) -> np.ndarray:
        """One token per row of ``x`` in ``rows``; ``params[j]``/``num_output_tokens[j]`` belong to ``rows[j]``."""
        exp_logits = self._tempered_exp(x, rows, [p.temperature for p in params])
        vocab = exp_logits.shape[1]
        out = np.empty(len(rows), dtype=np.int64)
        for j, p in enumerate(params):
            rng = self._rng if p.seed is None else np.random.Generator(np.random.PCG64([p.seed, num_output_tokens[j]]))
            u = rng.random()
            e = exp_logits[j]
            if p.min_p > 0.0:
                # min_p in the probability domain after temperature, as vLLM: the row's maximum is
                # exactly 1 here, so "prob < min_p * max prob" is "e < min_p" (removed tokens weigh 0).
                np.putmask(e, e < np.float32(p.min_p), np.float32(0.0))
            if 0 < p.top_k < vocab:
                tokens = _top_k_support(e, p.top_k, p.top_p)
            elif p.top_p < 1.0:
                tokens = self._top_p_support(e, p.top_p)
            else:
                out[j] = _sample_weighted(e, u)
                continue
            out[j] = tokens[_sample_weighted(e[tokens], u)]
        return out

    def _tempered_exp(self, x: np.ndarray, rows: list[int], temperatures: list[float]) -> np.ndarray:
        """exp((x - max) / T) of the selected rows, in the scratch buffer. Max entry is exactly 1."""
        n, vocab = len(rows), x.shape[1]
        if self._scratch.shape[0] < n or self._scratch.shape[1] != vocab:
            self._scratch = np.empty((max(n, self._scratch.shape[0]), vocab), dtype=np.float32)
        buf = self._scratch[:n]
        # When every row is random, the subtraction below doubles as the copy into scratch.
        src = x if n == x.shape[0] else np.take(x, rows, axis=0, out=buf)
        # Subtracting the max first keeps the division from overflowing at small temperatures.
        np.subtract(src, src.max(axis=1, keepdims=True), out=buf)
        if any(t != 1.0 for t in temperatures):
            temps = np.maximum(np.asarray(temperatures, dtype=np.float32), _MIN_TEMPERATURE)
            np.divide(buf, temps[:, None], out=buf)
        np.exp(buf, out=buf)
        return buf

    def _top_p_support(self, e: np.ndarray, top_p: float) -> np.ndarray:
        """The smallest set of most probable tokens holding ``top_p`` of the mass (unordered)."""
        total = float(e.sum())  # numpy sums float32 pairwise: relative error ~1e-7
        needed = top_p * total
        above = _EMPTY
        above_mass = 0.0
        above_threshold = np.inf
        for tau in self._thresholds:
            candidates = np.flatnonzero(e >= tau * total)
            mass = float(e[candidates].sum(dtype=np.float64))
            if mass >= needed:
                band = np.compress(e[candidates] < above_threshold, candidates)
                break
            above, above_mass, above_threshold = candidates, mass, tau * total
        else:
            band = np.flatnonzero(e < above_threshold)
            if band.size == 0:  # top_p ~ 1 and rounding: the last level already held everything
                return above
        # The support is everything above the previous threshold plus the best of the band below
        # it. Only the band's values are sorted (a value sort is several times faster than an
        # argsort); the boundary value then selects the tokens. np.compress, not arr[mask]:
        # boolean indexing is ~7x slower here.
        band_values = e[band]
        descending = np.sort(band_values)[::-1]
        n = _mass_prefix_length(descending, needed - above_mass)
        boundary = descending[n - 1]
        inside = np.compress(band_values > boundary, band)
        tied = np.compress(band_values == boundary, band)[: n - inside.size]
        return np.concatenate((above, inside, tied))


_EMPTY = np.empty(0, dtype=np.int64)
# Block length of the two-level cumulative sums: numpy's cumsum is slow (about 9 ns an
# element), so long arrays are summed per block and only one block is cumulated.
_BLOCK = 1024


def _top_k_support(e: np.ndarray, k: int, top_p: float) -> np.ndarray:
    """The k most probable tokens, then the top-p prefix of them (renormalised over the k)."""
    tokens = np.argpartition(e, e.size - k)[e.size - k :]
    if top_p >= 1.0:
        return tokens
    tokens = tokens[np.argsort(-e[tokens])]
    values = e[tokens]
    return tokens[: _mass_prefix_length(values, top_p * float(values.sum(dtype=np.float64)))]


def _mass_prefix_length(values: np.ndarray, needed: float) -> int:
    """Length of the shortest prefix of ``values`` whose sum reaches ``needed`` (at least 1, at
    most all): a sum per block first, then a cumulative sum inside the one block that crosses."""
    starts = np.arange(0, values.size, _BLOCK)
    block_cum = np.cumsum(np.add.reduceat(values, starts, dtype=np.float64))
    b = int(np.searchsorted(block_cum, needed, side="left"))
    if b >= starts.size:
        return values.size  # rounding left the total a hair below ``needed``: take everything
    before = block_cum[b - 1] if b else 0.0
    in_block = before + np.cumsum(values[starts[b] : starts[b] + _BLOCK], dtype=np.float64)
    return int(starts[b]) + max(1, min(int(np.searchsorted(in_block, needed, side="left")) + 1, in_block.size))


def _sample_weighted(weights: np.ndarray, u: float) -> int:
    """Index drawn with probability proportional to ``weights`` by the uniform ``u`` (inverse
    CDF): pick a block by its mass, then an entry inside it. Never a zero-weight entry."""
    if weights.size <= _BLOCK:
        cum = np.cumsum(weights, dtype=np.float64)
        return _pick(cum, u * cum[-1])
    starts = np.arange(0, weights.size, _BLOCK)
    block_cum = np.cumsum(np.add.reduceat(weights, starts, dtype=np.float64))
    target = u * block_cum[-1]
    b = _pick(block_cum, target)
    before = block_cum[b - 1] if b else 0.0
    # Rescale into the block with its own cumulative sum, so rounding between the block sum
    # and the in-block sum cannot push the draw outside the block.
    fraction = (target - before) / (block_cum[b] - before)
    in_block = np.cumsum(weights[starts[b] : starts[b] + _BLOCK], dtype=np.float64)
    return int(starts[b]) + _pick(in_block, fraction * in_block[-1])


def _pick(cum: np.ndarray, target: float) -> int:
    """Index i with cum[i-1] <= target < cum[i]. Never a zero-weight entry."""
    idx = min(int(np.searchsorted(cum, target, side="right")), cum.size - 1)
    # Only a target rounded up to the total can land on a trailing zero-weight entry; the first
    # index holding the same cumulative value is the last entry with weight.
    return int(np.searchsorted(cum, cum[idx], side="left"))


def as_float32_numpy(logits: paddle.Tensor | np.ndarray) -> np.ndarray:
    """A read-only-by-convention float32 numpy view (no copy for CPU float32 tensors)."""
    if isinstance(logits, np.ndarray):
        return logits.astype(np.float32, copy=False)
    if logits.dtype != paddle.float32:
        logits = logits.astype("float32")
    if logits.place.is_cpu_place():
        return np.from_dlpack(logits)
    return logits.numpy()
