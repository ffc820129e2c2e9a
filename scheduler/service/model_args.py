"""The model a scheduler-side command's --model-dir names, as the scheduler sees it."""

from __future__ import annotations

import argparse

from llm_swarm.scheduler.service.view import ModelShape
from llm_swarm.swarm.cli.args import resolve_model_argument
from llm_swarm.swarm.model_limits import ModelLimits
from llm_swarm.swarm.models.checkpoint import load_config


def model_from_args(args: argparse.Namespace) -> tuple[ModelShape, ModelLimits]:
    """The shape and the limits of the model `--model-dir` names: only its config is read (fetched
    from the Hub for a Hub id), since these commands place and check blocks but load no weights."""
    model_config = load_config(resolve_model_argument(args))
    return ModelShape.from_config(model_config), ModelLimits.from_config(model_config)
