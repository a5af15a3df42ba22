"""lm-evaluation-harness, unmodified, scoring a multiple-choice task by log-likelihood through fdserve.

The harness's ``local-completions`` model talks to ``/v1/completions`` exactly as it talks to vLLM:
batched token-id prompts, ``echo: true``, ``logprobs: 1``, ``max_tokens: 1``, and it tokenizes with
the server's own tokenizer through vLLM's ``/tokenize`` and ``/tokenizer_info``
(``tokenizer_backend=remote``, so nothing is downloaded). The task is a small local JSONL file.
Each log-likelihood the harness computed must equal the one of a direct float32 full-sequence
forward of the same model (|delta| < 1e-4), and the accuracy must follow from those values.

Run it by hand the same way::

    python launch.py &
    lm_eval --model local-completions --tasks <task> --include_path <dir with the task yaml> \\
        --model_args base_url=http://127.0.0.1:8000/v1/completions,model=SmolLM2-135M-Instruct.Q4_1,tokenizer_backend=remote
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from config.model_config import default_model_path
from engine.tokenizer import Tokenizer, load_tokenizer
from harness.server import ServerProcess
from tests.test_logprobs import full_sequence_logprobs, runner  # noqa: F401  (runner: the fixture)

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct.Q4_1"
TOLERANCE = 1e-4
QUESTIONS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["three", "four", "five"], "answer": 1},
    {"question": "The color of the sky on a clear day is", "choices": ["green", "red", "blue"], "answer": 2},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Fahrenheit", "Kelvin"], "answer": 0},
]
TASK_YAML = """task: fdserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def evaluation(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    task_dir = tmp_path_factory.mktemp("lm_eval_task")
    data = task_dir / "mc.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (task_dir / "fdserve_mc.yaml").write_text(TASK_YAML.format(data=data))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")  # the json builder is local; never ask the hub
        with ServerProcess("--max-model-len", "1024") as server:
            return lm_eval.simple_evaluate(
                model="local-completions",
                model_args={"base_url": server.base_url + "/v1/completions", "model": MODEL,
                            "tokenizer_backend": "remote", "num_concurrent": 1, "max_retries": 1},
                tasks=["fdserve_mc"], task_manager=TaskManager(include_path=str(Path(task_dir))), log_samples=True)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


def direct_loglikelihood(model_runner: Any, tokenizer: Tokenizer, context: str,
                         continuation: str) -> tuple[float, bool]:
    """Sum of the continuation's float32 logprobs given the context, and whether each token was the argmax
    (the harness's is_greedy), from one full-sequence forward."""
    context_ids, continuation_ids = tokenizer.encode(context), tokenizer.encode(continuation)
    tokens = context_ids + continuation_ids
    logprobs = full_sequence_logprobs(model_runner, tokens)
    rows = range(len(context_ids) - 1, len(tokens) - 1)
    total = float(sum(logprobs[row, tokens[row + 1]] for row in rows))
    greedy = all(int(np.argmax(logprobs[row])) == tokens[row + 1] for row in rows)
    return total, greedy


def test_harness_scores_equal_a_direct_float32_forward(evaluation: dict[str, Any], runner: Any,  # noqa: F811
                                                        tokenizer: Tokenizer) -> None:
    samples = evaluation["samples"]["fdserve_mc"]
    assert len(samples) == len(QUESTIONS)
    correct = 0
    for sample in samples:
        doc = sample["doc"]
        scores = []
        for (context, continuation), ((harness_ll, harness_greedy),) in zip(sample["arguments"], sample["resps"]):
            direct_ll, direct_greedy = direct_loglikelihood(runner, tokenizer, context, continuation)
            assert abs(harness_ll - direct_ll) < TOLERANCE, (context, continuation, harness_ll, direct_ll)
            assert harness_greedy == direct_greedy
            scores.append(direct_ll)
        correct += int(int(np.argmax(scores)) == doc["answer"])
    assert evaluation["results"]["fdserve_mc"]["acc,none"] == pytest.approx(correct / len(QUESTIONS))
