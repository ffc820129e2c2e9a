"""How much honest servers disagree: the calibration of replica verification's tolerance.

    .venv/bin/python -m benchmarks.serving.verification_calibration [--layers 3] [--tokens 32] [--write]

For a tiny LLaMA-GQA and BLOOM (hidden 64) and a wider LLaMA (hidden 512), the same inputs go
through the same blocks as different honest servers would compute them, and the relative
difference `|a - b| / max(|a|, |b|)` of the outputs is taken per decode step (max over steps):
- float32 step by step vs float32 with the history replayed as one prefill (a verifier catching up);
- float32 unbatched vs batched with three other sessions (`forward_batch`);
- float32 vs bfloat16 and float16 blocks (servers of other dtypes); on CPU here (CUDA where lent).
The tolerance of `client.verification.TOLERANCE` must sit well above these, and well below what a
liar changes (the test liar adds noise of half the output's norm: relative difference ~0.5).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from benchmarks.common import parse_bench_args, publish_table
from llm_swarm.client.verification import TOLERANCE, relative_difference, tolerance
from llm_swarm.swarm.models import load_span
from llm_swarm.swarm.models.span import TransformerSpan
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

SHAPES = {
    "llama h64": TinyModelSpec(family="llama", num_layers=3, num_kv_heads=2),
    "bloom h64": TinyModelSpec(family="bloom", num_layers=3),
    "llama h512": TinyModelSpec(family="llama", num_layers=3, hidden_size=512, num_heads=8, num_kv_heads=4),
}


def decode(span: TransformerSpan, prompt: torch.Tensor, steps: list[torch.Tensor]) -> list[torch.Tensor]:
    cache = span.new_cache(1, prompt.shape[1] + len(steps))
    outputs = [span(prompt, cache, 0)[:, -1:].float().cpu()]
    for index, step in enumerate(steps):
        outputs.append(span(step, cache, prompt.shape[1] + index).float().cpu())
    return outputs


def worst_difference(outputs: list[torch.Tensor], base: list[torch.Tensor]) -> float:
    """The largest relative difference of a decode's outputs from `base`'s, step by step."""
    return max(relative_difference(a, b) for a, b in zip(outputs, base, strict=True))


def cpu_reference(
    model_dir: Path, tokens: int
) -> tuple[TransformerSpan, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The model's blocks at float32 on the CPU, the seeded inputs every comparison decodes (an
    8-token prompt, then `tokens` steps) and that span's outputs on them."""
    torch.manual_seed(0)
    span = load_span(model_dir, 0, 3, dtype="float32")[0]
    prompt = torch.randn(1, 8, span.hidden_size)
    steps = [torch.randn(1, 1, span.hidden_size) for _ in range(tokens)]
    return span, prompt, steps, decode(span, prompt, steps)


def measure(model_dir: Path, tokens: int) -> dict[str, float]:
    reference, prompt, steps, base = cpu_reference(model_dir, tokens)
    width = reference.hidden_size
    results = {}
    # a verifier that caught up with one prefill of the history, then computes the last step
    cache = reference.new_cache(1, prompt.shape[1] + tokens)
    history = torch.cat([prompt, *steps[:-1]], dim=1)
    reference(history, cache, 0)
    caught_up = reference(steps[-1], cache, history.shape[1]).float()
    results["prefill catch-up"] = relative_difference(caught_up, base[-1])
    # the same step batched with three other sessions
    others = [reference.new_cache(1, 64) for _ in range(3)]
    for other in others:
        reference(torch.randn(1, 5, width), other, 0)
    cache = reference.new_cache(1, prompt.shape[1] + tokens)
    reference(history, cache, 0)
    batch = [(steps[-1], cache, history.shape[1], None)]
    batch += [(torch.randn(1, 1, width), other, 5, None) for other in others]
    results["batched"] = relative_difference(reference.forward_batch(batch)[0].float(), caught_up)
    for dtype in ("bfloat16", "float16"):
        span = load_span(model_dir, 0, 3, dtype=dtype)[0]
        outputs = decode(span, prompt, steps)
        results[dtype] = worst_difference(outputs, base)
    return results


CUDA_KINDS = [("float16", "none"), ("bfloat16", "none"), ("float16", "int8"), ("float16", "nf4")]


