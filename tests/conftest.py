"""Shared fixtures: tiny checkpoints built once per test session, offline."""

from __future__ import annotations

from pathlib import Path

import hypothesis  # noqa: F401  (imported up front: its pytest plugin imports it lazily at exit, which can crash)
import pytest

from swarm.models.tiny import TinyModelSpec, build_tiny_model

NUM_BLOCKS = 6


@pytest.fixture(scope="session")
def bloom_dir(tmp_path_factory) -> Path:
    """A sharded BLOOM checkpoint (several safetensors files plus an index)."""
    path = tmp_path_factory.mktemp("tiny-bloom")
    return build_tiny_model(path, TinyModelSpec(family="bloom", num_layers=NUM_BLOCKS), max_shard_size="60KB")


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    """A sharded LLaMA checkpoint with grouped-query attention (4 query heads share 2 KV heads)."""
    path = tmp_path_factory.mktemp("tiny-llama-gqa")
    spec = TinyModelSpec(family="llama", num_layers=NUM_BLOCKS, num_kv_heads=2)
    return build_tiny_model(path, spec, max_shard_size="60KB")


@pytest.fixture(scope="session")
def single_file_dir(tmp_path_factory) -> Path:
    """An unsharded LLaMA checkpoint: one model.safetensors, no index."""
    path = tmp_path_factory.mktemp("tiny-llama-single")
    return build_tiny_model(path, TinyModelSpec(family="llama", num_layers=3))


@pytest.fixture(scope="session", params=["bloom", "llama"])
def model_dir(request, bloom_dir, llama_dir) -> Path:
    return bloom_dir if request.param == "bloom" else llama_dir
