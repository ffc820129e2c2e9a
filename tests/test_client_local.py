"""`generate()` through the client model over in-process spans equals transformers' own generate()."""

from __future__ import annotations

import contextlib
import io
import subprocess

import pytest
import torch
from transformers import AutoTokenizer

from llm_swarm.client.backend import LocalSpans
from llm_swarm.client.cli import main as generate_main
from llm_swarm.client.model import DistributedModelForCausalLM
from llm_swarm.client.session_cache import SessionCache
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.models import load_span
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model


@pytest.fixture(scope="module")
def models(model_dir, local_reference):
    reference = local_reference(model_dir)[0]
    backend = LocalSpans([load_span(model_dir, 0, 2)[0], load_span(model_dir, 2, 6)[0]])
    return reference, DistributedModelForCausalLM.from_local_parts(model_dir, backend)


def test_greedy_batch_with_left_padding(model_dir, models):
    reference, distributed = models
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = tokenizer(
        ["Hello there, little model", "one two", "Paris London Tokyo Lima"],
        return_tensors="pt",
        padding=True,
        padding_side="left",
    )
    expected = reference.generate(**batch, max_new_tokens=16, do_sample=False)
    assert torch.equal(distributed.generate(**batch, max_new_tokens=16, do_sample=False), expected)


def test_session_reused_across_generate_calls(model_dir, models):
    reference, distributed = models
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    with distributed.inference_session(max_length=64) as session:
        first = distributed.generate(prompt, max_new_tokens=6, do_sample=False, session=session)
        follow_up = torch.cat([first, tokenizer(" one two", return_tensors="pt").input_ids], dim=1)
        second = distributed.generate(follow_up, max_new_tokens=6, do_sample=False, session=session)
        assert session.position == second.shape[1] - 1  # the last sampled token is never fed back
        # ids that do not start with the last output are new tokens appended to it (PETALS' chat turn)
        turn = distributed.generate(prompt, max_new_tokens=2, session=session)
    assert torch.equal(second, reference.generate(follow_up, max_new_tokens=6, do_sample=False))
    whole = reference.generate(torch.cat([second, prompt], dim=1), max_new_tokens=2, do_sample=False)
    assert torch.equal(turn, whole[:, second.shape[1] :])


def test_generate_with_no_length_arguments_stops_where_transformers_does(model_dir, models):
    """No max_length, no max_new_tokens, no do_sample: the swarm model runs to the length local
    transformers runs to (transformers 5 leaves unset generation fields None until generate() fills
    them with its defaults; 4.57 starts them at the defaults), alone, in a padded batch, and in a
    batch that speculates by prompt lookup."""
    reference, distributed = models
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    expected = reference.generate(prompt)
    assert expected.shape[1] > prompt.shape[1]
    assert torch.equal(distributed.generate(prompt), expected)
    texts = ["one two three", "A cat sat on a mat"]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    expected = reference.generate(**batch)
    assert torch.equal(distributed.generate(**batch), expected)
    assert torch.equal(distributed.generate(**batch, prompt_lookup_num_tokens=2), expected)


