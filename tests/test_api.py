"""The OpenAI-compatible API (issue 22), called with the official `openai` package, on a real swarm.

A DHT peer, two servers (blocks 0:3 and 3:6) and a `swarm-api` process, all real, on loopback.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

import openai
import pytest
import torch
from transformers import AutoTokenizer

from client import AutoDistributedModelForCausalLM
from swarm.dht_keys import default_prefix
from swarm.local_swarm import LocalSwarm
from swarm.models.tiny import TinyModelSpec, build_tiny_model
from tests.browser import Browser
from tests.conftest import NUM_BLOCKS

KEY = "test-key-0123456789"
RESULTS = Path(__file__).resolve().parent.parent / "results"


class Api(NamedTuple):
    swarm: LocalSwarm
    url: str  # http://host:port
    model: str  # the model id it serves
    idle_cache: dict[str, int]  # each server's announced free cache before any request


@pytest.fixture(scope="module")
def api(llama_dir, tmp_path_factory):
    """A running API with a key, 8 slots and 2 queue places."""
    swarm = LocalSwarm(tmp_path_factory.mktemp("api"))
    try:
        swarm.start_dht()
        for name, blocks in (("first", "0:3"), ("second", f"3:{NUM_BLOCKS}")):
            swarm.start_server(name, llama_dir, blocks)
        prefix = default_prefix(str(llama_dir))
        online = swarm.wait_online(prefix, NUM_BLOCKS, ["first", "second"])
        idle_cache = {name: info.cache_bytes_left for name, info in online.items()}  # nothing open yet
        url = swarm.start_api(
            "api", llama_dir, "--api-key", KEY, "--max-concurrent", "8", "--max-queued", "2"
        )
        yield Api(swarm, url, prefix, idle_cache)
    finally:
        assert not swarm.close()


@pytest.fixture(scope="module")
def reference(api, llama_dir):
    """The client's own generate() on the same swarm: what the API must return."""
    swarm = api.swarm
    model = AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers)
    yield model, AutoTokenizer.from_pretrained(llama_dir)
    model.shutdown()


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def greedy_text(reference, prompt_ids: list[int], max_tokens: int) -> str:
    model, tokenizer = reference
    output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(output[0, len(prompt_ids) :], skip_special_tokens=True)


def test_greedy_completion_equals_the_clients_generate(api, reference):
    url, model = api.url, api.model
    prompt = "Once upon a time"
    completion = client(url).completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    choice = completion.choices[0]
    assert choice.text == greedy_text(reference, reference[1](prompt).input_ids, 12)
    assert choice.finish_reason in ("length", "stop")
    prompt_tokens = len(reference[1](prompt).input_ids)
    assert completion.usage.prompt_tokens == prompt_tokens and 1 <= completion.usage.completion_tokens <= 12
    assert [card.id for card in client(url).models.list().data] == [model]


def test_chat_completion_streamed_and_not(api, reference):
    url, model = api.url, api.model
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    whole = client(url).chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    pieces, finish, roles = [], None, []
    stream = client(url).chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        roles += [delta.role] if delta.role else []
        pieces.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert roles == ["assistant"]
    assert (
        "".join(pieces) == whole.choices[0].message.content and whole.choices[0].message.role == "assistant"
    )
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.total_tokens == whole.usage.total_tokens
    # the tiny model has no chat template: the documented simple one is used
    expected_prompt = "<|system|>\nBe brief.\n<|user|>\nTell me a story\n<|assistant|>\n"
    assert whole.choices[0].message.content == greedy_text(
        reference, reference[1](expected_prompt).input_ids, 10
    )


def test_eight_concurrent_streams_complete(api, reference):
    url, model = api.url, api.model
    prompts = [f"Story number {index}" for index in range(8)]
    texts: dict[int, str] = {}
    errors: list[BaseException] = []

    def stream(index: int) -> None:
        try:
            chunks = client(url).completions.create(
                model=model, prompt=prompts[index], max_tokens=8, temperature=0, stream=True
            )
            texts[index] = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=stream, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    for index, prompt in enumerate(prompts):
        assert texts[index] == greedy_text(reference, reference[1](prompt).input_ids, 8), index


