"""Errors that are the user's to fix (bad input, bad files), as opposed to bugs.

Command-line entry points print these as one line and exit with status 2; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations


class SwarmUserError(Exception):
    """Base class: the message alone tells the user what to fix."""


class CheckpointError(SwarmUserError):
    """A model directory is missing, incomplete or corrupt."""


class UnsupportedModelError(SwarmUserError):
    """The checkpoint's architecture is not one this project serves."""


class SpanError(SwarmUserError):
    """A block span is empty or outside the model."""


class SwarmUnavailable(SwarmUserError):
    """The swarm cannot serve the request (blocks not served, or no room for too long)."""
