"""EleutherAI's lm-evaluation-harness against fdserve, checked against a direct float32 forward.

``python benchmarks/eval_harness.py [--model PATH] [--out FILE]`` starts a server (harness.server), runs
the unmodified ``lm_eval`` command line with its ``local-completions`` model on the local multiple-choice
task in benchmarks/data/lm_eval_tasks (20 questions x 4 choices, no hub access), then scores every
(context, continuation) pair it logged with a direct float32 forward of the same model in this process,
and reports both accuracies and the largest per-choice log-likelihood difference.

What lm-eval sends (lm_eval/models/openai_completions.py, api_models.py, 0.4.13): it tokenizes locally
(``tokenizer_backend=huggingface`` with the tokenizer directory this module exports from the model,
since a GGUF has no HF tokenizer files), POSTs ``{"prompt": [[context + continuation ids]],
"max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": true, "seed": 1234}`` to /v1/completions,
and sums ``choices[i].logprobs.token_logprobs[ctxlen:-1]`` (the last entry is the generated token);
``is_greedy`` compares each of those with ``max(top_logprobs[j].values())``.

Importable pieces (used by tests/test_eval_harness.py): ``export_tokenizer``, ``write_task``,
``run_lm_eval``, ``read_samples``, ``encode_pair`` and ``DirectScorer``.
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

logger = logging.getLogger(__name__)

TASK_NAME = "fdserve_mc"
TASK_DIR = REPO_ROOT / "benchmarks" / "data" / "lm_eval_tasks"
LM_EVAL_TIMEOUT_S = 900.0
# lm-eval must not reach for the Hugging Face hub: the task's data and the tokenizer are local files.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}


def export_tokenizer(model_path: str, out_dir: str) -> str:
    """Write the model's tokenizer as a Hugging Face fast-tokenizer directory (what lm-eval loads).

    fdserve builds the tokenizer from the GGUF vocabulary (engine/tokenizer.py); its ``tokenizer.json``
    plus a ``tokenizer_config.json`` naming bos/eos is all ``transformers.AutoTokenizer`` needs.
    """
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.backend.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
                   "eos_token": tokenizer.eos_token, "pad_token": tokenizer.eos_token}, handle, indent=2)
    return out_dir


def write_task(out_dir: str) -> str:
    """A copy of the task directory whose YAML names its jsonl by absolute path (lm-eval may run anywhere)."""
    os.makedirs(out_dir, exist_ok=True)
    data = TASK_DIR / f"{TASK_NAME}.jsonl"
    yaml_text = (TASK_DIR / f"{TASK_NAME}.yaml").read_text()
    relative = f"benchmarks/data/lm_eval_tasks/{TASK_NAME}.jsonl"
    if relative not in yaml_text:
        raise ValueError(f"{TASK_NAME}.yaml no longer names {relative}")
    Path(out_dir, f"{TASK_NAME}.yaml").write_text(yaml_text.replace(relative, str(data)))
    return out_dir


def lm_eval_command(base_url: str, model_name: str, tokenizer_dir: str, task_dir: str, output_dir: str,
                    max_length: int) -> list[str]:
    """The lm_eval command line, as a user would type it (nothing in lm-eval is patched)."""
    model_args = ",".join([
        f"model={model_name}", f"base_url={base_url}/v1/completions", "tokenizer_backend=huggingface",
        f"tokenizer={tokenizer_dir}", f"max_length={max_length}", "num_concurrent=1", "max_retries=1",
    ])
    # `python -m lm_eval` is the `lm_eval` console script of this interpreter's install (both run cli_evaluate).
    return [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
            "--tasks", TASK_NAME, "--include_path", task_dir, "--output_path", output_dir, "--log_samples",
            "--seed", "1234"]


def run_lm_eval(base_url: str, model_name: str, tokenizer_dir: str, work_dir: str,
                max_length: int = 2048) -> tuple[dict[str, Any], list[dict[str, Any]], float]:
    """Run lm_eval; returns (its results JSON, its logged samples, wall seconds). Raises on failure."""
    task_dir = write_task(os.path.join(work_dir, "tasks"))
    output_dir = os.path.join(work_dir, "lm_eval_out")
    command = lm_eval_command(base_url, model_name, tokenizer_dir, task_dir, output_dir, max_length)
    env = {**os.environ, **OFFLINE_ENV, "HF_HOME": os.path.join(work_dir, "hf_home")}
    started = time.monotonic()
    result = subprocess.run(command, cwd=work_dir, env=env, capture_output=True, text=True, timeout=LM_EVAL_TIMEOUT_S)
    elapsed = time.monotonic() - started
    if result.returncode != 0:
        raise RuntimeError(f"lm_eval exited with {result.returncode}:\n{result.stderr[-4000:]}")
    results_files = sorted(glob.glob(os.path.join(output_dir, "**", "results_*.json"), recursive=True))
    samples_files = sorted(glob.glob(os.path.join(output_dir, "**", f"samples_{TASK_NAME}_*.jsonl"), recursive=True))
    if not results_files or not samples_files:
        raise RuntimeError(f"lm_eval wrote no results/samples under {output_dir}:\n{result.stderr[-4000:]}")
    with open(results_files[-1], encoding="utf-8") as handle:
        results = json.load(handle)
    return results, read_samples(samples_files[-1]), elapsed


def read_samples(path: str) -> list[dict[str, Any]]:
    """lm-eval's logged samples: per document its target and, per choice, (context, continuation, loglik)."""
    samples = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            pairs = [tuple(arg_set) for arg_set in _arguments(record["arguments"])]
            # Each response is logged as strings: [["-4.50934681862384", "False"]].
            logliks = [float(resp[0][0]) for resp in record["resps"]]
            greedy = [str(resp[0][1]) == "True" for resp in record["resps"]]
            samples.append({"doc_id": record["doc_id"], "target": int(record["target"]), "pairs": pairs,
                            "logliks": logliks, "is_greedy": greedy, "acc": float(record["acc"])})
    return sorted(samples, key=lambda sample: sample["doc_id"])


