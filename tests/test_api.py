"""The OpenAI-compatible API, called with the official `openai` package, on a real swarm.

A DHT peer, two servers (blocks 0:3 and 3:6) and a `swarm-api` process, all real, on loopback. The
evaluation and agent clients (lm-eval's `local-completions`, LangChain's `ChatOpenAI`) and the
log-probabilities they rely on are tested against the same swarm further down.
"""

from __future__ import annotations

import asyncio
import functools
import json
import operator
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

from harness.local_swarm import LocalSwarm
from llm_swarm.client import AutoDistributedModelForCausalLM
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model
from tests.browser import Browser
from tests.conftest import NUM_BLOCKS
from tests.tool_model import build_tool_calling_checkpoint

pytestmark = pytest.mark.swarm  # every test here starts processes

KEY = "test-key-0123456789"
RESULTS = Path(__file__).resolve().parent.parent / "results"


class Api(NamedTuple):
    swarm: LocalSwarm
    url: str  # http://host:port
    model: str  # the model id it serves
    idle_cache: dict[str, int]  # each server's announced free cache before any request


@pytest.fixture(scope="module")
def api(llama_dir, tmp_path_factory):
    """A running API with a key, 8 slots and 2 queue places, and 4096 tokens per request."""
    swarm = LocalSwarm(tmp_path_factory.mktemp("api"))
    try:
        swarm.start_dht()
        for name, blocks in (("first", "0:3"), ("second", f"3:{NUM_BLOCKS}")):
            swarm.start_server(name, llama_dir, blocks)
        prefix = default_prefix(str(llama_dir))
        online = swarm.wait_online(prefix, NUM_BLOCKS, ["first", "second"])
        idle_cache = {name: info.cache_bytes_left for name, info in online.items()}  # nothing open yet
        url = swarm.start_api(
            "api",
            llama_dir,
            "--api-key",
            KEY,
            "--max-concurrent",
            "8",
            "--max-queued",
            "2",
            "--max-request-tokens",
            "4096",
            "--wait-for-servers",
            "3",
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


@pytest.mark.compat
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
    seeded sampling (a position's draw does not depend on how many drafts were verified), nor the
    log-probabilities."""
    spec = TinyModelSpec(family="llama", num_layers=2, num_kv_heads=2)
    draft = build_tiny_model(tmp_path_factory.mktemp("api-draft"), spec)
    assisted_url = api.swarm.start_api("api-assisted", llama_dir, "--api-key", KEY, "--assistant", str(draft))
    try:
        for settings in ({"temperature": 0}, {"temperature": 1.0, "top_p": 0.9, "seed": 11}):
            answers = [
                client(url).completions.create(
                    model=api.model, prompt="Hello you", max_tokens=16, logprobs=2, **settings
                )
                for url in (api.url, assisted_url)
            ]
            texts = [answer.choices[0].text for answer in answers]
            assert texts[0] == texts[1], settings
            # log-probabilities from the verification of drafts are those of one token at a time
            plain, assisted = (answer.choices[0].logprobs for answer in answers)
            assert plain.tokens == assisted.tokens
            assert all(
                abs(a - b) < 1e-4 for a, b in zip(plain.token_logprobs, assisted.token_logprobs, strict=True)
            )
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
        ({"max_tokens": 4, "n": 10**6}, "n"),
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


# --- what evaluation harnesses and agent frameworks use: log-probabilities, echo, n, batches, tools ---
@pytest.fixture(scope="module")
def local(llama_dir, local_reference):
    """transformers' own model of the same checkpoint, in float32: the numbers the API must give."""
    return local_reference(llama_dir)[0], AutoTokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def tools_api(api, llama_dir, tmp_path_factory):
    """A second API on the same swarm (same blocks) over a checkpoint whose chat template renders tools
    and whose model answers every chat with a get_weather call (`tests/tool_model.py`)."""
    checkpoint = build_tool_calling_checkpoint(llama_dir, tmp_path_factory.mktemp("tiny-tools"))
    url = api.swarm.start_api(
        "api-tools", checkpoint, "--api-key", KEY, "--dht-prefix", api.model, "--model-name", "tiny-tools"
    )
    yield url
    api.swarm.stop("api-tools")


def log_softmax_rows(local, ids: list[int]) -> torch.Tensor:
    """log_softmax of the float32 logits at every position of `ids`: [len(ids), vocab]."""
    model, _tokenizer = local
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def local_greedy(local, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor, tuple]:
    """transformers' greedy tokens, their log-probabilities (`compute_transition_scores` of the raw
    logits, normalized) and the raw logits of each step."""
    model, tokenizer = local
    output = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=tokenizer.eos_token_id,
    )
    scores = model.compute_transition_scores(output.sequences, output.logits, normalize_logits=True)[0]
    return output.sequences[0, len(prompt_ids) :].tolist(), scores, output.logits


def assert_top(got: dict, row: torch.Tensor, tokenizer, count: int) -> None:
    """The alternatives' log-probabilities are the `count` best of `row` (tokens whose text is unique)."""
    values, indices = row.topk(count)
    texts = [tokenizer.decode([token]) for token in indices.tolist()]
    for text, value in zip(texts, values.tolist(), strict=True):
        if texts.count(text) == 1:
            assert abs(got[text] - value) < 1e-4, (text, got)


@pytest.mark.compat
def test_echo_logprobs_of_prompts_and_token_batches_equal_local_transformers(api, local):
    """What lm-eval asks for: the prompt's own log-probabilities (echo, max_tokens 0), for a batch
    given as a string and a token-id list."""
    _model, tokenizer = local
    text = "The quick brown fox jumps over the lazy dog"
    ids, other = tokenizer(text).input_ids, tokenizer("Once upon a time").input_ids
    answer = client(api.url).completions.create(
        model=api.model, prompt=[text, other], max_tokens=0, echo=True, logprobs=3
    )
    assert [choice.index for choice in answer.choices] == [0, 1]
    assert [choice.text for choice in answer.choices] == [text, tokenizer.decode(other)]
    for choice, prompt_ids in zip(answer.choices, (ids, other), strict=True):
        rows, logprobs = log_softmax_rows(local, prompt_ids), choice.logprobs
        assert logprobs.tokens == [tokenizer.decode([token]) for token in prompt_ids]
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        for position in range(1, len(prompt_ids)):
            want = rows[position - 1, prompt_ids[position]].item()
            assert abs(logprobs.token_logprobs[position] - want) < 1e-4, position
            assert len(logprobs.top_logprobs[position]) <= 4  # 3 alternatives and the token itself
            assert_top(logprobs.top_logprobs[position], rows[position - 1], tokenizer, 3)
        offsets = [len(tokenizer.decode(prompt_ids[:position])) for position in range(len(prompt_ids))]
        assert logprobs.text_offset == offsets and choice.finish_reason == "length"
    assert answer.usage.prompt_tokens == len(ids) + len(other) and answer.usage.completion_tokens == 0


def test_generated_logprobs_are_the_models_own_whatever_the_sampling(api, local):
    """Generated tokens' log-probabilities are transformers' (normalized raw logits); temperature and
    top-p choose the token but leave the reported distribution alone, as OpenAI's do."""
    _model, tokenizer = local
    prompt = "Once upon a time"
    prompt_ids = tokenizer(prompt).input_ids
    tokens, scores, logits = local_greedy(local, prompt_ids, 6)
    ask = client(api.url).completions.create
    greedy = ask(model=api.model, prompt=prompt, max_tokens=6, temperature=0, logprobs=5, echo=True)
    logprobs = greedy.choices[0].logprobs
    generated = slice(len(prompt_ids), None)
    assert logprobs.tokens[generated] == [tokenizer.decode([token]) for token in tokens]
    for got, want in zip(logprobs.token_logprobs[generated], scores.tolist(), strict=True):
        assert abs(got - want) < 1e-4
    for got, step in zip(logprobs.top_logprobs[generated], logits, strict=True):
        assert_top(got, torch.log_softmax(step[0].float(), dim=-1), tokenizer, 5)
    assert logprobs.text_offset[len(prompt_ids)] == len(prompt)  # offsets count from the prompt's start
    sampled = ask(
        model=api.model, prompt=prompt, max_tokens=1, temperature=1.7, top_p=0.5, seed=5, logprobs=5
    )
    first = torch.log_softmax(logits[0][0].float(), dim=-1)
    assert_top(sampled.choices[0].logprobs.top_logprobs[0], first, tokenizer, 5)


def test_n_choices_stream_and_reproduce_with_a_seed(api):
    ask = client(api.url).completions.create
    settings = {"model": api.model, "prompt": "Hello", "max_tokens": 8, "temperature": 1.0, "seed": 21}
    three = ask(n=3, **settings)
    texts = [choice.text for choice in three.choices]
    assert [choice.index for choice in three.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert [choice.text for choice in ask(n=3, **settings).choices] == texts  # each reproducible
    assert ask(n=1, **settings).choices[0].text == texts[0]  # the first sample is the request's seed's
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    for chunk in ask(n=3, stream=True, echo=True, **settings):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[index] for index in range(3)] == ["Hello" + text for text in texts]
    assert three.usage.prompt_tokens == ask(**settings).usage.prompt_tokens  # the prompt counts once


def test_chat_logprobs_and_top_logprobs_equal_local_transformers(api, local):
    _model, tokenizer = local
    answer = client(api.url).chat.completions.create(
        model=api.model,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
        n=2,
    )
    prompt_ids = tokenizer("<|user|>\nTell me a story\n<|assistant|>\n").input_ids  # the simple template
    tokens, scores, logits = local_greedy(local, prompt_ids, 6)
    for choice in answer.choices:
        content = choice.logprobs.content
        assert [entry.token for entry in content] == [tokenizer.decode([token]) for token in tokens]
        for entry, want, step in zip(content, scores.tolist(), logits, strict=True):
            assert abs(entry.logprob - want) < 1e-4 and entry.bytes == list(entry.token.encode())
            values, indices = torch.log_softmax(step[0].float(), dim=-1).topk(4)
            assert [top.token for top in entry.top_logprobs] == [
                tokenizer.decode([i]) for i in indices.tolist()
            ]
            for top, value in zip(entry.top_logprobs, values.tolist(), strict=True):
                assert abs(top.logprob - value) < 1e-4
    assert answer.choices[0].message.content == answer.choices[1].message.content  # greedy: the same


def lm_eval_loglikelihood(local, context: str, continuation: str) -> tuple[float, bool]:
    """What lm-eval's HF model computes for one choice: the continuation's tokens (split from the
    context as lm-eval splits them) summed, and whether each was the argmax."""
    _model, tokenizer = local
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    start = len(tokenizer(context, add_special_tokens=False).input_ids)
    rows = log_softmax_rows(local, whole)
    total = sum(rows[position - 1, whole[position]].item() for position in range(start, len(whole)))
    greedy = all(
        rows[position - 1].argmax().item() == whole[position] for position in range(start, len(whole))
    )
    return total, greedy


def test_lm_eval_scores_a_local_multiple_choice_task_as_local_transformers_does(
    api, llama_dir, local, tmp_path, monkeypatch
):
    """lm-evaluation-harness's `local-completions` model against the API, on a task built here: each
    choice's log-likelihood is what transformers computes on the same checkpoint. One leg: under the
    other transformers major the API's log-probabilities are checked where lm-eval asks for them
    (`test_echo_logprobs_...`), without lm-eval's own import (17 s there)."""
    for name, value in {
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
        "OPENAI_API_KEY": KEY,  # what local-completions sends as its bearer token
    }.items():
        monkeypatch.setenv(name, value)
    import lm_eval  # imported here: it takes seconds
    from lm_eval.tasks import TaskManager

    docs = [
        {
            "question": "The quick brown fox jumps over the",
            "choices": ["lazy dog", "moon", "river bank"],
            "label": 0,
        },
        {"question": "One two three", "choices": ["four", "Paris", "nine ten"], "label": 0},
        {"question": "Once upon a time there was a little", "choices": ["model", "swarm"], "label": 0},
    ]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (tmp_path / "swarm_mc.yaml").write_text(
        "task: swarm_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
        "metric_list:\n  - metric: acc\n"
    )
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": api.model,
            "base_url": f"{api.url}/v1/completions",
            "tokenizer": str(llama_dir),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "batch_size": 3,  # prompts as a batch of token-id lists
            "max_retries": 1,
        },
        tasks=["swarm_mc"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    samples = results["samples"]["swarm_mc"]
    assert len(samples) == len(docs)
    correct = 0
    for sample in samples:
        scores = []
        for (context, continuation), response in zip(sample["arguments"], sample["resps"], strict=True):
            (got, got_greedy), (want, want_greedy) = (
                response[0],
                lm_eval_loglikelihood(local, context, continuation),
            )
            assert abs(got - want) < 1e-4 and got_greedy == want_greedy, (context, continuation, got, want)
            scores.append(want)
        correct += scores.index(max(scores)) == sample["doc"]["label"]
    assert results["results"]["swarm_mc"]["acc,none"] == pytest.approx(correct / len(docs))


@pytest.mark.compat
def test_langchain_chat_openai_gets_a_completion_and_a_tool_call(api, tools_api):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    def chat_model(url: str, model: str, **kwargs) -> ChatOpenAI:
        return ChatOpenAI(
            model=model, base_url=f"{url}/v1", api_key=KEY, max_retries=0, temperature=0, **kwargs
        )

    question = "What is the weather in Paris?"
    reply = chat_model(api.url, api.model, max_tokens=8, logprobs=True).invoke(question)
    expected = client(api.url).chat.completions.create(
        model=api.model, messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0
    )
    assert reply.content == expected.choices[0].message.content
    assert len(reply.response_metadata["logprobs"]["content"]) == expected.usage.completion_tokens
    agent = chat_model(tools_api, "tiny-tools", max_tokens=8).bind_tools([get_weather])
    call = agent.invoke(question)
    assert [(each["name"], each["args"]) for each in call.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert call.response_metadata["finish_reason"] == "tool_calls"
    streamed = functools.reduce(operator.add, agent.stream(question))
    assert [(each["name"], each["args"]) for each in streamed.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    # an agent's next turn sends the call and its result back: both render through the template
    result = ToolMessage(get_weather.invoke({"city": "Paris"}), tool_call_id=call.tool_calls[0]["id"])
    assert agent.invoke([HumanMessage(question), call, result]).tool_calls
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError, match="does not support tools"):
        client(api.url).chat.completions.create(
            model=api.model, messages=[{"role": "user", "content": question}], tools=tools, max_tokens=4
        )


def post(url: str, path: str, body: dict | str) -> tuple[int, dict]:
    data = (body if isinstance(body, str) else json.dumps(body)).encode()
    request = urllib.request.Request(f"{url}{path}", data=data, method="POST")
    request.add_header("Authorization", f"Bearer {KEY}")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_new_fields_are_bounded_and_validated_with_clear_400s(api):
    model = api.model
    function = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    completions = [
        ({"n": 10**6}, "n"),
        ({"n": 9}, "more than the 8 generations"),  # 9 choices > --max-concurrent 8
        ({"prompt": ["a", "b", "c", "d", "e"], "n": 2}, "10 choices"),
        ({"n": 5, "max_tokens": 1000}, "--max-request-tokens"),  # 5 x (1 + 1000) > 4096
        ({"n": 2.5}, "n"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": "3"}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"echo": "yes"}, "echo"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[]]}, "non-empty"),
        ({"prompt": [10**6]}, "outside the vocabulary"),
        ({"prompt": [[1, 2]] * 129}, "1..128 prompts"),
        ({"max_tokens": 0}, "without echo"),
    ]
    for fields, match in completions:
        status, body = post(
            api.url, "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2, **fields}
        )
        assert status == 400 and match in body["error"]["message"], (fields, body)
    status, body = post(
        api.url, "/v1/completions", f'{{"model": "{model}", "prompt": "Hi", "temperature": NaN}}'
    )
    assert status == 400 and body["error"]["param"] == "temperature"
    messages = [{"role": "user", "content": "Hi"}]
    chats = [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "needs logprobs"),
        ({"logprobs": 1}, "logprobs"),
        ({"tool_choice": "auto"}, "tool_choice needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
        (
            {"tools": [function], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "not in tools",
        ),
        ({"tools": [function] * 129}, "tools"),
        ({"max_tokens": 0}, "at least 1"),
        ({"n": 9}, "more than the 8 generations"),
    ]
    for fields, match in chats:
        status, body = post(api.url, "/v1/chat/completions", {"model": model, "messages": messages, **fields})
        assert status == 400 and match in body["error"]["message"], (fields, body)


def test_choices_count_against_the_concurrency_limits(api):
    """8 slots and 2 queue places: a request of 8 choices in flight leaves room for 2 more choices."""
    ask = client(api.url).completions.create
    stream = ask(model=api.model, prompt="Long", max_tokens=60, temperature=0, n=8, stream=True)
    next(iter(stream))  # admitted and running
    try:
        with pytest.raises(openai.RateLimitError):
            ask(model=api.model, prompt="Hi", max_tokens=2, n=3)
    finally:
        stream.close()


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
