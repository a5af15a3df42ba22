"""OpenAI API parity through the real ``openai`` client (sync, async, streaming) against the real server.

One server for the module (``launch.py`` with prefix caching on). Checked here: the shape and the
internal consistency of logprobs (completions and chat, streamed and not), echo (with max_tokens 0,
cached and uncached prefixes giving the same values), vLLM's prompt_logprobs, n choices (greedy ones
identical to n=1 and to the float32 reference; seeded ones reproducible), batched prompts (order,
usage, streaming), penalties and min_tokens changing the output, the 404 of an unknown model and the
completions max_tokens default of 16. Logprob VALUES against a direct float32 forward are the
sampler's tests; here only shapes, consistency and the cached/uncached equality.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from typing import Any, Iterator

import httpx
import openai
import pytest

from harness.reference import expected_prefix, load_reference
from harness.server import ServerProcess

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct.Q4_1"
REFERENCE = load_reference()
# Long enough to fill several KV blocks, so a second request is served from the prefix cache.
LONG_PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
               "books were made and read across Europe. ") * 6


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--enable-prefix-caching", "--max-model-len", "2048", "--max-num-seqs", "16") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.openai_client()


def async_client(server: ServerProcess) -> openai.AsyncOpenAI:
    return server.openai_client(asynchronous=True)


def extra(obj: Any, name: str) -> Any:
    """A response field outside OpenAI's schema (vLLM / FastDeploy extensions)."""
    return (obj.model_extra or {}).get(name)


def check_completion_logprobs(text: str, logprobs: Any, k: int, greedy: bool) -> None:
    """Shape and consistency of one completions ``logprobs`` object (no echo)."""
    n = len(logprobs.tokens)
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.text_offset) == n
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert all(0 <= offset <= len(text) for offset in logprobs.text_offset)
    for chosen, token, top in zip(logprobs.token_logprobs, logprobs.tokens, logprobs.top_logprobs):
        assert chosen <= 0.0
        assert k <= len(top) <= k + 1  # the top k plus the chosen token when it is not among them
        assert sum(math.exp(lp) for lp in top.values()) <= 1.0 + 1e-4
        if greedy:
            assert chosen == pytest.approx(max(top.values()), abs=1e-6)
        if token in top:
            assert top[token] == pytest.approx(chosen, abs=1e-6)


# --- models, defaults, errors ----------------------------------------------------------------------------------


def test_models_lists_the_served_id(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_unknown_model_is_not_found(client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=1)
    assert info.value.code == "model_not_found"

    async def chat() -> None:
        async with async_client(server) as aclient:
            await aclient.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        asyncio.run(chat())


def test_completions_max_tokens_default_is_16(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 16
    assert completion.choices[0].finish_reason == "length"


def test_bad_field_is_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, suffix="the end")
    assert info.value.param == "suffix"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], top_logprobs=2)
    assert info.value.param == "top_logprobs"


# --- logprobs -------------------------------------------------------------------------------------------------


def test_completion_logprobs_greedy(client: openai.OpenAI) -> None:
    entry = REFERENCE[0]
    completion = client.completions.create(model=MODEL, prompt=entry["prompt_ids"], max_tokens=8, temperature=0,
                                           logprobs=5, extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = completion.choices[0]
    check_completion_logprobs(choice.text, choice.logprobs, 5, greedy=True)
    ids = extra(choice, "completion_token_ids")
    assert len(choice.logprobs.tokens) == len(ids) == 8
    ours, ref = expected_prefix(entry, ids)
    assert ours == ref
    # Each token decodes whole here (ASCII text); the eos token (generated under ignore_eos) is shown in
    # logprobs as vLLM shows it, "<|im_end|>", but adds no text (skip_special_tokens).
    assert "".join(t for t in choice.logprobs.tokens if t != "<|im_end|>") == choice.text


def test_streamed_logprobs_equal_non_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="The three primary colors are", max_tokens=10, temperature=0, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0]
    tokens: list[str] = []
    values: list[float] = []
    offsets: list[int] = []
    text = ""
    for chunk in client.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens
            values += choice.logprobs.token_logprobs
            offsets += choice.logprobs.text_offset
    assert text == whole.text
    assert tokens == whole.logprobs.tokens
    assert values == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6)
    assert offsets == whole.logprobs.text_offset