def test_seeded_sampling_is_reproducible_and_stop_strings_cut(api):
    url, model = api.url, api.model
    ask = client(url).completions.create
    first = ask(model=model, prompt="Hello", max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    again = ask(model=model, prompt="Hello", max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    assert first.choices[0].text == again.choices[0].text
    text = ask(model=model, prompt="Hello", max_tokens=10, temperature=0).choices[0].text
    if len(text) >= 3:
        stop = text[1:3]
        cut = ask(model=model, prompt="Hello", max_tokens=10, temperature=0, stop=[stop]).choices[0]
        assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"


def test_an_api_with_a_draft_model_answers_as_one_without(api, llama_dir, tmp_path_factory):
    """`swarm-api --assistant`: speculative decoding for every request changes no output, greedy or
    seeded sampling (a position's draw does not depend on how many drafts were verified)."""
    spec = TinyModelSpec(family="llama", num_layers=2, num_kv_heads=2)
    draft = build_tiny_model(tmp_path_factory.mktemp("api-draft"), spec)
    assisted_url = api.swarm.start_api("api-assisted", llama_dir, "--api-key", KEY, "--assistant", str(draft))
    try:
        for settings in ({"temperature": 0}, {"temperature": 1.0, "top_p": 0.9, "seed": 11}):
            answers = [
                client(url).completions.create(model=api.model, prompt="Hello you", max_tokens=16, **settings)
                for url in (api.url, assisted_url)
            ]
            texts = [answer.choices[0].text for answer in answers]
            assert texts[0] == texts[1], settings
        assert "speculative decoding with the draft model" in api.swarm.log("api-assisted")
    finally:
        api.swarm.stop("api-assisted")


def test_bad_requests_get_openai_errors(api):
    url, model = api.url, api.model
    ask = client(url).completions.create
    for kwargs, match in (
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 10**9}, "exceeds this server's limit"),
        ({"max_tokens": 4, "extra_body": {"evil": True}}, "evil"),
        ({"max_tokens": 4, "temperature": 5}, "temperature"),
        ({"max_tokens": 4, "n": 3}, "n"),
    ):
        with pytest.raises(openai.BadRequestError, match=match):
            ask(model=model, prompt="Hi", **kwargs)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client(url).chat.completions.create(model=model, messages=[], max_tokens=4)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        ask(model="gpt-9", prompt="Hi", max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        client(url, key="wrong-key-123456").completions.create(model=model, prompt="Hi", max_tokens=4)
    request = urllib.request.Request(f"{url}/v1/completions", data=b"{not json", method="POST")
    request.add_header("Authorization", f"Bearer {KEY}")
    with pytest.raises(urllib.error.HTTPError) as failure:
        urllib.request.urlopen(request, timeout=30)
    assert failure.value.code == 400 and b"not valid JSON" in failure.value.read()


def test_too_many_requests_get_429(api):
    """8 slots and 2 queue places: of 14 simultaneous long requests, some are refused with 429 at once."""
    url, model = api.url, api.model
    outcomes: list[str] = []

    def ask() -> None:
        try:
            client(url).completions.create(model=model, prompt="Go", max_tokens=40, temperature=0)
            outcomes.append("ok")
        except openai.RateLimitError:
            outcomes.append("429")

    threads = [threading.Thread(target=ask) for _ in range(14)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert outcomes.count("429") >= 1 and outcomes.count("ok") >= 8, outcomes


def test_a_dropped_stream_frees_the_servers_cache(api, llama_dir):
    swarm, url, model = api.swarm, api.url, api.model
    prefix = default_prefix(str(llama_dir))

    def announced() -> dict[str, int]:
        return {
            info.public_name: info.cache_bytes_left for info in swarm.servers(prefix, NUM_BLOCKS).values()
        }

    stream = client(url).completions.create(
        model=model, prompt="Long", max_tokens=400, temperature=0, stream=True
    )
    for received, _chunk in enumerate(stream):
        if received == 3:
            break
    stream.close()  # the HTTP connection goes away mid-generation
    deadline = time.monotonic() + 60
    while "left mid-stream" not in swarm.log("api"):
        assert time.monotonic() < deadline, swarm.log("api")[-2000:]
        time.sleep(0.2)
    while announced() != api.idle_cache:
        assert time.monotonic() < deadline, "the servers did not free the dropped session's cache"
        time.sleep(0.5)


def test_health_and_metrics(api):
    url = api.url
    with urllib.request.urlopen(f"{url}/health", timeout=30) as reply:
        assert b'"status": "ok"' in reply.read()
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    assert 'swarm_api_requests_total{route="/v1/completions",status="200"}' in text
    assert "swarm_api_ttft_seconds_count" in text and "swarm_api_time_per_output_token_seconds" in text


@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="needs Debian's chromium (scripts/test.sh installs it)"
)
def test_chat_page_streams_an_answer_in_a_browser(api):
    """A real browser sends a message from the page and watches the answer stream in; the text it shows
    is what the API answers for the same conversation."""
    url, model = api.url, api.model
    watcher = Browser()
    try:
        shown, seen, screenshot = asyncio.run(
            watcher.watch(
                f"{url}/?message=Hello%20there&key={KEY}",
                "document.querySelector('.assistant[data-done]')?.textContent",
            )
        )
    finally:
        watcher.close()
    expected = client(url).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=64, temperature=0
    )
    assert shown and shown == expected.choices[0].message.content, (shown, seen[-3:])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "chat_page.png").write_bytes(screenshot)
    assert len(screenshot) > 10_000


def test_a_swarm_that_cannot_serve_gives_503(api):
    """Last in this module: blocks 3:6 lose their only server; the API answers 503 in OpenAI's format
    (after the client's wait for a server to cover them), not a hang or a 500."""
    api.swarm.stop("second")
    with pytest.raises(openai.InternalServerError) as failure:
        client(api.url).completions.create(model=api.model, prompt="Hi", max_tokens=4, temperature=0)
    assert failure.value.status_code == 503 and "cannot serve" in str(failure.value)
