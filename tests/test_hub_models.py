"""Models named on the Hub: servers and clients take `ORG/NAME` and fetch only what they hold.

A local HTTP server speaks the Hub's file protocol (tests/fake_hub.py) and the real `huggingface_hub`
client is driven at it through `HF_ENDPOINT`, in real processes: servers started with a model id
each fetch the shards of their span only, a `swarm-generate` client fetches the shards of its
embeddings, norm and head only and generates what local transformers generates, and two commits of
a model are two swarms (the commit is part of the swarm's name). Errors say what to do: a gated
model without its token, an unknown id or revision, `.bin`-only weights, nothing cached while
offline, a disk too full for a shard; a download cut half way is fetched again, and so is a
corrupted shard in the cache.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness import preloaded_launcher
from harness.local_swarm import CHILD_ENV, PYTHON
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.models.hub import resolve_model
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model
from tests.fake_hub import FakeHub, FakeRepo

REPO = "swarm-tests/tiny-llama"
GATED = "swarm-tests/gated-llama"
PICKLED = "swarm-tests/pickled-llama"
TOKEN = "hf_test_token_of_the_gated_model"
LAYERS = 4
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """The fake Hub, serving a sharded tiny LLaMA at `main` and another commit at tag `v2`, a gated
    copy, and one with only pickled weights; also the local checkpoint and the main commit."""
    root = tmp_path_factory.mktemp("hub")
    spec = TinyModelSpec(family="llama", num_layers=LAYERS, num_kv_heads=2)
    model_dir = build_tiny_model(root / "tiny-llama", spec, max_shard_size="40KB")
    other_dir = build_tiny_model(
        root / "tiny-llama-v2", TinyModelSpec(**{**spec.__dict__, "seed": 1}), "40KB"
    )
    with FakeHub() as hub:
        repo = FakeRepo()
        commit = repo.publish(model_dir)
        repo.publish(other_dir, ref="v2")
        hub.repos[REPO] = repo
        hub.repos[GATED] = FakeRepo(token=TOKEN)
        hub.repos[GATED].publish(model_dir)
        pickled = root / "pickled"
        pickled.mkdir()
        (pickled / "config.json").write_bytes((model_dir / "config.json").read_bytes())
        (pickled / "pytorch_model.bin").write_bytes(b"\0" * 1024)
        hub.repos[PICKLED] = FakeRepo()
        hub.repos[PICKLED].publish(pickled)
        yield hub, model_dir, commit


def shard_files(model_dir: Path, prefix: str) -> set[str]:
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    return {file for name, file in weight_map.items() if name.startswith(prefix)}


def hub_env(hub: FakeHub, cache: Path, **extra: str) -> dict[str, str]:
    return {**CHILD_ENV, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache), "HF_TOKEN": "", **extra}


def snapshot_files(cache: Path, repo: str) -> set[str]:
    snapshots = cache / f"models--{repo.replace('/', '--')}" / "snapshots"
    return {path.name for path in snapshots.glob("*/*")}


@pytest.mark.swarm
def test_servers_and_a_client_named_by_hub_id_fetch_only_what_they_hold(
    swarm, published, tmp_path, monkeypatch
):
    hub, model_dir, commit = published
    preloaded_launcher.disable()  # the zygote's huggingface_hub read its settings before these
    try:
        for name, blocks in (("first", "0:2"), ("second", "2:4")):
            for key, value in hub_env(hub, tmp_path / name).items():
                monkeypatch.setitem(CHILD_ENV, key, value)
            swarm.start_server(name, REPO, blocks)
    finally:
        preloaded_launcher.enable()
    prefix = f"tiny-llama.{commit[:12]}"  # the model's name and its commit
    swarm.wait_online(prefix, LAYERS, ["first", "second"])
    block_shards = [shard_files(model_dir, f"model.layers.{block}.") for block in range(LAYERS)]
    client_shards = shard_files(model_dir, "model.embed_tokens.") | shard_files(model_dir, "model.norm.")
    client_shards |= shard_files(model_dir, "lm_head.")
    for name, blocks in (("first", range(0, 2)), ("second", range(2, 4))):
        fetched = {file for file in snapshot_files(tmp_path / name, REPO) if file.endswith(".safetensors")}
        assert fetched == set().union(*(block_shards[block] for block in blocks)), name

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    expected = (
        AutoModelForCausalLM.from_pretrained(model_dir)
        .eval()
        .generate(prompt, max_new_tokens=12, do_sample=False)
    )
    command = [
        PYTHON,
        "-m",
        "llm_swarm.client.cli",
        REPO,
        "--initial-peers",
        *swarm.initial_peers,
        "--prompt",
        PROMPT,
    ]
    command += ["--max-new-tokens", "12"]
    client_cache = tmp_path / "client"
    done = subprocess.run(
        command, env=hub_env(hub, client_cache), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert tokenizer.decode(expected[0]) in done.stdout
    fetched = {file for file in snapshot_files(client_cache, REPO) if file.endswith(".safetensors")}
    assert fetched == client_shards and not fetched & (set().union(*block_shards) - client_shards)
    assert {"tokenizer.json", "config.json", "generation_config.json"} <= snapshot_files(client_cache, REPO)


CASES = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from llm_swarm.swarm.models import load_span
    from llm_swarm.swarm.models.hub import resolve_model

    def outcome(call):
        try:
            result = call()
            return "ok" if result is not None else "none"
        except Exception as error:
            return f"{type(error).__name__}: {error}"

    repo, gated, pickled, token = sys.argv[1:5]
    results = {
        "gated without a token": outcome(lambda: resolve_model(gated)),
        "gated with its token": outcome(lambda: load_span(resolve_model(gated, token=token), 0, 1)),
        "unknown id": outcome(lambda: resolve_model("swarm-tests/no-such-model")),
        "unknown revision": outcome(lambda: resolve_model(repo, revision="no-such-branch")),
        "pickled weights": outcome(lambda: load_span(resolve_model(pickled), 0, 1)),
        "interrupted download": outcome(lambda: load_span(resolve_model(repo), 0, 1)),
    }
    snapshot = resolve_model(repo)
    from llm_swarm.swarm.dht_keys import default_prefix
    results["swarm names"] = [default_prefix(str(snapshot)), default_prefix(str(resolve_model(repo, "v2")))]
    weight_map = json.loads((snapshot / "model.safetensors.index.json").read_text())["weight_map"]
    shard = weight_map["model.layers.0.input_layernorm.weight"]
    blob = (snapshot / shard).resolve()
    blob.write_bytes(b"\\xff" * blob.stat().st_size)  # corrupted in the cache, same size
    results["corrupted shard"] = outcome(lambda: load_span(snapshot, 0, 1))
    import shutil
    from collections import namedtuple
    full = namedtuple("usage", "total used free")(10**12, 10**12 - 1, 1)
    shutil.disk_usage = lambda path: full  # a disk with one byte free
    fresh = resolve_model(repo, "v2")
    results["full disk"] = outcome(lambda: load_span(fresh, 3, 4))
    print(json.dumps(results))
    """
)


