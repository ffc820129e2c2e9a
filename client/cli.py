"""`swarm-generate`: generate text with a model whose blocks run in a swarm (or locally, for checks)."""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoTokenizer, TextStreamer

from client.backend import LocalSpans
from client.connection import ClientOptions
from client.model import DistributedModelForCausalLM
from client.speculation.assistant import load_assistant, speculation_summary
from swarm.cli.args import (
    add_swarm_secret_argument,
    command_parser,
    span_list_argument,
    swarm_secret_from_args,
)
from swarm.cli.dataclass_args import dataclass_from_args
from swarm.cli.errors import run_cli
from swarm.errors import SwarmUserError
from swarm.hardware import DTYPE_CHOICES, checkpoint_dtype_name, probe_device, resolve_device, resolve_dtype
from swarm.models import load_span
from swarm.models.checkpoint import load_config

EXAMPLES = """examples:
  swarm-generate models/tiny-llama --initial-peers $(head -1 dht.maddrs) --prompt "Once upon a time"
  swarm-generate models/tiny-llama --local-spans 0:3,3:6 --prompt "Once upon a time" --max-new-tokens 20
  swarm-generate models/llama-7b --initial-peers $PEER --prompt "def fib(n):" --assistant models/llama-160m
  swarm-generate models/tiny-llama --initial-peers $PEER --prompt "a b c a b c a b" --prompt-lookup 4
"""


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "swarm-generate", "Generate text through a chain of transformer-block spans.", EXAMPLES
    )
    parser.add_argument("model_dir", help="local checkpoint directory (client-side modules and tokenizer)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--initial-peers", nargs="+", help="multiaddrs of the swarm's DHT peers")
    parser.add_argument(
        "--dht-prefix", help="swarm namespace of the model (default: the model directory's name)"
    )
    parser.add_argument(
        "--local-spans",
        type=span_list_argument,
        help="run these consecutive spans in this process instead of a swarm, e.g. 0:3,3:6",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="of the client-side modules; auto: float32 on CPU, bfloat16/float16 on a GPU",
    )
    parser.add_argument(
        "--device", default="cpu", help="where embeddings and the LM head run: cpu, cuda, cuda:N or auto"
    )
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scheduler-key",
        help="route through the scheduler whose records this public key signs (the key text, or the "
        "file swarm-scheduler wrote); without it, route locally",
    )
    parser.add_argument(
        "--verify-fraction",
        type=float,
        default=0.0,
        help="also run this fraction of each server's steps (chosen unpredictably; 1 = all) on another "
        "server holding the same blocks, and ban a server two replicas outvote",
    )
    speculation = parser.add_mutually_exclusive_group()
    speculation.add_argument(
        "--assistant",
        metavar="MODEL_DIR",
        help="speculative decoding: a small local model with the same tokenizer drafts tokens, the swarm "
        "verifies several per round trip (the output is unchanged; docs/speculative.md)",
    )
    speculation.add_argument(
        "--prompt-lookup",
        type=int,
        metavar="N",
        help="speculative decoding without a draft model: up to N tokens copied from earlier text",
    )
    add_swarm_secret_argument(parser)
    return parser


def generate(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise SwarmUserError("--max-new-tokens must be at least 1")
    if (args.local_spans is None) == (args.initial_peers is None):
        raise SwarmUserError("give either --initial-peers (run on the swarm) or --local-spans (run locally)")
    facts = probe_device()
    device = resolve_device(args.device, facts)
    dtype = resolve_dtype(args.dtype, device, facts, checkpoint_dtype_name(load_config(args.model_dir)))
    if args.local_spans is not None:
        backend = local_backend(args.model_dir, args.local_spans, dtype, device)
        model = DistributedModelForCausalLM.from_local_parts(
            args.model_dir, backend, dtype=dtype, device=device
        )
    else:
        options = dataclass_from_args(ClientOptions, args, swarm_secret=swarm_secret_from_args(args))
        model = DistributedModelForCausalLM.from_pretrained(
            args.model_dir,
            args.initial_peers,
            dht_prefix=args.dht_prefix,
            dtype=dtype,
            device=device,
            options=options,
        )
    try:
        run_generation(model, args)
    finally:
        model.shutdown()


def local_backend(
    model_dir: str, spans: list[tuple[int, int]], dtype, device: torch.device | str = "cpu"
) -> LocalSpans:
    loaded = [load_span(model_dir, start, end, dtype=dtype, device=device)[0] for start, end in spans]
    num_blocks = loaded[-1].family.num_blocks(loaded[-1].config)
    if loaded[-1].end != num_blocks:
        raise SwarmUserError(f"--local-spans must end at the model's last block ({num_blocks})")
    try:
        return LocalSpans(loaded)
    except ValueError as error:
        raise SwarmUserError(f"--local-spans: {error}") from None


def speculation_kwargs(model: DistributedModelForCausalLM, args: argparse.Namespace) -> dict:
    """generate()'s arguments for `--assistant` / `--prompt-lookup` (empty without them)."""
    if getattr(args, "prompt_lookup", None) is not None:
        if args.prompt_lookup < 1:
            raise SwarmUserError("--prompt-lookup must be at least 1")
        return {"prompt_lookup_num_tokens": args.prompt_lookup}
    if getattr(args, "assistant", None):
        return {"assistant_model": load_assistant(args.assistant, model.config, model.dtype, model.device)}
    return {}


def run_generation(model: DistributedModelForCausalLM, args: argparse.Namespace) -> None:
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(model.device)
    extra = speculation_kwargs(model, args)
    torch.manual_seed(args.seed)
    with model.inference_session(max_length=input_ids.shape[1] + args.max_new_tokens) as session:
        model.generate(
            input_ids,
            max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature if args.do_sample else None,
            top_p=args.top_p if args.do_sample else None,
            streamer=TextStreamer(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            **extra,
        )
    if extra:
        print(speculation_summary(session.draft_stats), file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    run_cli("swarm-generate", lambda: generate(args))


if __name__ == "__main__":
    main()
