"""Decode time of one mixture-of-experts block against a dense block of the same active parameters,
on this machine's CPU, through the spans' own code.

    .venv/bin/python -m benchmarks.families.moe_decode --hidden 1024 --context 256 --steps 40 --write

Each pair shares its attention and width; the dense block's MLP is as wide as the experts a token
uses together (top-k x expert width), so both compute the same multiply-adds per token. The MoE
block also routes (a router product and a top-k) and holds every expert, so what it costs beyond
the dense block is routing and the gathers around each chosen expert. Blocks are built with random
weights from transformers' own layer classes at float32, a session of `--context` positions is
prefilled, then `--steps` single-token steps are timed one by one (the median is reported; the
pairs alternate step by step so that both see the same machine load).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn
from transformers import MistralConfig, MixtralConfig, PretrainedConfig, Qwen3Config, Qwen3MoeConfig

from benchmarks.common import parse_bench_args, publish_table
from llm_swarm.swarm.models.family import family_for
from llm_swarm.swarm.models.span import TransformerSpan, prepare_config


def pairs(hidden: int) -> dict[str, tuple[PretrainedConfig, PretrainedConfig]]:
    """(MoE, dense) configs of equal active MLP width, at `hidden` (heads of 64)."""
    heads = hidden // 64
    shared = {
        "hidden_size": hidden,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": 64,
    }
    expert = hidden // 2
    return {
        "Qwen3-MoE: 64 experts, top 8": (
            Qwen3MoeConfig(**shared, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=expert),
            Qwen3Config(**shared, intermediate_size=8 * expert),
        ),
        "Mixtral: 8 experts, top 2": (
            MixtralConfig(**shared, num_local_experts=8, num_experts_per_tok=2, intermediate_size=2 * expert),
            MistralConfig(**shared, intermediate_size=2 * 2 * expert),
        ),
    }


def random_span(config: PretrainedConfig) -> TransformerSpan:
    config = prepare_config(config)
    family = family_for(config)
    torch.manual_seed(0)
    block = family.build_block(config, 0)
    for parameter in block.parameters():
        nn.init.normal_(parameter, std=0.02)
    helpers = family.make_span_helpers(config, torch.device("cpu"))
    span = TransformerSpan(
        family, config, 0, 1, nn.ModuleList([block]), helpers, torch.float32, torch.device("cpu")
    )
    return span.eval().requires_grad_(False)


def active_parameters(block: nn.Module, config: PretrainedConfig) -> int:
    """Parameters a token multiplies: all but the experts it does not use."""
    total = sum(parameter.numel() for parameter in block.parameters())
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts:
        return total
    expert_parameters = sum(
        parameter.numel() for name, parameter in block.named_parameters() if ".experts." in name
    )
    return total - expert_parameters + expert_parameters * config.num_experts_per_tok // experts


def main() -> None:
    args = parse_bench_args(__doc__, hidden=1024, context=256, steps=40)
    torch.set_num_threads(2)
    lines = [
        "| pair | MoE block: parameters (active) | dense block: parameters | MoE ms/step | dense ms/step "
        "| MoE / dense |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, (moe_config, dense_config) in pairs(args.hidden).items():
        spans = [random_span(moe_config), random_span(dense_config)]
        caches = [span.new_cache(1, args.context + args.steps + 1) for span in spans]
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randn(1, args.context, args.hidden, generator=generator)
        for span, cache in zip(spans, caches, strict=True):
            span(prompt, cache, 0)
        times: list[list[float]] = [[], []]
        for step in range(args.steps):
            token = torch.randn(1, 1, args.hidden, generator=generator)
            for index, (span, cache) in enumerate(zip(spans, caches, strict=True)):
                started = time.perf_counter()
                span(token, cache, args.context + step)
                times[index].append(time.perf_counter() - started)
        moe_ms, dense_ms = (statistics.median(series) * 1e3 for series in times)
        moe_block, dense_block = spans[0].blocks[0], spans[1].blocks[0]
        moe_total = sum(parameter.numel() for parameter in moe_block.parameters())
        dense_total = sum(parameter.numel() for parameter in dense_block.parameters())
        lines.append(
            f"| {name} | {moe_total / 1e6:.1f} M ({active_parameters(moe_block, moe_config) / 1e6:.1f} M) "
            f"| {dense_total / 1e6:.1f} M | {moe_ms:.2f} | {dense_ms:.2f} | {moe_ms / dense_ms:.2f} |"
        )
        print(lines[-1], flush=True)
    text = (
        f"One block at hidden size {args.hidden} (heads of 64, a quarter as many KV heads), float32 on "
        f"this machine's CPU with 2 threads, batch 1: median of {args.steps} single-token steps after a "
        f"{args.context}-position prefill, through `TransformerSpan` (transformers' own layers; on "
        "transformers 5 the experts run its default grouped kernel). The dense block of each pair is "
        "as wide as the experts a token uses together, so both do the same multiply-adds per token; "
        "the MoE block's weights are many times larger, which is the memory a server gives it."
    )
    publish_table(
        __file__, args, lines, "## A mixture-of-experts block against a dense one, decoding on a CPU", text
    )


if __name__ == "__main__":
    main()