@pytest.mark.swarm
@pytest.mark.compat  # huggingface_hub 0.36 beside transformers 4.57, 1.x beside 5
def test_hub_errors_say_what_to_do_and_downloads_recover(published, tmp_path):
    hub, model_dir, _commit = published
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    shard = weight_map["model.layers.0.input_layernorm.weight"]  # the one the cases corrupt, too
    hub.interrupt_once.add((REPO, shard))
    before = len(hub.requests)
    done = subprocess.run(
        [PYTHON, "-c", CASES, REPO, GATED, PICKLED, TOKEN],
        env=hub_env(hub, tmp_path / "cache"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert (
        "is gated: accept its licence" in results["gated without a token"]
        and "HF_TOKEN" in results["gated without a token"]
    )
    assert results["gated with its token"] == "ok"
    assert "no model swarm-tests/no-such-model on the Hub" in results["unknown id"]
    assert "has no revision 'no-such-branch'" in results["unknown revision"]
    assert "holds only PyTorch .bin weights" in results["pickled weights"]
    assert results["interrupted download"] == "ok"
    assert "not enough disk for swarm-tests/tiny-llama/model-" in results["full disk"]
    # two commits, two swarms: a client of one never routes through servers of the other
    commits = hub.repos[REPO].refs
    assert results["swarm names"] == [
        f"tiny-llama.{commits['main'][:12]}",
        f"tiny-llama.{commits['v2'][:12]}",
    ]
    # cut half way, fetched again (huggingface_hub resumes from what it wrote, or starts over), then
    # fetched once more when the cached copy turns out corrupted
    gets = [r for r in hub.requests[before:] if r.repo == REPO and r.file == shard and r.method == "GET"]
    assert results["corrupted shard"] == "ok" and len(gets) == 3, gets

    offline = subprocess.run(
        [PYTHON, "-c", f"from llm_swarm.swarm.models.hub import resolve_model; resolve_model({REPO!r})"],
        env=hub_env(hub, tmp_path / "empty", HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert offline.returncode != 0 and "not in the Hub cache and the Hub cannot be reached" in offline.stderr


def test_a_local_directory_takes_no_revision(published):
    _hub, model_dir, _commit = published
    assert resolve_model(model_dir) == model_dir
    with pytest.raises(SwarmUserError, match="is a local directory"):
        resolve_model(model_dir, revision="main")
    assert default_prefix(str(model_dir)) == "tiny-llama"
    snapshot = Path("/cache/models--org--Some-Model/snapshots") / ("ab" * 20)
    assert default_prefix(str(snapshot)) == f"Some-Model.{'ab' * 6}"
