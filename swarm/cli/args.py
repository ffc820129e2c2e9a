"""Argument parsers shared by the command-line tools."""

from __future__ import annotations

import argparse

from llm_swarm.swarm.dht_keys import default_prefix, validate_prefix
from llm_swarm.swarm.errors import SwarmUserError


def command_parser(prog: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """The parser a `swarm-*` command starts from: its examples (`epilog`) keep their line breaks, and
    arguments may also come from a file, one per line (`swarm-... @args.txt`)."""
    return argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        fromfile_prefix_chars="@",
    )


def add_model_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--initial-peers, --model-dir and --dht-prefix of the tools that join a swarm but read only the
    model's config (not its weights)."""
    parser.add_argument("--initial-peers", nargs="+", required=True, help="multiaddrs of DHT peers")
    parser.add_argument(
        "--model-dir", required=True, help="the model's directory or Hub id (only its config is read)"
    )
    parser.add_argument("--dht-prefix", help="swarm namespace of the model (default: the directory's name)")
    add_model_source_arguments(parser)


def add_model_source_arguments(parser: argparse.ArgumentParser) -> None:
    """--revision and --token of the tools that take a model as a local directory or a Hub id."""
    parser.add_argument(
        "--revision", help="a Hub model's branch, tag or commit (default: main); not for a local directory"
    )
    parser.add_argument(
        "--token", help="Hugging Face token for a gated or private Hub model (default: HF_TOKEN or a login)"
    )


def resolve_model_argument(
    args: argparse.Namespace, attribute: str = "model_dir", tokenizer: bool = False
) -> str:
    """Make `args.<attribute>` (a local directory or a Hub id, with --revision and --token) the
    checkpoint directory it names, fetching a Hub model's config (and tokenizer files, for a client)
    but none of its weights yet; returns it."""
    from llm_swarm.swarm.models.hub import (
        resolve_model,  # the model code is heavy for tools that never read one
    )

    source = getattr(args, attribute)
    directory = str(
        resolve_model(source, getattr(args, "revision", None), getattr(args, "token", None), tokenizer)
    )
    setattr(args, attribute, directory)
    return directory


def dht_prefix_from_args(args: argparse.Namespace) -> str:
    """The model's swarm namespace: --dht-prefix (checked) if given, else the name of `args.model_dir`."""
    return validate_prefix(args.dht_prefix) if args.dht_prefix else default_prefix(str(args.model_dir))


def parse_span(text: str) -> tuple[int, int]:
    """`"3:7"` -> (3, 7): blocks 3..6, 0-based and half-open like Python slices."""
    try:
        start_text, end_text = text.split(":")
        start, end = int(start_text), int(end_text)
    except ValueError:
        raise SwarmUserError(f"block span {text!r} is not START:END (e.g. 0:12)") from None
    if start < 0 or end <= start:
        raise SwarmUserError(f"block span {text!r} must satisfy 0 <= START < END")
    return start, end


def span_list(text: str) -> list[tuple[int, int]]:
    """`"0:2,2:6"` -> [(0, 2), (2, 6)]."""
    return [parse_span(part) for part in text.split(",") if part]


def span_argument(text: str) -> tuple[int, int]:
    try:
        return parse_span(text)
    except SwarmUserError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def span_list_argument(text: str) -> list[tuple[int, int]]:
    try:
        return span_list(text)
    except SwarmUserError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_swarm_secret_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--swarm-secret",
        metavar="FILE",
        help="closed swarm: the file holding its secret (every peer needs the same one; see "
        "docs/security.md); default: an open swarm",
    )


def swarm_secret_from_args(args: argparse.Namespace):
    """The `SwarmSecret` named by --swarm-secret, or None (an open swarm)."""
    from llm_swarm.swarm.closed_swarm import SwarmSecret

    return SwarmSecret.from_file(args.swarm_secret) if args.swarm_secret else None