def make_generate_calls(model, inputs, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """PETALS' own pattern (its tests/test_full_model.py): three calls in one session, the session
    given explicitly and implicitly, their outputs concatenated. (Our sessions take their batch size
    when opened; PETALS' learn it from the first step.)"""
    length = inputs.shape[1] + max_new_tokens
    with model.inference_session(max_length=length, batch_size=inputs.shape[0]) as session:
        return torch.cat(
            [
                model.generate(inputs, max_new_tokens=1, **kwargs, session=session),
                model.generate(None, max_new_tokens=max_new_tokens - 2, **kwargs),
                model.generate(None, max_new_tokens=1, **kwargs, session=session),
            ],
            dim=1,
        )


@pytest.mark.parametrize("batch", ["single", "padded"])
@pytest.mark.parametrize("sampling", [False, True])
def test_petals_generate_calls_in_one_session_equal_one_local_generation(model_dir, models, batch, sampling):
    """After the first call, PETALS' generate(None) returns only the new tokens, so its
    three-call pattern concatenates to what one local transformers call generates (greedy, and
    seeded sampling: the calls draw from the same generator in the same order)."""
    reference, distributed = models
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = ["A cat sat on a mat"] if batch == "single" else ["A cat sat on a mat", "one two"]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left").input_ids
    options = {"do_sample": True, "temperature": 0.8, "top_k": 20} if sampling else {"do_sample": False}
    options["pad_token_id"] = tokenizer.pad_token_id
    torch.manual_seed(7)
    expected = reference.generate(inputs, max_new_tokens=6, **options)
    torch.manual_seed(7)
    assert torch.equal(make_generate_calls(distributed, inputs, 6, **options), expected)


def test_generate_none_continues_the_active_session(models):
    """PETALS' form: inside `with model.inference_session(...)`, generate(None) goes on where the last
    generate() stopped and returns only the new tokens; ids passed later are appended (a chat turn);
    our transformers-style continuation (the whole sequence again) returns the whole sequence."""
    reference, distributed = models
    prompt = torch.tensor([[5, 17, 99, 200]])
    with distributed.inference_session(max_length=40):
        first = distributed.generate(prompt, max_new_tokens=5, do_sample=False)
        second = distributed.generate(None, max_new_tokens=5, do_sample=False)
        third = distributed.generate(None, max_new_tokens=3, do_sample=False)
        so_far = torch.cat([first, second, third], dim=1)
        turn = distributed.generate(torch.tensor([[7, 8]]), max_new_tokens=2, do_sample=False)
        whole = distributed.generate(torch.cat([so_far, turn], dim=1), max_new_tokens=2, do_sample=False)
    assert torch.equal(first, reference.generate(prompt, max_new_tokens=5, do_sample=False))
    assert (second.shape[1], third.shape[1]) == (5, 3)
    assert torch.equal(so_far, reference.generate(prompt, max_new_tokens=13, do_sample=False))
    appended = torch.cat([so_far, torch.tensor([[7, 8]])], dim=1)
    assert torch.equal(
        turn, reference.generate(appended, max_new_tokens=2, do_sample=False)[:, so_far.shape[1] :]
    )
    assert torch.equal(
        whole, reference.generate(torch.cat([so_far, turn], 1), max_new_tokens=2, do_sample=False)
    )
    with pytest.raises(ValueError, match="generate\\(None\\) continues"):
        distributed.generate(None, max_new_tokens=2)


def test_inputs_embeds_equal_input_ids(models):
    reference, distributed = models
    prompt = torch.tensor([[5, 17, 99, 200, 7]])
    embeds = distributed.get_input_embeddings()(prompt)
    assert torch.equal(embeds, reference.get_input_embeddings()(prompt))
    by_ids, by_embeds = distributed(input_ids=prompt).logits, distributed(inputs_embeds=embeds).logits
    assert torch.allclose(by_ids, by_embeds, atol=1e-5)
    assert torch.allclose(by_embeds, reference(input_ids=prompt).logits, atol=1e-4)
    expected = reference.generate(inputs_embeds=embeds, max_new_tokens=8, do_sample=False)
    assert torch.equal(
        distributed.generate(inputs_embeds=embeds, max_new_tokens=8, do_sample=False), expected
    )
    assert torch.equal(expected, reference.generate(prompt, max_new_tokens=8, do_sample=False)[:, 5:])


def test_sampling_matches_under_the_same_seed(models):
    reference, distributed = models
    prompt = torch.tensor([[5, 17, 99, 200]])
    torch.manual_seed(7)
    expected = reference.generate(prompt, max_new_tokens=8, do_sample=True, temperature=0.8, top_p=0.9)
    torch.manual_seed(7)
    got = distributed.generate(prompt, max_new_tokens=8, do_sample=True, temperature=0.8, top_p=0.9)
    assert torch.equal(got, expected)


def run_generate_command(llama_dir, prompt: str, *extra: str) -> subprocess.CompletedProcess:
    """`swarm-generate` on the tiny LLaMA's two local spans, run in this process (its `main`, the
    console script's entry point): its exit status and what it printed."""
    argv = [str(llama_dir), "--local-spans", "0:3,3:6", "--prompt", prompt, *extra]
    stdout, stderr = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            generate_main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(argv, code, stdout.getvalue(), stderr.getvalue())


def test_generate_command_runs_locally(llama_dir):
    result = run_generate_command(llama_dir, "Once upon", "--max-new-tokens", "5")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Once upon")


def test_beam_search_equals_transformers(models):
    reference, distributed = models
    prompt = torch.tensor([[5, 17, 99, 200, 7]])
    expected = reference.generate(prompt, max_new_tokens=10, num_beams=5, do_sample=False)
    assert torch.equal(
        distributed.generate(prompt, max_new_tokens=10, num_beams=5, do_sample=False), expected
    )


def test_generate_command_speculates_and_prints_the_same_text(llama_dir, tmp_path):
    """`swarm-generate --assistant DIR` and `--prompt-lookup N` print the text plain decoding prints,
    then a one-line summary of the drafts on stderr; a draft model of another vocabulary is refused."""

    def run(*extra: str) -> subprocess.CompletedProcess:
        return run_generate_command(llama_dir, "a b c a b c a b", "--max-new-tokens", "16", *extra)

    def text(result: subprocess.CompletedProcess) -> str:
        """The streamed text, without the report after it (chain, speed: the timings differ)."""
        return result.stdout.rsplit("\nchain: ", 1)[0]

    plain = run()
    assert plain.returncode == 0, plain.stderr
    for flags in (["--assistant", str(llama_dir)], ["--prompt-lookup", "4"]):
        speculative = run(*flags)
        assert speculative.returncode == 0, speculative.stderr
        assert text(speculative) == text(plain) != plain.stdout, flags
        assert "speculation:" in speculative.stderr, flags
    other = build_tiny_model(tmp_path / "other", TinyModelSpec(family="llama", num_layers=1, vocab_size=300))
    refused = run_generate_command(llama_dir, "hi", "--assistant", str(other))
    assert refused.returncode != 0
    assert "a draft model must use the same tokenizer" in refused.stderr


def test_the_session_as_generates_cache_crops_by_rewinding(models):
    """`SessionCache.crop` (what assisted generation calls after rejected drafts) rewinds the session,
    and the next step overwrites the rejected positions: logits as if they had never been sent."""
    _, distributed = models
    tokens = torch.tensor([[5, 17, 99, 200, 33, 41, 7]])
    with (
        distributed.inference_session(max_length=16) as rewound,
        distributed.inference_session(max_length=16) as straight,
    ):
        cache = SessionCache(rewound)
        with distributed._use_session(rewound):
            distributed(input_ids=tokens)
            assert cache.get_seq_length() == 7
            cache.crop(-3)  # as DynamicCache.crop: a negative length drops that many
            assert cache.get_seq_length() == 4 and rewound.position == 4
            got = distributed(input_ids=torch.cat([tokens[:, :4], torch.tensor([[9, 9]])], 1)).logits
        with distributed._use_session(straight):
            want = distributed(input_ids=torch.cat([tokens[:, :4], torch.tensor([[9, 9]])], 1)).logits
        with pytest.raises(SwarmUserError, match="cannot rewind"):
            rewound.rewind(7)
    assert torch.allclose(got, want[:, -2:], atol=1e-5, rtol=0)


class _RecordingSpans(LocalSpans):
    """In-process spans that remember what each session was opened for (what routing is told)."""

    def __init__(self, spans):
        super().__init__(spans)
        self.opened: list[tuple[int, int, int | None, int | None]] = []

    def open_session(self, batch_size, max_length, prompt_tokens=None, expected_new_tokens=None):
        self.opened.append((batch_size, max_length, prompt_tokens, expected_new_tokens))
        return super().open_session(batch_size, max_length, prompt_tokens, expected_new_tokens)


def test_generate_tells_routing_the_real_prompt_and_answer_lengths(model_dir):
    """A one-off generate() opens its session with the prompt's real length; routing then
    counts the rest of max_length (max_new_tokens) as generated tokens."""
    from llm_swarm.client.remote import session_shape

    backend = _RecordingSpans([load_span(model_dir, 0, 6)[0]])
    model = DistributedModelForCausalLM.from_local_parts(model_dir, backend)
    model.generate(torch.tensor([[5, 17, 99, 200, 33, 41, 7]]), max_new_tokens=9, do_sample=False)
    model.generate(torch.tensor([[5, 17], [99, 200]]), max_new_tokens=3, num_beams=2, do_sample=False)
    model.generate(torch.tensor([[5, 17, 99]]), max_new_tokens=4, prompt_lookup_num_tokens=2)
    model.generate(torch.tensor([[5, 17], [99, 200]]), max_new_tokens=4, prompt_lookup_num_tokens=2)
    # batched speculation reserves room for masked drafts: that room is not counted as output
    assert backend.opened == [(1, 16, 7, 9), (4, 5, 2, 3), (1, 7, 3, 4), (2, 10, 2, 4)]
    shape = session_shape(1, 16, 7, default_prompt_tokens=20)
    assert (shape.l_in, shape.l_out) == (7, 9)
    # an explicit session without a prompt length: the default guess, capped by max_length
    assert (session_shape(1, 64, None, 20).l_in, session_shape(1, 64, None, 20).l_out) == (20, 44)
    assert (session_shape(1, 8, None, 20).l_in, session_shape(1, 8, None, 20).l_out) == (8, 1)
    assert session_shape(1, 64, 10, 20, expected_new_tokens=5).l_out == 5  # the caller's own estimate
    with pytest.raises(ValueError, match="prompt_tokens must be in 1..max_length"):
        model.open_session(max_length=8, prompt_tokens=9)
    with pytest.raises(ValueError, match="expected_new_tokens must be in 1..max_length"):
        model.open_session(max_length=8, expected_new_tokens=0)
