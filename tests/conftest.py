"""Shared fixtures: tiny checkpoints built once per test session, offline."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hypothesis  # noqa: F401  (imported up front: its pytest plugin imports it lazily at exit, which can crash)
import pytest

from harness import preloaded_launcher
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

# Swarm processes start from one pre-imported interpreter (harness/zygote.py): real processes, without
# hundreds of seconds of CPU spent importing torch, transformers and hivemind in each on 2 cores.
# SWARM_TESTS_PRELOAD=0 starts each one as a fresh interpreter instead.
if os.environ.get("SWARM_TESTS_PRELOAD", "1") != "0":
    preloaded_launcher.enable()


@pytest.fixture(scope="session", autouse=True)
def _stop_the_zygote():
    yield
    preloaded_launcher.shutdown()


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


@pytest.fixture
def swarm(tmp_path):
    """A local swarm with its DHT peer started, for one test; everything it started is stopped after."""
    from harness.local_swarm import LocalSwarm  # imported here: it pulls in hivemind, which takes seconds

    swarm = LocalSwarm(tmp_path)
    swarm.start_dht()
    try:
        yield swarm
    finally:
        assert not swarm.close(), "process groups left running"


@pytest.fixture(scope="session", params=["bloom", "llama"])
def model_dir(request, bloom_dir, llama_dir) -> Path:
    return bloom_dir if request.param == "bloom" else llama_dir


@pytest.fixture(scope="session")
def local_reference():
    """`local_reference(model_dir)`: local transformers' model (in eval mode) and tokenizer of a
    checkpoint, loaded once per test session: what distributed runs must equal. Tests only read it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded: dict[str, tuple] = {}

    def load(model_dir: Path | str) -> tuple:
        key = str(model_dir)
        if key not in loaded:
            model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
            loaded[key] = model, AutoTokenizer.from_pretrained(model_dir)
        return loaded[key]

    return load


# --- the `swarm` marker: tests that start processes ---------------------------------------------------
# A test that starts anything (a local swarm, a subprocess, a browser) carries `pytest.mark.swarm`, on
# itself or its module, so `scripts/test.sh -m "not swarm"` runs the pure tests alone, in seconds. A
# test that uses the `swarm` fixture without it is a mistake, caught here.


def pytest_collection_modifyitems(items) -> None:
    unmarked = [
        item.nodeid
        for item in items
        if "swarm" in getattr(item, "fixturenames", ()) and item.get_closest_marker("swarm") is None
    ]
    if unmarked:
        raise pytest.UsageError(f"tests that start a swarm must be marked `swarm`: {', '.join(unmarked)}")


def pytest_sessionfinish(session) -> None:
    """The project's folders are imported only as `llm_swarm.*`: a module loaded under its folder's
    own name would be a second copy of it (other classes, other state)."""
    stray = sorted(
        name for name in sys.modules if name.split(".")[0] in ("swarm", "client", "server", "scheduler")
    )
    if stray:
        raise pytest.UsageError(
            f"modules imported by their folder's name instead of llm_swarm.*: {stray[:5]}"
        )
