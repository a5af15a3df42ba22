"""A standard evaluation harness (EleutherAI's lm-eval, ``local-completions``) scores fdserve unmodified.

lm-eval tokenizes locally, sends ``echo`` + ``logprobs`` + ``max_tokens: 1`` completions and sums the
continuation's prompt logprobs (benchmarks/eval_harness.py says exactly what it sends). The end-to-end
test runs the real ``lm_eval`` command line on the local 20-question task against a real server and
compares every choice's log-likelihood, greedy flag and each document's chosen answer with a direct
float32 forward of the same model in this process. The unit tests pin the pieces the comparison relies
on: the task file, the exported tokenizer (equal to fdserve's), the context/continuation split (equal to
lm-eval's own) and the direct scorer (greedy on the reference outputs).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import envs

envs.apply_compute_thread_env(2)  # before paddle is imported (the direct scorer)

import httpx  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from benchmarks.eval_harness import (  # noqa: E402
    TASK_DIR, TASK_NAME, DirectScorer, compare, encode_pair, export_tokenizer, run_lm_eval, served_model_id,
)
from config.model_config import default_model_path  # noqa: E402
from engine.tokenizer import Tokenizer, load_tokenizer  # noqa: E402
from harness.reference import load_reference  # noqa: E402

LOGLIK_TOLERANCE = 1e-4
HAVE_LM_EVAL = importlib.util.find_spec("lm_eval") is not None and importlib.util.find_spec("transformers") is not None
needs_lm_eval = pytest.mark.skipif(not HAVE_LM_EVAL, reason="lm-eval / transformers not installed "
                                   "(pip install -e '.[test]' brings lm-eval[api]==0.4.13 and transformers)")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return export_tokenizer(default_model_path(), str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def scorer() -> DirectScorer:
    return DirectScorer(threads=2)


def task_docs() -> list[dict]:
    with open(TASK_DIR / f"{TASK_NAME}.jsonl", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def task_pairs() -> list[tuple[str, str]]:
    """The (context, continuation) pairs the task's YAML makes: lm-eval's default target delimiter is one space."""
    return [(f"Question: {doc['question']}\nAnswer:", " " + choice) for doc in task_docs() for choice in doc["choices"]]


def test_local_task_is_twenty_four_choice_questions() -> None:
    docs = task_docs()
    assert len(docs) == 20 and [doc["id"] for doc in docs] == list(range(20))
    assert all(len(doc["choices"]) == 4 and len(set(doc["choices"])) == 4 for doc in docs)
    assert {doc["answer"] for doc in docs} == {0, 1, 2, 3}
    spec = yaml.safe_load((TASK_DIR / f"{TASK_NAME}.yaml").read_text())
    assert spec["task"] == TASK_NAME and spec["output_type"] == "multiple_choice"
    assert spec["dataset_path"] == "json"  # a local file: no hub access
    assert (Path(__file__).resolve().parents[1] / spec["dataset_kwargs"]["data_files"]["test"]).is_file()


@needs_lm_eval
def test_exported_tokenizer_encodes_like_fdserve(tokenizer: Tokenizer, tokenizer_dir: str) -> None:
    import transformers

    exported = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = [context + continuation for context, continuation in task_pairs()] + ["digits 12345 and  spaces\t!"]
    for text in texts:
        assert exported(text, add_special_tokens=False).input_ids == tokenizer.encode(text), text
    assert exported.eos_token_id in tokenizer.eos_token_ids


@needs_lm_eval
def test_encode_pair_equals_lm_evals_own_split(tokenizer: Tokenizer, tokenizer_dir: str) -> None:
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    # No base_url: nothing is sent; only its tokenization is used.
    lm = LocalCompletionsAPI(base_url=None, tokenizer_backend="huggingface", tokenizer=tokenizer_dir, model="m")
    pairs = task_pairs() + [("Question: trailing space\nAnswer: ", "yes"), ("x  ", "  y")]
    for context, continuation in pairs:
        context_ids, continuation_ids = encode_pair(tokenizer.encode, context, continuation)
        assert (context_ids, continuation_ids) == tuple(lm._encode_pair(context, continuation))
        assert continuation_ids, (context, continuation)


def test_direct_scorer_finds_the_reference_greedy_continuations_greedy(scorer: DirectScorer) -> None:
    for entry in load_reference()[:3]:
        prompt, output = list(entry["prompt_ids"]), list(entry["output_ids"])[:4]
        score = scorer.score(prompt, output)
        assert score.is_greedy, entry["prompt_ids"][:8]
        assert len(score.token_logprobs) == len(output) and all(value <= 0 for value in score.token_logprobs)
        assert score.loglik == pytest.approx(sum(score.token_logprobs), abs=1e-9)
        # A token the model does not pick is not greedy and is less likely.
        other = scorer.score(prompt, [output[0] + 1])
        assert not other.is_greedy and other.loglik < score.token_logprobs[0]


@pytest.fixture(scope="module")
def lm_eval_run(start_server_module, tokenizer_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    server = start_server_module("--max-num-seqs", "8")
    model_name = served_model_id(server.base_url)
    results, samples, seconds = run_lm_eval(server.base_url, model_name, tokenizer_dir,
                                            str(tmp_path_factory.mktemp("lm_eval")))
    return {"results": results, "samples": samples, "seconds": seconds, "model": model_name, "server": server}


@pytest.fixture(scope="module")
def start_server_module():
    """A module-scoped ``start_server``: one server for the lm-eval run, closed after the module."""
    from harness.server import ServerProcess

    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        server = ServerProcess(*args)
        started.append(server)
        return server.start()

    yield start
    for server in reversed(started):
        server.close()
        assert server.leftovers == []


@pytest.mark.integration
@needs_lm_eval
def test_lm_eval_runs_unmodified_against_the_server(lm_eval_run: dict) -> None:
    task = lm_eval_run["results"]["results"][TASK_NAME]
    samples = lm_eval_run["samples"]
    assert task["sample_len"] == 20 and len(samples) == 20
    assert all(len(sample["pairs"]) == 4 and len(sample["logliks"]) == 4 for sample in samples)
    # Its accuracy is what its own logged log-likelihoods say.
    picked = [max(range(4), key=sample["logliks"].__getitem__) == sample["target"] for sample in samples]
    assert task["acc,none"] == pytest.approx(sum(picked) / 20)
    assert lm_eval_run["results"]["config"]["model"] == "local-completions"


def server_keeps_a_sampled_eos(server, ids: list[int], eos_token_ids: tuple[int, ...]) -> bool:
    """Whether a greedy one-token completion of ``ids`` (whose next token is eos) returns that token."""
    body = {"prompt": [ids], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    choice = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return len(choice["logprobs"]["token_logprobs"]) == len(ids) + 1


@pytest.mark.integration
@needs_lm_eval
def test_lm_eval_scores_equal_a_direct_float32_forward(lm_eval_run: dict, scorer: DirectScorer,
                                                        tokenizer: Tokenizer) -> None:
    """Every choice's log-likelihood, greedy flag and every document's pick equal the direct forward's.

    One known gap is told apart rather than hidden: lm-eval reads ``token_logprobs[ctxlen:-1]``,
    taking the last entry for the generated token; an engine that drops a sampled eos token (no
    token, no logprob; vLLM keeps it) makes lm-eval lose the continuation's last token exactly where
    the model's next token is eos. While the server drops it, only such choices may differ and the test
    ends as xfail saying how many; once the server keeps it, every choice must match.
    """
    comparison = compare(lm_eval_run["samples"], scorer, tokenizer.encode)
    assert comparison["choices"] == 80
    pairs = {(sample["doc_id"], index): pair for sample in lm_eval_run["samples"]
             for index, pair in enumerate(sample["pairs"])}
    eos_next = [(row["doc_id"], index) for row in comparison["rows"]
                for index, token in enumerate(row["next_token"]) if token in tokenizer.eos_token_ids]
    drops_eos = bool(eos_next) and not server_keeps_a_sampled_eos(
        lm_eval_run["server"], sum(encode_pair(tokenizer.encode, *pairs[eos_next[0]]), []), tokenizer.eos_token_ids)

    differing = [(row["doc_id"], index, harness, direct) for row in comparison["rows"]
                 for index, (harness, direct) in enumerate(zip(row["lm_eval"], row["direct"]))
                 if abs(harness - direct) >= LOGLIK_TOLERANCE]
    unexplained = [entry for entry in differing if not (drops_eos and entry[:2] in eos_next)]
    assert unexplained == [], (f"(doc, choice, lm-eval loglik, direct loglik) differing by >= {LOGLIK_TOLERANCE}"
                               f" (server drops a sampled eos: {drops_eos}): {unexplained}")
    affected_docs = {doc for doc, *_ in differing}
    for row in comparison["rows"]:
        if row["doc_id"] in affected_docs:
            continue
        assert row["lm_eval_greedy"] == row["direct_greedy"], row
        assert max(range(4), key=row["lm_eval"].__getitem__) == max(range(4), key=row["direct"].__getitem__), row
    if drops_eos:
        # Everything else was checked above; the exact-equality claim waits for the engine (see README).
        pytest.xfail(f"the engine drops a sampled eos token (vLLM keeps it): {len(differing)} of 80 choices "
                     f"(docs {sorted(affected_docs)}) lose their last logprob in lm-eval; the other choices match")
    assert differing == [] and comparison["lm_eval_acc"] == comparison["direct_acc"]
