"""Attention cache bytes per position and block, at today's largest models' real shapes: what a
span caches against what transformers' own cache holds after the same number of positions.

    .venv/bin/python -m benchmarks.families.family_caches --positions 32768 --write

For each model, its config (the published shape: layers, heads, widths, windows) builds every
layer's attention module on the meta device (no memory, no weights), runs it over `--positions`
positions with transformers' `DynamicCache`, and reads the shapes the cache kept: that is what
transformers allocates, sliding layers keeping only their window. A span's cache is what
`SpanCache` allocates for every block of the model on the meta device (no memory): the family's rows
(`ModelFamily.cache_layout`), the whole session for full attention, the ring for sliding layers
(`ring_capacity`). Bytes are at bfloat16.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, DynamicCache, PretrainedConfig

from benchmarks.common import parse_bench_args, publish_table
from llm_swarm.swarm.cost import REWIND_RESERVE
from llm_swarm.swarm.models import span as _span  # noqa: F401  (registers the families)
from llm_swarm.swarm.models.cache import SpanCache
from llm_swarm.swarm.models.family import StepTokens, family_for
from llm_swarm.swarm.transformers_compat import layer_cache_argument

BYTES = 2  # bfloat16


# the published configs' shapes: of each model's config.json on the Hub, its `model_type` and the
# fields that size attention and experts (layers, heads, widths, windows)
SHAPES_FILE = Path(__file__).with_name("shapes.json")


def published_shapes() -> dict[str, PretrainedConfig]:
    """Each model's config, by the table's row name, from `SHAPES_FILE`."""
    shapes = json.loads(SHAPES_FILE.read_text())
    return {name: AutoConfig.for_model(fields.pop("model_type"), **fields) for name, fields in shapes.items()}


SHAPES = published_shapes()


def transformers_cache_bytes(config: PretrainedConfig, positions: int) -> float:
    """Bytes per position per block that transformers' DynamicCache holds after `positions`
    positions of every layer's own attention, averaged over the layers."""
    config._attn_implementation = "sdpa"
    family = family_for(config)
    cache = DynamicCache(config=config)
    hidden = torch.empty(1, positions, config.hidden_size, device="meta")
    with torch.device("meta"):
        helpers = family.make_span_helpers(config, torch.device("meta"))
    total = 0
    for index in range(config.num_hidden_layers):
        with torch.device("meta"):  # shapes only: a DeepSeek block's experts alone are 30 GB
            layer = family.build_block(config, index)
        # the layer's rotary table, as a span computes it for the layer's window
        step = StepTokens(hidden, 0, None, family.layer_window(config, index))
        embeddings = family.position_inputs(config, helpers, step)["position_embeddings"]
        attention = layer.self_attn
        arguments = {layer_cache_argument(type(attention)): cache}
        attention(hidden, position_embeddings=embeddings, attention_mask=None, **arguments)
        kept = cache.layers[index]
        total += (kept.keys.numel() + kept.values.numel()) * BYTES
    return total / config.num_hidden_layers / positions


def span_cache_bytes(config: PretrainedConfig, positions: int) -> float:
    """Bytes per position per block that a span's cache allocates for a session of `positions`
    positions over every block of the model, averaged over the blocks."""
    family = family_for(config)
    layout = family.cache_layout(config)
    blocks = family.num_blocks(config)
    windows = [family.layer_window(config, index) for index in range(blocks)]
    cache = SpanCache(
        blocks,
        1,
        layout.heads,
        layout.key_dim,
        positions,
        torch.bfloat16,
        "meta",
        value_dim=layout.value_dim,
        windows=windows,
    )
    return cache.nbytes / blocks / positions


def main() -> None:
    args = parse_bench_args(__doc__, positions=32768)
    lines = [
        f"| model | span (bytes/position/block) | transformers' cache | ratio | a {args.positions}-position "
        "session, all blocks (span) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, config in SHAPES.items():
        family = family_for(config)
        ours = span_cache_bytes(config, args.positions)
        theirs = transformers_cache_bytes(config, args.positions)
        session = ours * args.positions * family.num_blocks(config) / 2**30
        lines.append(f"| {name} | {ours:,.0f} | {theirs:,.0f} | {ours / theirs:.2f} | {session:.2f} GiB |")
        print(lines[-1], flush=True)
    text = (
        "Attention cache bytes per position and block at bfloat16, after a session of "
        f"{args.positions} positions. transformers' numbers are measured: every layer's own attention "
        "module, on the meta device, run over the positions with `DynamicCache`, and the bytes its "
        "layers keep, averaged over the layers. A span's numbers are what its cache allocates for the "
        "session over every block, averaged the same way: DeepSeek's latent (512 + 64 elements, as "
        "transformers 5 caches it: 57x fewer than 128 heads of 128-wide keys and values), and for "
        f"sliding layers a ring of the window's last positions plus {REWIND_RESERVE} kept for rewinds "
        "(GPT-OSS: half its layers slide over 128 positions, Gemma 3: five of six over 1024, Mistral "
        "v0.1: all over 4096), where transformers keeps the window alone."
    )
    publish_table(__file__, args, lines, "## Attention cache per family at real shapes", text)


if __name__ == "__main__":
    main()
