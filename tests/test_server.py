"""End-to-end tests against the real multi-process server (launch.py -> engine -> worker).

Correctness is judged against ../shared/reference (float32 greedy outputs of an
independent implementation), through the real ``openai`` client where the
OpenAI shape matters.
"""
from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from harness.server import ServerProcess, shm_names
from harness.reference import expected_prefix, load_reference

pytestmark = pytest.mark.integration

REFERENCE = load_reference()


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "16") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def greedy_completion(base_url: str, entry: dict) -> dict:
    body = {"prompt": entry["prompt_ids"], "max_tokens": len(entry["output_ids"]), "temperature": 0,
            "return_token_ids": True}
    resp = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    resp.raise_for_status()
    return resp.json()


def check_reference(entry: dict, completion_ids: list[int]) -> None:
    ours, ref = expected_prefix(entry, completion_ids)
    assert ours == ref, f"prompt {entry['prompt']!r} diverged from the reference"


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1"]
    health = httpx.get(server.base_url + "/health").json()
    assert health["status"] == "ok" and health["workers"][0]["ready"]


def test_reference_outputs_one_at_a_time(server):
    for entry in REFERENCE:
        choice = greedy_completion(server.base_url, entry)["choices"][0]
        assert choice["prompt_token_ids"] == entry["prompt_ids"]
        # The end-of-sequence token that stopped it is the last token, as in vLLM (its text is not shown).
        assert 2 not in choice["completion_token_ids"][:-1]
        check_reference(entry, choice["completion_token_ids"])
        stopped = entry["output_ids"][-1] == 2
        assert choice["finish_reason"] == ("stop" if stopped else "length")


def test_reference_outputs_concurrently_share_batches(server):
    steps_before = httpx.get(server.base_url + "/health").json()["scheduler"]["num_steps"]
    with concurrent.futures.ThreadPoolExecutor(len(REFERENCE)) as pool:
        results = list(pool.map(lambda e: greedy_completion(server.base_url, e), REFERENCE))
    for entry, result in zip(REFERENCE, results):
        check_reference(entry, result["choices"][0]["completion_token_ids"])
    steps = httpx.get(server.base_url + "/health").json()["scheduler"]["num_steps"] - steps_before
    total_tokens = sum(r["usage"]["completion_tokens"] for r in results)
    assert steps < total_tokens * 0.5, "concurrent requests were not batched together"


def test_chat_through_openai_client_matches_reference(client):
    for entry in REFERENCE:
        resp = client.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1", messages=[{"role": "user", "content": entry["prompt"]}],
            temperature=0, max_tokens=len(entry["output_ids"]), extra_body={"return_token_ids": True})
        choice = resp.choices[0]
        assert choice.prompt_token_ids == entry["prompt_ids"]  # template + tokenizer agree with the reference
        check_reference(entry, choice.completion_token_ids)
        assert resp.usage.prompt_tokens == len(entry["prompt_ids"])
        assert resp.usage.completion_tokens == len(choice.completion_token_ids)


def test_streaming_chat_yields_reference_text(client):
    entry = REFERENCE[0]
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=[{"role": "user", "content": entry["prompt"]}],
        temperature=0, max_tokens=32, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == entry["output_text"]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"]
    assert chunks[-1].usage.completion_tokens == len(entry["output_ids"])  # the stopping eos counts (vLLM)


def test_streaming_completion_sse_ends_with_done(server):
    body = {"prompt": REFERENCE[1]["prompt_ids"], "max_tokens": 5, "temperature": 0, "stream": True,
            "return_token_ids": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    tokens = []
    for line in lines[:-1]:
        chunk = httpx.Response(200, content=line[len("data: "):]).json()
        tokens += chunk["choices"][0].get("completion_token_ids") or []
    assert tokens == REFERENCE[1]["output_ids"][:5]


def test_sampling_seed_is_reproducible_and_seeds_differ(client):
    def sample(seed: int) -> str:
        resp = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="Once upon a time",
                                         max_tokens=24, temperature=1.0, top_p=0.95, seed=seed,
                                         extra_body={"top_k": 50, "ignore_eos": True})
        return resp.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2)}) == 3


def test_max_tokens_length_and_ignore_eos(client):
    resp = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=REFERENCE[0]["prompt_ids"],
                                     max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 20


def test_stop_string_truncates(client):
    entry = REFERENCE[0]  # "The capital of France is Paris."
    resp = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=entry["prompt_ids"],
                                     max_tokens=16, temperature=0, stop=[" Paris"])
    assert resp.choices[0].text == "The capital of France is"
    assert resp.choices[0].finish_reason == "stop"


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"prompt": REFERENCE[2]["prompt_ids"], "max_tokens": 2000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as resp:
        for n, _line in enumerate(resp.iter_lines()):
            if n >= 3:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = httpx.get(server.base_url + "/health").json()["scheduler"]
        if stats["num_running"] == 0 and stats["kv_blocks_used"] == 0:
            return
        time.sleep(0.2)
    pytest.fail(f"blocks not freed after disconnect: {stats}")


def test_preemption_under_a_tiny_pool_keeps_outputs_exact():
    # 8 blocks x 16 tokens = 128 tokens: the six reference requests (~40 + up to 64 tokens each) cannot all
    # fit, so the scheduler must preempt and recompute; greedy outputs must not change.
    with ServerProcess("--block-size", "16", "--num-gpu-blocks-override", "8", "--max-model-len", "128") as srv:
        with concurrent.futures.ThreadPoolExecutor(len(REFERENCE)) as pool:
            results = list(pool.map(lambda e: greedy_completion(srv.base_url, e), REFERENCE))
        for entry, result in zip(REFERENCE, results):
            check_reference(entry, result["choices"][0]["completion_token_ids"])
        stats = httpx.get(srv.base_url + "/health").json()["scheduler"]
        assert stats["num_preemptions"] > 0 and stats["kv_blocks_used"] == 0


def test_sigint_stops_everything_quickly_and_leaves_no_shared_memory(start_server):
    srv = start_server()
    assert shm_names(srv.instance_id), "the running server should have shared-memory segments"
    elapsed = srv.stop()
    assert srv.proc.returncode == 0, srv.log_tail()
    assert elapsed < 10.0
    assert shm_names(srv.instance_id) == []


def _pid_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigkill_of_launch_children_exit_and_next_start_sweeps():
    first = ServerProcess().start()
    try:
        children = first.descendants()
        assert len(children) >= 2  # at least the engine and its worker
        first.proc.kill()
        first.proc.wait(5)
        deadline = time.monotonic() + 15
        while any(_pid_running(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_pid_running(p) for p in children), "children outlived a SIGKILLed launch.py"
        assert shm_names(first.instance_id), "a killed launch.py cannot clean up; the next start must"
    finally:
        first.kill_group()
    with ServerProcess(port=first.port, instance_id=first.instance_id) as second:
        assert "stale" in second.log_tail(200)
        resp = httpx.post(second.base_url + "/v1/completions",
                          json={"prompt": REFERENCE[0]["prompt_ids"], "max_tokens": 4, "temperature": 0})
        assert resp.status_code == 200
    assert second.leftovers == [], "the server left shared-memory names for close() to sweep"
