#!/usr/bin/env python3
"""Check an exported Hugging Face directory against fdserve's float32 greedy references.

Owns the "the peer runs the same model" check of the peer benchmark: it loads the directory
written by ``benchmarks/hf_export.py`` with transformers (float32, eager, CPU), decodes the
first ``--prompts`` reference prompts greedily for as many tokens as the reference has, and
compares token for token. It runs in the peer's own venv (torch + transformers), so it imports
nothing from fdserve. Exit 0 when every checked prompt matches, 1 otherwise.

    python benchmarks/peer_hf_check.py HF_DIR /work/shared/reference/smollm2_greedy.json [--prompts 2]
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

logger = logging.getLogger(__name__)


def greedy_ids(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """``num_tokens`` greedy continuation ids of ``prompt_ids``, decoding on transformers' KV cache."""
    import torch

    out: list[int] = []
    step_input = torch.tensor([prompt_ids], dtype=torch.long)
    past = None
    with torch.no_grad():
        for _ in range(num_tokens):
            result = model(step_input, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token = int(torch.argmax(result.logits[0, -1]))
            out.append(token)
            step_input = torch.tensor([[token]], dtype=torch.long)
    return out


def check(hf_dir: str, reference_path: str, num_prompts: int) -> list[dict]:
    """One row per checked reference prompt: expected and produced ids, match flag."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with open(reference_path, encoding="utf-8") as handle:
        references = json.load(handle)[:num_prompts]
    rows = []
    for ref in references:
        produced = greedy_ids(model, ref["prompt_ids"], len(ref["output_ids"]))
        rows.append({"prompt": ref["prompt"], "expected": ref["output_ids"], "produced": produced,
                     "match": produced == ref["output_ids"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir")
    parser.add_argument("reference")
    parser.add_argument("--prompts", type=int, default=2, help="how many reference prompts to check")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    rows = check(args.hf_dir, args.reference, args.prompts)
    for row in rows:
        logger.info("%s %r: expected %s, produced %s", "match" if row["match"] else "MISMATCH",
                    row["prompt"][:50], row["expected"], row["produced"])
    return 0 if rows and all(row["match"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
