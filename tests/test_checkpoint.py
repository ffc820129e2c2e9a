"""Span loading reads only what it needs, and bad checkpoints get one clear line, not a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors
from transformers import GPT2Config

from llm_swarm.client import cli as client_cli
from llm_swarm.swarm.errors import CheckpointError, SpanError, UnsupportedModelError
from llm_swarm.swarm.models import checkpoint as checkpoint_module
from llm_swarm.swarm.models import load_client_parts, load_span


def shards_holding(model_dir: Path, prefix: str) -> set[str]:
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    return {file for name, file in weight_map.items() if name.startswith(prefix)}


def test_loading_a_span_opens_only_its_shards(bloom_dir, monkeypatch):
    opened: list[str] = []
    real_safe_open = safetensors.safe_open

    def recording_safe_open(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real_safe_open(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "safe_open", recording_safe_open)
    span, files = load_span(bloom_dir, 2, 4)
    expected = shards_holding(bloom_dir, "transformer.h.2.") | shards_holding(bloom_dir, "transformer.h.3.")
    all_shards = set(
        json.loads((bloom_dir / "model.safetensors.index.json").read_text())["weight_map"].values()
    )
    assert set(opened) == expected == set(files)
    assert len(expected) < len(all_shards)
    assert span.num_blocks == 2


def test_client_parts_skip_every_block_shard(llama_dir, monkeypatch):
    opened: list[str] = []
    real_safe_open = safetensors.safe_open
    monkeypatch.setattr(
        checkpoint_module,
        "safe_open",
        lambda path, *a, **k: opened.append(Path(path).name) or real_safe_open(path, *a, **k),
    )
    load_client_parts(llama_dir)
    block_only = (
        shards_holding(llama_dir, "model.layers.")
        - shards_holding(llama_dir, "model.embed_tokens")
        - shards_holding(llama_dir, "model.norm")
        - shards_holding(llama_dir, "lm_head")
    )
    assert block_only and not block_only & set(opened)


def test_unsharded_checkpoint_loads(single_file_dir):
    span, files = load_span(single_file_dir, 1, 3)
    assert files == ["model.safetensors"] and span.num_blocks == 2


@pytest.fixture
def broken_copy(tmp_path, bloom_dir):
    copy = tmp_path / "model"
    shutil.copytree(bloom_dir, copy)
    return copy


def test_bad_checkpoints_raise_clear_errors(tmp_path, broken_copy, bloom_dir):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_span(tmp_path / "nowhere", 0, 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_span(tmp_path / "empty", 0, 1)

    (broken_copy / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_span(broken_copy, 0, 1)
    shutil.copy(bloom_dir / "config.json", broken_copy / "config.json")

    shard = sorted(shards_holding(bloom_dir, "transformer.h.1."))[0]
    (broken_copy / shard).write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="corrupt"):
        load_span(broken_copy, 1, 2)
    (broken_copy / shard).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_span(broken_copy, 1, 2)
    load_span(broken_copy, 4, 6)  # blocks whose shards are intact still load

    (broken_copy / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(CheckpointError, match="index.json is corrupt"):
        load_span(broken_copy, 0, 1)


def test_out_of_range_spans_and_unknown_architectures(tmp_path, bloom_dir):
    for start, end in [(0, 7), (-1, 2), (3, 3), (5, 2)]:
        with pytest.raises(SpanError, match="not inside the model's 6 blocks"):
            load_span(bloom_dir, start, end)
    GPT2Config(n_layer=2).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        load_span(tmp_path / "gpt2", 0, 1)


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "does not exist"),
        ("span", "not inside the model's 6 blocks"),
        ("arch", "is not supported"),
    ],
)
def test_command_line_prints_one_line_for_user_errors(tmp_path, bloom_dir, case, expected, capsys):
    model_dir, spans = str(bloom_dir), "0:3,3:6"
    if case == "missing":
        model_dir = str(tmp_path / "missing")
    elif case == "span":
        spans = "0:3,3:9"
    else:
        GPT2Config(n_layer=2).save_pretrained(tmp_path / "gpt2")
        model_dir = str(tmp_path / "gpt2")
    # in this process (a command's own interpreter start is exercised by every test that starts one)
    with pytest.raises(SystemExit) as exit_info:
        client_cli.main([model_dir, "--local-spans", spans, "--prompt", "hi"])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], stderr
