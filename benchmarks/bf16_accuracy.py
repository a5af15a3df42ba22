"""Accuracy of ``--dtype bfloat16`` against float32 on the reference prompts, with the raw model (no server).

This script owns the bf16 accuracy figures (issue 15). For every prompt of the float32 greedy
references (/work/shared/reference/smollm2_greedy.json, SmolLM2-135M-Instruct) it reports:

- ``first_divergence``: the first generated position where bf16 greedy decoding (prefill of the
  prompt, then one token per step through the paged KV cache, as the worker runs it) differs from
  the reference output ids (None: identical over the whole reference), and the reference's top-2
  logit margin at that step (a small margin is a near tie that float32 noise can also flip);
- ``float32_first_divergence``: the same for this build's float32 model (expected None, the control);
- ``mean_abs_logprob_delta`` / ``max_abs_logprob_delta``: |log p_bf16 - log p_fp32| of the reference
  tokens, teacher-forced (prompt + reference output in one forward per dtype), over all output positions;
- ``teacher_forced_argmax_agreement``: share of those positions where both dtypes' argmax agree.

    python benchmarks/bf16_accuracy.py [--reference PATH] [--out benchmarks/results/bf16_accuracy.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
from typing import Any

from model_setup import contiguous_cache, write_report

import envs

logger = logging.getLogger(__name__)
DEFAULT_REFERENCE = "/work/shared/reference/smollm2_greedy.json"
BLOCK_SIZE = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", default=DEFAULT_REFERENCE, help="greedy reference JSON")
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M GGUF)")
    parser.add_argument("--threads", type=int, default=0, help="compute threads (0: FD_NUM_THREADS or all cores)")
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")
    return parser.parse_args(argv)


def load_models(model_path: str | None) -> tuple[Any, Any, Any]:
    """(config, float32 model, bfloat16 model) of one checkpoint read once."""
    from config.model_config import default_model_path, load_model_config
    from worker.loader import load_weights
    from worker.models import get_model_class

    config = load_model_config(model_path or default_model_path())
    weights = load_weights(config)
    models = []
    for dtype in ("float32", "bfloat16"):
        typed = dataclasses.replace(config, dtype=dtype)
        model = get_model_class(typed.architecture)(typed)
        model.load_weights(weights)
        model.eval()
        models.append(model)
    return config, models[0], models[1]


def _forward_logits(model: Any, config: Any, token_ids: list[int], all_rows: bool) -> Any:
    """float64 log-softmax rows of one fresh sequence's forward (every row, or only the last)."""
    import numpy as np
    import paddle

    from worker.attention import build_attention_metadata

    kv_caches, tables = contiguous_cache(config, 1, len(token_ids), BLOCK_SIZE)
    meta = build_attention_metadata([len(token_ids)], [len(token_ids)], tables, BLOCK_SIZE)
    with paddle.no_grad():
        hidden = model(paddle.to_tensor(np.asarray(token_ids, dtype=np.int64)), meta.positions, kv_caches, meta)
        rows = hidden if all_rows else paddle.index_select(hidden, meta.last_token_indices)
        logits = model.compute_logits(rows).numpy().astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def greedy(model: Any, config: Any, prompt_ids: list[int], steps: int) -> list[int]:
    """Greedy continuation: prefill, then one token per decode step through the paged KV cache."""
    import numpy as np
    import paddle

    from worker.attention import build_attention_metadata

    total = len(prompt_ids) + steps
    kv_caches, tables = contiguous_cache(config, 1, total, BLOCK_SIZE)
    output: list[int] = []
    inputs, context = list(prompt_ids), len(prompt_ids)
    with paddle.no_grad():
        for _ in range(steps):
            meta = build_attention_metadata([len(inputs)], [context], tables, BLOCK_SIZE)
            hidden = model(paddle.to_tensor(np.asarray(inputs, dtype=np.int64)), meta.positions, kv_caches, meta)
            logits = model.compute_logits(paddle.index_select(hidden, meta.last_token_indices))
            token = int(logits.argmax(axis=-1).numpy()[0])
            output.append(token)
            if token in config.eos_token_ids:
                break
            inputs, context = [token], context + 1
    return output


def first_divergence(produced: list[int], reference: list[int]) -> int | None:
    """Index of the first differing token (a shorter output differs where it ends); None when identical."""
    for index, expected in enumerate(reference):
        if index >= len(produced) or produced[index] != expected:
            return index
    return None


def evaluate(entry: dict[str, Any], config: Any, fp32: Any, bf16: Any) -> dict[str, Any]:
    import numpy as np

    prompt, reference = entry["prompt_ids"], entry["output_ids"]
    sequence = prompt + reference
    positions = np.arange(len(prompt) - 1, len(sequence) - 1)
    targets = np.asarray(reference)
    logprobs = {}
    for name, model in (("fp32", fp32), ("bf16", bf16)):
        logprobs[name] = _forward_logits(model, config, sequence, all_rows=True)[positions]
    delta = np.abs(logprobs["bf16"][np.arange(len(targets)), targets] - logprobs["fp32"][np.arange(len(targets)),
                                                                                           targets])
    agree = float(np.mean(logprobs["bf16"].argmax(axis=-1) == logprobs["fp32"].argmax(axis=-1)))
    diverged = first_divergence(greedy(bf16, config, prompt, len(reference)), reference)
    control = first_divergence(greedy(fp32, config, prompt, len(reference)), reference)
    margins = entry.get("top2_margins") or []
    return {
        "prompt": entry["prompt"][:60],
        "reference_tokens": len(reference),
        "first_divergence": diverged,
        "reference_margin_at_divergence": margins[diverged] if diverged is not None and diverged < len(margins)
        else None,
        "float32_first_divergence": control,
        "mean_abs_logprob_delta": round(float(delta.mean()), 5),
        "max_abs_logprob_delta": round(float(delta.max()), 5),
        "teacher_forced_argmax_agreement": round(agree, 4),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=envs.FD_LOG_LEVEL, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    envs.apply_compute_thread_env(args.threads or envs.FD_NUM_THREADS or envs.available_cores())
    with open(args.reference, encoding="utf-8") as handle:
        entries = json.load(handle)
    config, fp32, bf16 = load_models(args.model)
    prompts = [evaluate(entry, config, fp32, bf16) for entry in entries]
    full_matches = sum(1 for item in prompts if item["first_divergence"] is None)
    report = {
        "reference": args.reference,
        "prompts": prompts,
        "bf16_full_greedy_matches": f"{full_matches}/{len(prompts)}",
        "mean_abs_logprob_delta": round(statistics.mean(item["mean_abs_logprob_delta"] for item in prompts), 5),
        "float32_control_matches": sum(1 for item in prompts if item["float32_first_divergence"] is None),
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