def _arguments(arguments: Any) -> list[list[str]]:
    # lm-eval logs the request arguments as {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}.
    if isinstance(arguments, dict):
        return [[entry["arg_0"], entry["arg_1"]] for _, entry in sorted(arguments.items(),
                                                                        key=lambda item: int(item[0].split("_")[-1]))]
    return [list(entry) for entry in arguments]


def encode_pair(encode: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair into token ids (TemplateLM._encode_pair, causal).

    Trailing spaces of the context move to the continuation; the whole string is encoded once and the
    continuation is what follows the context's own encoding.
    """
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = encode(context + continuation)
    context_ids = encode(context)
    return context_ids, whole[len(context_ids):]


@dataclass
class Score:
    loglik: float
    is_greedy: bool
    token_logprobs: list[float]
    next_token_id: int  # the greedy token after the continuation (what max_tokens=1 generates)


class DirectScorer:
    """Log-likelihoods from one float32 forward of the model in this process (no server, no scheduler).

    The model is loaded the way the worker loads it (benchmarks/model_setup.py: thread variables, then
    paddle); each sequence is prefilled whole into a fresh contiguous KV cache and scored with
    ``log_softmax`` of the float32 logits at every position.
    """

    def __init__(self, model_path: str | None = None, threads: int = 0) -> None:
        from benchmarks.model_setup import load_model

        loaded = load_model(argparse.Namespace(model=model_path, threads=threads))
        self.model = loaded.model
        self.config = loaded.config
        self.block_size = 64

    def score(self, context_ids: list[int], continuation_ids: list[int]) -> Score:
        import numpy as np
        import paddle

        from benchmarks.model_setup import contiguous_cache
        from worker.attention import build_attention_metadata

        ids = list(context_ids) + list(continuation_ids)
        kv_caches, tables = contiguous_cache(self.config, 1, len(ids), self.block_size)
        meta = build_attention_metadata([len(ids)], [len(ids)], tables, self.block_size)
        hidden = self.model(paddle.to_tensor(ids, dtype="int64"), meta.positions, kv_caches, meta)
        logits = self.model.compute_logits(hidden).numpy().astype(np.float64)
        # Position p predicts token p + 1; the continuation's tokens are predicted by the positions before them.
        start = len(context_ids)
        rows = logits[start - 1: len(ids) - 1]
        log_probs = rows - rows.max(axis=1, keepdims=True)
        log_probs -= np.log(np.exp(log_probs).sum(axis=1, keepdims=True))
        targets = np.asarray(continuation_ids)
        token_logprobs = log_probs[np.arange(len(targets)), targets]
        is_greedy = bool((rows.argmax(axis=1) == targets).all())
        next_token_id = int(logits[len(ids) - 1].argmax())
        return Score(float(token_logprobs.sum()), is_greedy, [float(v) for v in token_logprobs], next_token_id)


def compare(samples: list[dict[str, Any]], scorer: DirectScorer, encode: Any) -> dict[str, Any]:
    """Score every logged pair directly; per-choice differences and both accuracies."""
    deltas, direct_correct, rows = [], 0, []
    for sample in samples:
        direct = [scorer.score(*encode_pair(encode, context, continuation))
                  for context, continuation in sample["pairs"]]
        direct_logliks = [score.loglik for score in direct]
        deltas += [abs(a - b) for a, b in zip(direct_logliks, sample["logliks"])]
        direct_choice = max(range(len(direct_logliks)), key=direct_logliks.__getitem__)
        direct_correct += int(direct_choice == sample["target"])
        rows.append({"doc_id": sample["doc_id"], "target": sample["target"], "lm_eval": sample["logliks"],
                     "direct": direct_logliks, "lm_eval_greedy": sample["is_greedy"],
                     "direct_greedy": [score.is_greedy for score in direct],
                     "next_token": [score.next_token_id for score in direct]})
    return {"documents": len(samples), "choices": len(deltas), "max_abs_loglik_delta": max(deltas),
            "choices_within_1e-4": sum(delta < 1e-4 for delta in deltas),
            "direct_acc": direct_correct / len(samples),
            "lm_eval_acc": sum(sample["acc"] for sample in samples) / len(samples), "rows": rows}


def served_model_id(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M GGUF)")
    parser.add_argument("--out", default=None, help="also write the JSON report to this file")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (lm-eval's output)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from config.model_config import default_model_path
    from engine.tokenizer import load_tokenizer
    from harness.server import ServerProcess

    model_path = args.model or default_model_path()
    work_dir = tempfile.mkdtemp(prefix="fdserve-lm-eval-")
    try:
        tokenizer_dir = export_tokenizer(model_path, os.path.join(work_dir, "tokenizer"))
        server_args = ["--model", model_path, "--max-num-seqs", "8"]
        with ServerProcess(*server_args, id_prefix="lmeval", die_with_parent=True) as server:
            served = served_model_id(server.base_url)
            results, samples, seconds = run_lm_eval(server.base_url, served, tokenizer_dir, work_dir)
        comparison = compare(samples, DirectScorer(model_path), load_tokenizer(model_path).encode)
        task_results = results["results"][TASK_NAME]
        report = {"harness": "lm-eval (EleutherAI lm-evaluation-harness) local-completions",
                  "task": TASK_NAME, "model": served, "lm_eval_seconds": round(seconds, 1),
                  "lm_eval_results": {key: value for key, value in task_results.items() if key != "alias"},
                  **{key: value for key, value in comparison.items() if key != "rows"}}
        text = json.dumps(report, indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return 0 if comparison["max_abs_loglik_delta"] < 1e-4 else 1
    finally:
        if args.keep:
            print(f"work directory kept: {work_dir}", file=sys.stderr)
        else:
            shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
