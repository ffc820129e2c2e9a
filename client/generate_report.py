"""What `swarm-generate` prints after the text: the chain its session used, the speed, and (`--check`)
whether the swarm's tokens equal plain `transformers` generation on the same checkpoint.

Pure formatting and comparison, apart from `session_chain` (reads a live session) and `local_tokens`
(loads the checkpoint): the CLI composes them, and the tests call the pure parts with crafted input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from llm_swarm.client.remote import RemoteBlockSession
from llm_swarm.client.session import InferenceSession


@dataclass(frozen=True)
class ChainHop:
    """One hop of a session's chain: blocks `[start, end)` on a server (or in this process)."""

    start: int
    end: int
    peer_id: str | None = None  # None: the blocks ran in this process (`--local-spans`)
    public_name: str = ""  # what the server announced in its DHT record, if anything

    def describe(self) -> str:
        """`blocks 0:2  server-0:2 (12D3Ko...abc123)`: the span, then who ran it."""
        return f"blocks {self.start}:{self.end}  {self.where()}"

    def where(self) -> str:
        if self.peer_id is None:
            return "this process (--local-spans)"
        short = f"{self.peer_id[:6]}...{self.peer_id[-6:]}"
        name = _printable(self.public_name)
        return f"{name} ({short})" if name else short


def _printable(text: str) -> str:
    """A server's public name is whatever its operator (or an attacker) announced: never let it put
    control characters (terminal escape sequences) on the user's screen."""
    return "".join(char if char.isprintable() else "?" for char in text)


def session_chain(session: InferenceSession) -> list[ChainHop]:
    """The hops `session` runs its blocks through right now. Read it before the session closes (a
    closed swarm session forgets its streams); after a failover it holds the replacement servers."""
    blocks = session.blocks
    if isinstance(blocks, RemoteBlockSession):
        known = blocks.connection.roster.known  # the DHT records routing used: public names
        return [
            ChainHop(stream.hop.start, stream.hop.end, stream.hop.peer_id, _name(known, stream.hop.peer_id))
            for stream in blocks.streams
        ]
    # in-process spans (`LocalSpans`' session): no servers, only spans
    return [ChainHop(span.start, span.end) for span in getattr(blocks, "spans", [])]


def _name(known: dict, peer_id: str) -> str:
    info = known.get(peer_id)
    return info.public_name if info is not None else ""


def chain_lines(initial: Sequence[ChainHop], final: Sequence[ChainHop]) -> list[str]:
    """The final chain, one line per hop; hops that failover brought in during generation are marked,
    and the header names the hops they replaced (the chain the session opened with)."""
    gone = [hop for hop in initial if hop not in final]
    header = f"chain: {len(final)} hop{'s' if len(final) != 1 else ''}"
    if gone:
        replaced = "; ".join(hop.describe() for hop in gone)
        header += f", after failover replaced {replaced}"
    lines = [header]
    for hop in final:
        marker = "  (replacement)" if gone and hop not in initial else ""
        lines.append(f"  {hop.describe()}{marker}")
    return lines


def speed_line(new_tokens: int, seconds: float, open_seconds: float) -> str:
    """Decoding speed as the user saw it: generate()'s wall time, the prompt's prefill included."""
    rate = new_tokens / seconds if seconds > 0 else float("inf")
    return (
        f"speed: {new_tokens} new tokens in {seconds:.2f} s = {rate:.1f} tokens/s "
        f"(prefill included; opening the session took {open_seconds:.2f} s)"
    )


@dataclass(frozen=True)
class TokenCheck:
    """The swarm's new token ids next to the ones local `transformers` generated for the same input."""

    swarm: tuple[int, ...]
    local: tuple[int, ...]

    @property
    def equal(self) -> bool:
        return self.swarm == self.local

    @property
    def first_difference(self) -> int | None:
        """The first new-token position (0-based) where the two differ, or None if they are equal.
        One sequence ending early (an end-of-sequence token) differs where the other goes on."""
        for position, (ours, theirs) in enumerate(zip(self.swarm, self.local, strict=False)):
            if ours != theirs:
                return position
        if len(self.swarm) != len(self.local):
            return min(len(self.swarm), len(self.local))
        return None

    def verdict(
        self, decode: Callable[[int], str] | None = None, how: str = "", source: str = "the swarm"
    ) -> str:
        """One line for the user: `check: ...` when equal, `check FAILED: ...` otherwise.
        `decode`: token id -> text, to show the differing tokens readably; `how`: the settings compared;
        `source`: what generated `swarm` (the swarm, or in-process spans)."""
        detail = f" ({how})" if how else ""
        position = self.first_difference
        if position is None:
            same = f"the same {len(self.swarm)} new tokens"
            return f"check: {source} generated {same} as local transformers{detail}"
        ours, theirs = _token_at(self.swarm, position, decode), _token_at(self.local, position, decode)
        counts = ""
        if len(self.swarm) != len(self.local):
            counts = f"; {source} made {len(self.swarm)} new tokens, local transformers {len(self.local)}"
        return (
            f"check FAILED: tokens differ from position {position} of the new tokens "
            f"({source} {ours} vs local {theirs}){counts}{detail}"
        )


def _token_at(tokens: Sequence[int], position: int, decode: Callable[[int], str] | None) -> str:
    if position >= len(tokens):
        return "<ended>"
    token = tokens[position]
    return f"{token} {decode(token)!r}" if decode is not None else str(token)


def local_tokens(
    model_dir: str | Path,
    input_ids: torch.Tensor,
    generate_kwargs: dict,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
) -> list[int]:
    """The new token ids of plain `transformers` generation: the whole checkpoint loaded here, in the
    client's dtype and on its device, the same generate() settings, the RNG seeded as the swarm run
    was (so sampling draws the same numbers)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    model = model.to(device).eval()
    torch.manual_seed(seed)
    with torch.inference_mode():
        output = model.generate(input_ids.to(device), **generate_kwargs)
    return output[0, input_ids.shape[1] :].tolist()
