"""One logging set-up for every command: quiet, one line per event, with a --log-level flag."""

from __future__ import annotations

import argparse
import logging


def add_log_level_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # hivemind logs every connection at INFO; operators need it only when debugging
    logging.getLogger("hivemind").setLevel(max(logging.WARNING, getattr(logging, level.upper())))
