"""`swarm-generate`: generate text with a model whose blocks run in a swarm (or locally, for checks)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer, TextStreamer

from llm_swarm.client.backend import LocalSpans
from llm_swarm.client.connection import ClientOptions
from llm_swarm.client.generate_report import (
    ChainHop,
    TokenCheck,
    chain_lines,
    local_tokens,
    session_chain,
    speed_line,
)
from llm_swarm.client.model import DistributedModelForCausalLM
from llm_swarm.client.speculation.assistant import load_assistant, speculation_summary
from llm_swarm.swarm.cli.args import (
    add_model_source_arguments,
    add_swarm_secret_argument,
    command_parser,
    resolve_model_argument,
    span_list_argument,
    swarm_secret_from_args,
)
from llm_swarm.swarm.cli.dataclass_args import dataclass_from_args
from llm_swarm.swarm.cli.device_args import add_device_arguments, device_and_dtype_from_args
from llm_swarm.swarm.cli.errors import run_cli
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.models import load_span
from llm_swarm.swarm.models.checkpoint import load_config

EXAMPLES = """examples:
  swarm-generate models/tiny-llama --initial-peers $(head -1 dht.maddrs) --prompt "Once upon a time"
  swarm-generate models/tiny-llama --local-spans 0:3,3:6 --prompt "Once upon a time" --max-new-tokens 20
  swarm-generate models/llama-7b --initial-peers $PEER --prompt "def fib(n):" --assistant models/llama-160m
  swarm-generate models/tiny-llama --initial-peers $PEER --prompt "a b c a b c a b" --prompt-lookup 4
  swarm-generate models/tiny-llama --initial-peers $PEER --prompt "Once upon a time" --check
"""


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "swarm-generate", "Generate text through a chain of transformer-block spans.", EXAMPLES
    )
    parser.add_argument(
        "model_dir",
        help="the model: a local checkpoint directory or a Hub id (client-side modules, tokenizer)",
    )
    add_model_source_arguments(parser)
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
    add_device_arguments(
        parser,
        "cpu",
        device_help="where embeddings and the LM head run: cpu, cuda, cuda:N or auto",
        dtype_help="of the client-side modules; auto: float32 on CPU, bfloat16/float16 on a GPU",
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
    parser.add_argument(
        "--check",
        action="store_true",
        help="afterwards, generate again with plain transformers on this checkpoint (loaded whole, here) "
        "and compare the token ids; exit status 1 if they differ",
    )
    add_swarm_secret_argument(parser)
    return parser


def generate(args: argparse.Namespace) -> None:
    check_arguments(args)
    device, dtype = device_and_dtype_from_args(args, load_config(args.model_dir))
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
        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        run = run_generation(model, tokenizer, args)
    finally:
        model.shutdown()  # before the check: it loads the whole model, and needs no swarm
    for line in [*chain_lines(run.initial_chain, run.final_chain), run.speed]:
        print(line)
    if args.check:
        check_against_local(args, tokenizer, run, dtype, device)


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse what cannot work before connecting to anything."""
    if args.max_new_tokens < 1:
        raise SwarmUserError("--max-new-tokens must be at least 1")
    if (args.local_spans is None) == (args.initial_peers is None):
        raise SwarmUserError("give either --initial-peers (run on the swarm) or --local-spans (run locally)")
    speculates = getattr(args, "assistant", None) or getattr(args, "prompt_lookup", None) is not None
    if args.check and args.do_sample and speculates:
        # speculative sampling keeps the distribution but draws other random numbers than plain
        # sampling does: its tokens cannot be compared one by one with plain transformers generation
        raise SwarmUserError(
            "--check with --do-sample cannot be exact with --assistant/--prompt-lookup; drop one of them"
        )


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


@dataclass(frozen=True)
class GenerationRun:
    """What one swarm-generate run produced, for the report and the check."""

    input_ids: torch.Tensor  # the prompt's token ids
    new_tokens: list[int]
    seconds: float  # generate()'s wall time
    open_seconds: float  # opening the session: routing and opening a stream on every server
    initial_chain: list[ChainHop]
    final_chain: list[ChainHop]  # differs from the initial one after a failover

    @property
    def speed(self) -> str:
        return speed_line(len(self.new_tokens), self.seconds, self.open_seconds)


def decoding_kwargs(args: argparse.Namespace, tokenizer) -> dict:
    """generate()'s decoding settings: the swarm run and `--check`'s local run use the very same ones."""
    return {
        "max_new_tokens": args.max_new_tokens,
        "do_sample": args.do_sample,
        "temperature": args.temperature if args.do_sample else None,
        "top_p": args.top_p if args.do_sample else None,
        "pad_token_id": tokenizer.pad_token_id,
    }


def run_generation(model: DistributedModelForCausalLM, tokenizer, args: argparse.Namespace) -> GenerationRun:
    """Generate in an explicitly opened session, streaming the text to stdout as it comes (transformers'
    `TextStreamer`, also through speculative decoding), and read the chain from that same session."""
    input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids.to(model.device)
    extra = speculation_kwargs(model, args)
    opening = time.perf_counter()
    length = input_ids.shape[1] + args.max_new_tokens
    with model.inference_session(length, prompt_tokens=input_ids.shape[1]) as session:
        initial_chain = session_chain(session)
        torch.manual_seed(args.seed)  # right before generate(): `--check` seeds its local run alike
        started = time.perf_counter()
        output = model.generate(
            input_ids,
            session=session,
            streamer=TextStreamer(tokenizer),
            **decoding_kwargs(args, tokenizer),
            **extra,
        )
        seconds = time.perf_counter() - started
        final_chain = session_chain(session)  # before closing: a closed session forgets its servers
    if extra:
        print(speculation_summary(session.draft_stats), file=sys.stderr)
    return GenerationRun(
        input_ids=input_ids.cpu(),
        new_tokens=output[0, input_ids.shape[1] :].tolist(),
        seconds=seconds,
        open_seconds=started - opening,
        initial_chain=initial_chain,
        final_chain=final_chain,
    )


def check_against_local(
    args: argparse.Namespace, tokenizer, run: GenerationRun, dtype: torch.dtype, device: torch.device
) -> None:
    """`--check`: plain transformers generation of the same prompt with the same settings (greedy, or
    sampling seeded alike) must give the same token ids; print the verdict, exit 1 if they differ."""
    kwargs = decoding_kwargs(args, tokenizer)
    local = local_tokens(args.model_dir, run.input_ids, kwargs, dtype, device, args.seed)
    decoding = f"sampling, seed {args.seed}" if args.do_sample else "greedy"
    how = f"{str(dtype).removeprefix('torch.')}, {decoding}"
    source = "the swarm" if args.local_spans is None else "the local spans"
    report_check(TokenCheck(tuple(run.new_tokens), tuple(local)), tokenizer.decode, how, source)


def report_check(check: TokenCheck, decode, how: str = "", source: str = "the swarm") -> None:
    """Print `check`'s verdict; a difference ends the command with exit status 1 (a failed check,
    told apart from a usage error's 2)."""
    print(check.verdict(decode, how, source), flush=True)
    if not check.equal:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def run() -> None:
        resolve_model_argument(args, tokenizer=True)
        generate(args)

    run_cli("swarm-generate", run)


if __name__ == "__main__":
    main()