def test_chat_logprobs_async_and_streamed(server: ServerProcess) -> None:
    messages = [{"role": "user", "content": REFERENCE[0]["prompt"]}]

    async def run() -> tuple[Any, list[Any]]:
        async with async_client(server) as aclient:
            whole = await aclient.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                          temperature=0, logprobs=True, top_logprobs=3)
            stream = await aclient.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                           temperature=0, logprobs=True, top_logprobs=3,
                                                           stream=True)
            streamed = []
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].logprobs is not None:
                    streamed += chunk.choices[0].logprobs.content
            return whole, streamed

    whole, streamed = asyncio.run(run())
    choice = whole.choices[0]
    content = choice.logprobs.content
    assert bytes(b for item in content for b in item.bytes).decode("utf-8", errors="replace").startswith(
        choice.message.content)
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-6)  # greedy: the top-1
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert sum(math.exp(t.logprob) for t in item.top_logprobs) <= 1.0 + 1e-4
    assert [item.token for item in streamed] == [item.token for item in content]


def test_echo_logprobs_cached_equal_uncached(client: openai.OpenAI, server: ServerProcess) -> None:
    httpx.post(server.base_url + "/v1/cache/reset", timeout=30).raise_for_status()
    kwargs = dict(model=MODEL, prompt=LONG_PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    first = client.completions.create(**kwargs)  # nothing cached: every prompt position computed
    # A plain request with the same prompt: its prefix is in the cache now (whatever the engine does for
    # requests that need prompt logprobs, they must not lose any).
    warm = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=1)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    second = client.completions.create(**kwargs)
    for completion in (first, second):
        choice = completion.choices[0]
        assert choice.text == LONG_PROMPT
        assert completion.usage.completion_tokens == 0
        assert len(choice.logprobs.tokens) == completion.usage.prompt_tokens
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
        assert all(value is not None for value in choice.logprobs.token_logprobs[1:])
        assert choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)
    assert second.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        first.choices[0].logprobs.token_logprobs[1:], abs=1e-4)


def test_echo_then_generation(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=0,
                                       temperature=0)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=0, temperature=0)
    choice = echoed.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    n_prompt = echoed.usage.prompt_tokens
    assert choice.logprobs.tokens[n_prompt:] == plain.choices[0].logprobs.tokens
    assert choice.logprobs.text_offset[n_prompt] == len(prompt)


def test_prompt_logprobs_extension_matches_echo(client: openai.OpenAI) -> None:
    prompt = "Water boils at one hundred degrees"
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                           extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    choice = completion.choices[0]
    shown = extra(choice, "prompt_logprobs")
    prompt_ids = extra(choice, "prompt_token_ids")
    assert shown[0] is None and len(shown) == len(prompt_ids)
    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    for position in range(1, len(prompt_ids)):
        entry = shown[position]
        token = entry[str(prompt_ids[position])]
        assert 2 <= len(entry) <= 3 and token["rank"] >= 1
        assert token["logprob"] == pytest.approx(echo.choices[0].logprobs.token_logprobs[position], abs=1e-4)
        top1 = min(entry.values(), key=lambda item: item["rank"])
        assert top1["rank"] == 1 and top1["logprob"] >= token["logprob"] - 1e-6


# --- n choices and batched prompts -----------------------------------------------------------------------------