def measure_cuda(model_dir: Path, tokens: int) -> dict[str, float]:
    """On a GPU: float32 there against the CPU's, CUDA graphs against eager steps (float16), and each
    16-bit or quantized server kind against float32 on the same GPU."""
    _, prompt, steps, base_cpu = cpu_reference(model_dir, tokens)
    reference = load_span(model_dir, 0, 3, dtype="float32", device="cuda")[0]
    base = decode(reference, prompt, steps)
    results = {"float32 cuda vs cpu": worst_difference(base, base_cpu)}
    eager = decode(load_span(model_dir, 0, 3, dtype="float16", device="cuda")[0], prompt, steps)
    graphed_span = load_span(model_dir, 0, 3, dtype="float16", device="cuda")[0]
    graphed_span.use_decode_graphs()
    graphed = decode(graphed_span, prompt, steps)
    results["graphs vs eager"] = worst_difference(graphed, eager)
    for dtype, quant in CUDA_KINDS:
        span = load_span(model_dir, 0, 3, dtype=dtype, device="cuda", quant=quant)[0]
        outputs = decode(span, prompt, steps)
        results[quant if quant != "none" else dtype] = worst_difference(outputs, base)
    return results


def tolerance_text(kinds: list[str]) -> str:
    value = tolerance(kinds)
    return f"{value:.0e}" if value is not None else "none: unverified"


def main_cuda(args) -> None:
    rows = []
    columns = ["float32 cuda vs cpu", "graphs vs eager", "float16", "bfloat16", "int8", "nf4"]
    with tempfile.TemporaryDirectory() as scratch:
        for name, spec in SHAPES.items():
            if spec.family != "llama":
                continue  # BLOOM decodes eagerly; its dtypes are in the CPU table
            model_dir = Path(scratch) / name.replace(" ", "-")
            build_tiny_model(model_dir, spec)
            results = measure_cuda(model_dir, args.tokens)
            rows.append(f"| {name} | " + " | ".join(f"{results[c]:.1e}" for c in columns) + " |")
    lines = [
        "| blocks (3) | float32: CUDA vs CPU | float16: graphs vs eager | float16 vs float32 "
        "| bfloat16 vs float32 | int8 vs float32 | nf4 vs float32 |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "| tolerance used | "
        + " | ".join(
            tolerance_text(kinds)
            for kinds in (["float32"], ["float16"], ["float16", "float32"], ["bfloat16", "float32"])
            + [["int8", "float32"], ["nf4", "float32"]]
        )
        + " |",
    ]
    name = torch.cuda.get_device_name()
    publish_table(
        __file__,
        args,
        lines,
        "## Replica verification on a GPU",
        "The same measure as the CPU table above, on "
        f"{name}: the largest relative difference of 3 blocks' outputs over {args.tokens} decode steps "
        "(after an 8-token prompt) between float32 on the GPU and each other kind of honest server on "
        "the same GPU (bitsandbytes int8 and nf4 compute in float16), plus float32 on the GPU against the "
        "CPU and float16 steps replayed from CUDA graphs against eager ones.",
    )


def main() -> None:
    args = parse_bench_args(__doc__, tokens=32, device="cpu")
    if args.device.startswith("cuda"):
        main_cuda(args)
        return
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, spec in SHAPES.items():
            model_dir = Path(scratch) / name.replace(" ", "-")
            build_tiny_model(model_dir, spec)
            results = measure(model_dir, args.tokens)
            rows.append(
                f"| {name} | {results['prefill catch-up']:.1e} | {results['batched']:.1e} | "
                f"{results['bfloat16']:.1e} | {results['float16']:.1e} |"
            )
    lines = [
        "| blocks (3) | float32: prefill catch-up | float32: batched | bfloat16 vs float32 "
        "| float16 vs float32 |",
        "|---|---|---|---|---|",
        *rows,
        f"| tolerance used | {TOLERANCE['float32']:.0e} | {TOLERANCE['float32']:.0e} | "
        f"{TOLERANCE['bfloat16']:.0e} | {TOLERANCE['float16']:.0e} |",
    ]
    publish_table(
        __file__,
        args,
        lines,
        "## Replica verification: how much honest servers disagree",
        "The largest relative difference "
        f"`|a - b| / max(|a|, |b|)` of 3 blocks' outputs over {args.tokens} decode steps between two "
        "honest ways of computing them, on this machine's CPU. A verified step passes when the "
        "difference is within the tolerance of the coarser dtype of the two servers "
        "(`client/verification.py`); the test liar's noise is 0.5.",
    )


if __name__ == "__main__":
    main()
