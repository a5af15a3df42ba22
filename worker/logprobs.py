"""Log-probabilities of chosen tokens, their rank and the most likely alternatives (worker side).

This module owns the numbers behind the API's ``logprobs`` / ``top_logprobs`` / ``prompt_logprobs``.
They are RAW: ``log_softmax`` of the model's float32 logits, before temperature, penalties, bias
and masks (vLLM's default ``raw_logprobs`` mode), so they do not depend on the sampling controls.

Numerics: the row maximum is subtracted in float32 (exact for the maximum itself), the sum of
exponentials is accumulated in float64 and the log-sum-exp and logprobs are float64, so a logprob
is within a few float32 ulps of the exact value of the float32 logits.

Rank (as vLLM's ``batched_count_greater_than``): the number of tokens whose logit is >= the chosen
token's, so 1 = the most likely token, and a token tied with others gets the worst rank of the tie.
Top alternatives are in descending logprob order, ties by ascending token id; when several tokens
tie at the k-th place, which of them is listed is unspecified.
Everything is vectorised over rows; only building the result objects loops over rows.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from inter_communicator.messages import TokenLogprobs

logger = logging.getLogger(__name__)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log_softmax of float32 rows [n, vocab] (a fresh array)."""
    x = np.asarray(logits, dtype=np.float32)
    return x.astype(np.float64) - _log_sum_exp(x)[:, None]


def _log_sum_exp(x: np.ndarray) -> np.ndarray:
    row_max = x.max(axis=1)
    shifted = np.exp(x - row_max[:, None])  # float32: exp(0) = 1 exactly for the maximum
    return row_max.astype(np.float64) + np.log(shifted.sum(axis=1, dtype=np.float64))


def token_logprobs(logits: np.ndarray, token_ids: np.ndarray | Sequence[int],
                   num_top: Sequence[int]) -> list[TokenLogprobs]:
    """For each row i of ``logits`` [n, vocab] (raw float32, finite): the logprob and rank of
    ``token_ids[i]`` and the ``num_top[i]`` most likely tokens with their logprobs."""
    x = np.asarray(logits, dtype=np.float32)
    tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if x.ndim != 2 or tokens.size != x.shape[0] or len(num_top) != x.shape[0]:
        raise ValueError(f"logits {x.shape}, {tokens.size} token ids and {len(num_top)} top counts must agree")
    n, vocab = x.shape
    if n == 0:
        return []
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab}), got {tokens.tolist()}")
    lse = _log_sum_exp(x)
    chosen = x[np.arange(n), tokens]
    chosen_logprob = chosen.astype(np.float64) - lse
    # >= counts the token itself: rank 1 when nothing is strictly or equally more likely.
    ranks = np.count_nonzero(x >= chosen[:, None], axis=1)
    k = max(num_top)
    top_ids = np.empty((n, 0), dtype=np.int64)
    top_values = np.empty((n, 0), dtype=np.float64)
    if k > 0:
        k = min(k, vocab)
        # One argpartition per row, vectorised over the batch: O(vocab), only the k winners get sorted.
        top_ids = np.argpartition(x, vocab - k, axis=1)[:, vocab - k:]
        values = np.take_along_axis(x, top_ids, axis=1)
        order = np.lexsort((top_ids, -values), axis=1)  # descending value, then ascending id
        top_ids = np.take_along_axis(top_ids, order, axis=1)
        top_values = np.take_along_axis(values, order, axis=1).astype(np.float64) - lse[:, None]
    return [
        TokenLogprobs(token_id=int(tokens[i]), logprob=float(chosen_logprob[i]), rank=int(ranks[i]),
                      top_token_ids=top_ids[i, :num_top[i]].tolist(), top_logprobs=top_values[i, :num_top[i]].tolist())
        for i in range(n)
    ]