def test_greedy_n_choices_equal_n1_and_reference(client: openai.OpenAI) -> None:
    entry = REFERENCE[1]
    kwargs = dict(model=MODEL, prompt=entry["prompt_ids"], max_tokens=len(entry["output_ids"]), temperature=0,
                  extra_body={"return_token_ids": True})
    one = client.completions.create(**kwargs)
    single = one.choices[0]
    many = client.completions.create(n=3, **kwargs)
    assert [c.index for c in many.choices] == [0, 1, 2]
    for choice in many.choices:
        assert extra(choice, "completion_token_ids") == extra(single, "completion_token_ids")
        assert choice.text == single.text
    ours, ref = expected_prefix(entry, extra(single, "completion_token_ids"))
    assert ours == ref
    assert many.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt is counted once
    assert many.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_seeded_n_choices_are_reproducible_and_differ(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Write a word about the sea:", max_tokens=16, temperature=1.0, n=3, seed=1234,
                  extra_body={"ignore_eos": True})
    first = [c.text for c in client.completions.create(**kwargs).choices]
    again = [c.text for c in client.completions.create(**kwargs).choices]
    assert first == again
    assert len(set(first)) > 1  # each choice has its own random stream


def test_chat_n_streamed_matches_non_streamed(server: ServerProcess) -> None:
    messages = [{"role": "user", "content": REFERENCE[3]["prompt"]}]

    async def run() -> tuple[Any, dict[int, str], dict[int, str]]:
        async with async_client(server) as aclient:
            whole = await aclient.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=12,
                                                          temperature=0)
            texts: dict[int, str] = {}
            finishes: dict[int, str] = {}
            stream = await aclient.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=12,
                                                           temperature=0, stream=True)
            async for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
                    if choice.finish_reason:
                        finishes[choice.index] = choice.finish_reason
            return whole, texts, finishes

    whole, texts, finishes = asyncio.run(run())
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}


def test_batched_prompts_order_and_usage(client: openai.OpenAI) -> None:
    prompts = [REFERENCE[i]["prompt_ids"] for i in (0, 2, 4)]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    texts: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, stream=True,
                                           n=2):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    # prompt p, choice i -> index p * n + i
    assert texts == {p * 2 + i: singles[p].choices[0].text for p in range(3) for i in range(2)}


# --- sampling controls change the output ----------------------------------------------------------------------


def test_frequency_penalty_reduces_repeats(client: openai.OpenAI) -> None:
    prompt = "1, 2, 3, 4, 5,"  # greedy counts on: ", " comes back after every number
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    plain = extra(client.completions.create(**kwargs).choices[0], "completion_token_ids")
    penalized = extra(client.completions.create(frequency_penalty=2.0, **kwargs).choices[0], "completion_token_ids")
    assert Counter(penalized).most_common(1)[0][1] < Counter(plain).most_common(1)[0][1]
    assert len(set(penalized)) > len(set(plain))


def test_min_tokens_delays_the_end(client: openai.OpenAI) -> None:
    entry = REFERENCE[0]  # ends with eos after a short sentence
    kwargs = dict(model=MODEL, prompt=entry["prompt_ids"], max_tokens=40, temperature=0)
    plain = client.completions.create(**kwargs)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 20
    longer = client.completions.create(extra_body={"min_tokens": 20}, **kwargs)
    assert longer.usage.completion_tokens >= 20


def _engine_idle(server: ServerProcess, timeout: float = 10.0) -> dict[str, Any]:
    """/health once nothing runs in the API server nor in the engine (or the last reading at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(server.base_url + "/health", timeout=10).json()
        if health["active_requests"] == 0 and health["scheduler"]["num_running"] == 0 \
                and health["scheduler"]["num_waiting"] == 0:
            return health
        if time.monotonic() > deadline:
            return health
        time.sleep(0.2)


def test_disconnect_aborts_every_choice_of_every_prompt(client: openai.OpenAI, server: ServerProcess) -> None:
    long_run = dict(model=MODEL, prompt=["Tell a long story.", "Count to one thousand."], n=2, max_tokens=1500,
                    temperature=1.0, extra_body={"ignore_eos": True})
    stream = client.completions.create(stream=True, **long_run)
    chunks = iter(stream)
    assert {next(chunks).choices[0].index for _ in range(8)}  # the sequences are running
    busy = httpx.get(server.base_url + "/health", timeout=10).json()
    assert busy["scheduler"]["num_running"] + busy["scheduler"]["num_waiting"] >= 1
    stream.close()
    health = _engine_idle(server)
    assert (health["active_requests"], health["scheduler"]["num_running"], health["scheduler"]["num_waiting"]) \
        == (0, 0, 0)
