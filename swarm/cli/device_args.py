"""A command's --device and --dtype: the options, and the device and dtype they name."""

from __future__ import annotations

import argparse

import torch
from transformers import PretrainedConfig

from llm_swarm.swarm.hardware import (
    DTYPE_CHOICES,
    checkpoint_dtype_name,
    probe_device,
    resolve_device,
    resolve_dtype,
)


def add_device_arguments(
    parser: argparse.ArgumentParser, device_default: str, device_help: str, dtype_help: str
) -> None:
    """`--device` (default `device_default`) and `--dtype` (default auto, one of `DTYPE_CHOICES`)."""
    parser.add_argument("--device", default=device_default, help=device_help)
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=dtype_help)


def device_and_dtype_from_args(
    args: argparse.Namespace, model_config: PretrainedConfig
) -> tuple[torch.device, torch.dtype]:
    """`args.device` and `args.dtype` resolved on this machine's hardware (`swarm.hardware`); the
    checkpoint's own dtype, from `model_config`, is what `--dtype auto` prefers on a GPU."""
    facts = probe_device()
    device = resolve_device(args.device, facts)
    return device, resolve_dtype(args.dtype, device, facts, checkpoint_dtype_name(model_config))
