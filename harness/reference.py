"""The greedy reference outputs (``../shared/reference/smollm2_greedy.json``), read through one helper.

They come from an independent float32 implementation (HF transformers on CPU); a correct float32 engine
reproduces them token for token up to the first step whose top-2 margin is tiny.
"""
from __future__ import annotations

import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
REFERENCE_PATH = REPO_ROOT.parent / "shared" / "reference" / "smollm2_greedy.json"


def load_reference() -> list[dict]:
    return json.loads(REFERENCE_PATH.read_text())


def expected_prefix(entry: dict, tokens: list[int]) -> tuple[list[int], list[int]]:
    """(our tokens, reference tokens) cut at the first step whose top-2 margin is below 0.01.

    The reference README: where the margin is tiny, another float32 summation
    order may legitimately flip the argmax; before that point we must agree.
    """
    # The reference ends with the <|im_end|> that stopped it; the engine returns that token too (vLLM's rule).
    reference = list(entry["output_ids"])
    cut = len(reference)
    for step, margin in enumerate(entry["top2_margins"]):
        if margin < 0.01:
            cut = step  # the token of that step may legitimately flip, and everything after it
            break
    return tokens[:cut], reference[:cut]
