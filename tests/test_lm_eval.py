"""lm-evaluation-harness through vLLM's tokenizer endpoints (``tokenizer_backend=remote``), unmodified.

``tests/test_eval_harness.py`` runs the harness with an exported Hugging Face tokenizer and compares its
scores with a direct float32 forward. This module covers the other way the harness talks to a vLLM-like
server: ``local-completions`` with ``tokenizer_backend=remote`` tokenizes through ``/tokenizer_info`` and
``/tokenize`` (engine/entrypoints/tokenizer_routes.py), so nothing is exported or downloaded. Checked: the
harness detects the endpoints and runs a local multiple-choice task; the token ids it scored are the
server's own tokenization; every log-likelihood it reports is the sum of the continuation's logprobs an
``echo`` completion of the same ids returns. The task avoids continuations the model would end with eos
(see the xfail in test_eval_harness.py: the engine drops a sampled eos token, and lm-eval reads
``token_logprobs[ctxlen:-1]``).

Run it by hand the same way::

    python launch.py &
    lm_eval --model local-completions --tasks <task> --include_path <dir with the task yaml> \\
        --model_args base_url=http://127.0.0.1:8000/v1/completions,model=SmolLM2-135M-Instruct.Q4_1,tokenizer_backend=remote
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from config.model_config import default_model_path
from engine.tokenizer import Tokenizer, load_tokenizer
from harness.server import ServerProcess

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
def server() -> Any:
    with ServerProcess("--max-model-len", "1024") as proc:
        yield proc


@pytest.fixture(scope="module")
def evaluation(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    task_dir = tmp_path_factory.mktemp("lm_eval_task")
    data = task_dir / "mc.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (task_dir / "fdserve_mc.yaml").write_text(TASK_YAML.format(data=data))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")  # the json builder is local; never ask the hub
        return lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"base_url": server.base_url + "/v1/completions", "model": MODEL,
                        "tokenizer_backend": "auto", "num_concurrent": 1, "max_retries": 1},
            tasks=["fdserve_mc"], task_manager=TaskManager(include_path=str(Path(task_dir))), log_samples=True)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


def echo_loglikelihood(server: ServerProcess, context_ids: list[int], continuation_ids: list[int]) -> float:
    """The continuation's log-likelihood from an echo completion of the same token ids."""
    body = {"model": MODEL, "prompt": context_ids + continuation_ids, "max_tokens": 0, "echo": True, "logprobs": 0}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    token_logprobs = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    return float(sum(token_logprobs[len(context_ids):]))


def test_remote_tokenizer_is_detected_and_matches_the_servers(server: ServerProcess, tokenizer: Tokenizer) -> None:
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support
    assert check_remote_tokenizer_support(server.base_url + "/v1/completions")
    remote = RemoteTokenizer(server.base_url + "/v1/completions")
    for text in ("Question: two plus two?", " Paris", "héllo 日本"):
        assert remote.encode(text) == tokenizer.encode(text)
        assert remote.decode(tokenizer.encode(text)) == text
    assert remote.eos_token_id in tokenizer.eos_token_ids


def test_harness_scores_equal_the_servers_echo_logprobs(evaluation: dict[str, Any], server: ServerProcess,
                                                        tokenizer: Tokenizer) -> None:
    samples = evaluation["samples"]["fdserve_mc"]
    assert len(samples) == len(QUESTIONS)
    correct = 0
    for sample in samples:
        scores = []
        for (context, continuation), ((harness_ll, _greedy),) in zip(sample["arguments"], sample["resps"]):
            expected = echo_loglikelihood(server, tokenizer.encode(context), tokenizer.encode(continuation))
            assert abs(harness_ll - expected) < TOLERANCE, (context, continuation, harness_ll, expected)
            scores.append(harness_ll)
        correct += int(int(np.argmax(scores)) == sample["doc"]["answer"])
    assert evaluation["results"]["fdserve_mc"]["acc,none"] == pytest.approx(correct / len(QUESTIONS))
