"""The API's pieces without a swarm: tool-call parsing and streaming, admission by choices, the
log-probability recorder, per-choice seeds and request validation."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from pydantic import ValidationError

from llm_swarm.client.api.chat_schema import ChatRequest
from llm_swarm.client.api.errors import ApiError
from llm_swarm.client.api.generation_slots import GenerationSlots
from llm_swarm.client.api.logprobs import LogprobRecorder
from llm_swarm.client.api.planning import choice_seed
from llm_swarm.client.api.prompting import SIMPLE_TEMPLATE, template_renders_tools
from llm_swarm.client.api.schema import CompletionRequest
from llm_swarm.client.api.tools import ToolCallStream, ToolFormat, parse
from tests.tool_model import HERMES_TEMPLATE

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris"}}


def calls(text: str) -> list[tuple[str, dict]]:
    return [
        (call["function"]["name"], json.loads(call["function"]["arguments"])) for call in parse(text).calls
    ]


def test_tool_calls_parse_in_hermes_llama_and_mistral_formats():
    hermes = (
        f"Let me look.\n<tool_call>\n{json.dumps(WEATHER)}\n</tool_call>\n<tool_call>{json.dumps(WEATHER)}"
    )
    assert calls(hermes) == [("get_weather", {"city": "Paris"})] * 2  # the last one unterminated
    assert parse(hermes).content == "Let me look."
    llama = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert calls(llama) == [("get_weather", {"city": "Paris"})] and parse(llama).content is None
    mistral = f"[TOOL_CALLS][{json.dumps(WEATHER)}, {json.dumps({'name': 'now', 'arguments': {}})}]"
    assert calls(mistral) == [("get_weather", {"city": "Paris"}), ("now", {})]
    for text in ("<tool_call>{not json}</tool_call>", '{"city": "Paris"}', "[1, 2]", "It is sunny."):
        parsed = parse(text)
        assert parsed.calls == [] and parsed.content == text  # not a call: the answer's text
    assert parse(hermes).calls[0]["id"].startswith("call_") and parse(hermes).calls[0]["type"] == "function"


def test_streamed_text_is_held_back_only_while_it_may_be_a_call():
    hermes = ToolCallStream(ToolFormat("hermes"))
    text = f"Sure.<tool_call>{json.dumps(WEATHER)}</tool_call>"
    shown = "".join(hermes.feed(character) for character in text)
    assert shown == "Sure."  # never a piece of "<tool_call>"
    content, found = hermes.finish()
    assert content == "" and [call["function"]["name"] for call in found] == ["get_weather"]
    plain = ToolCallStream(ToolFormat("hermes"))
    assert "".join(plain.feed(character) for character in "a <tool b") == "a <tool b"
    assert plain.finish() == ("", [])
    llama = ToolCallStream(ToolFormat("llama"))
    assert llama.feed("  {") == "" and llama.feed('"name": "f"}') == ""
    content, found = llama.finish()
    assert content == "" and [call["function"]["name"] for call in found] == ["f"]
    prose = ToolCallStream(ToolFormat("llama"))
    assert prose.feed("It is") == "It is" and prose.finish() == ("", [])
    broken = ToolCallStream(ToolFormat("llama"))
    assert broken.feed("{oops") == "" and broken.finish() == ("{oops", [])  # unparseable: text at the end


def test_tool_formats_follow_the_template_and_force_calls():
    assert template_renders_tools(HERMES_TEMPLATE) and not template_renders_tools(SIMPLE_TEMPLATE)
    assert ToolFormat.of_template(HERMES_TEMPLATE).name == "hermes"
    assert ToolFormat.of_template("{{ tools }}[TOOL_CALLS]").name == "mistral"
    assert ToolFormat.of_template("{{ tools }}").name == "llama"
    opening = ToolFormat("hermes").opening("get_weather")
    assert calls(opening + '{"city": "Paris"}}</tool_call>') == [("get_weather", {"city": "Paris"})]
    assert calls(ToolFormat("llama").opening("f") + "{}}") == [("f", {})]
    assert calls(ToolFormat("mistral").opening("f") + "{}}]") == [("f", {})]


def test_admission_counts_choices_and_serves_in_turn():
    async def scenario() -> list[str]:
        admission, order = GenerationSlots(max_concurrent=4, max_queued=4), []
        admission.enter(3)
        with pytest.raises(ApiError) as refused:
            admission.enter(6)  # 3 + 6 > 4 + 4
        assert refused.value.status == 429
        release = asyncio.Event()

        async def request(name: str, weight: int, hold: bool = False) -> None:
            async with admission.slots(weight):
                order.append(name)
                if hold:
                    await release.wait()

        first = asyncio.create_task(request("three", 3, hold=True))
        await asyncio.sleep(0)
        wide = asyncio.create_task(request("wide", 4))  # waits for all 4 slots
        await asyncio.sleep(0)
        narrow = asyncio.create_task(request("narrow", 1))  # would fit now, but comes after "wide"
        gone = asyncio.create_task(request("gone", 2))
        await asyncio.sleep(0.01)
        gone.cancel()  # a client that leaves while waiting gives up its place
        await asyncio.sleep(0.01)
        assert order == ["three"]
        release.set()
        await asyncio.gather(first, wide, narrow, return_exceptions=True)
        assert admission.running == 0 and not admission._waiters
        return order

    assert asyncio.run(scenario()) == ["three", "wide", "narrow"]


def test_the_recorder_resolves_prompt_decode_and_draft_positions():
    torch.manual_seed(0)
    prompt = [5, 7, 1, 3]
    recorder = LogprobRecorder(prompt, top=2, echo=True)
    prefill = torch.randn(1, 4, 10) * 3
    recorder.observe(torch.tensor([prompt]), prefill)  # rows predict positions 1..4
    expected = torch.log_softmax(prefill[0], dim=-1)
    assert recorder.prompt[0] is None
    for position in range(1, 4):
        entry = recorder.prompt[position]
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(expected[position - 1, prompt[position]].item(), abs=1e-6)
        values, indices = expected[position - 1].topk(2)
        assert [token for token, _value in entry.top] == indices.tolist()
    first = recorder.resolve(4, 9)
    assert first.logprob == pytest.approx(expected[3, 9].item(), abs=1e-6)
    # a verification of two drafts [2, 6]: rows for positions 5, 6, 7; the second draft is rejected
    verify = torch.randn(1, 3, 10)
    recorder.observe(torch.tensor([prompt + [9, 2, 6]]), verify)
    assert recorder.resolve(5, 2).logprob == pytest.approx(
        torch.log_softmax(verify[0, 0], -1)[2].item(), abs=1e-6
    )
    corrected = recorder.resolve(6, 8)  # the token chosen instead of draft 6, from the same row
    assert corrected.logprob == pytest.approx(torch.log_softmax(verify[0, 1], -1)[8].item(), abs=1e-6)
    with pytest.raises(RuntimeError):
        recorder.resolve(6, 8)  # each position once


def test_choice_seeds_keep_the_first_and_differ_after():
    assert choice_seed(None, 3) is None and choice_seed(42, 0) == 42
    seeds = {choice_seed(42, sample) for sample in range(1, 50)}
    assert len(seeds) == 49 and 42 not in seeds and all(0 <= seed < 2**63 for seed in seeds)


def test_requests_normalize_prompts_and_refuse_inconsistent_fields():
    def prompts(value) -> list:
        return CompletionRequest(model="m", prompt=value).prompts

    assert prompts("hi") == ["hi"] and prompts([1, 2]) == [[1, 2]] and prompts([[1], "a"]) == [[1], "a"]
    for bad in ([True, 2], [1.0], {"a": 1}, None, [[1], [2, "x"]]):
        with pytest.raises(ValidationError):
            prompts(bad)
    messages = [
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}
    ]
    assert ChatRequest(model="m", messages=messages).messages[0].for_template()["tool_calls"][0][
        "function"
    ] == {
        "name": "f",
        "arguments": {},
    }
    for bad in (
        [{"role": "tool", "content": "x"}],  # answers no call
        [{"role": "user", "tool_calls": messages[0]["tool_calls"], "content": "x"}],
        [{"role": "user"}],
    ):
        with pytest.raises(ValidationError):
            ChatRequest(model="m", messages=bad)
