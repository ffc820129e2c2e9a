"""Where prefill servers' blocks go once the roles are chosen, pure.

With roles, the servers that decode form the chains (the policy, e.g. CG-BP, places them among
themselves: a prefill server never carries a session's tokens), and each prefill server holds the
blocks whose prompts it will run. A prompt's hop can run on a prefill server only when that server
holds the hop's whole span, and its cache then crosses the link to the hop's decode server: so a
prefill server is paired with decode servers (DistServe: the two phases of a stage sit where the
cache crosses a fast link), by choosing its span:

- the whole model where it fits with room for one nominal prompt (every hop of every chain can
  then run its prompt there);
- else as many blocks as fit, at the start that (1) serves the decode servers earlier prefill
  servers serve least (each decode span it contains counts `1 / (1 + prefill servers already
  containing it)`: a decode server none serves counts 1), then (2) has the most link rate to the
  decode servers it contains (a link nobody measured counts as none), then (3) lies first.
  Candidate starts are the decode spans' starts, and the starts that end where a decode span ends.
  Prefill servers are taken in the caller's order (the scheduler's: the best at prompts first).

Without decode spans (nothing placed yet) the spans are laid one after another around the model.
The live scheduler (`scheduler/service/planner.py` `place_prefill`) and the simulator
(`scheduler/sim/contended_roles.py`, once the run's dispatcher has placed the decode servers) use the
same rule.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from llm_swarm.scheduler.algorithms.problem import Span

Links = Mapping[str, Mapping[str, float]]  # sender name -> receiver name -> bytes/s


def prefill_blocks(
    memory_bytes: float, num_blocks: int, block_bytes: float, prompt_bytes_per_block: float
) -> int:
    """Blocks a prefill server holds: as many as fit with one prompt's cache on each (at most all)."""
    if not (prompt_bytes_per_block >= 0 and block_bytes > 0):
        raise ValueError("block bytes must be positive and prompt bytes per block >= 0")
    return min(num_blocks, int(memory_bytes // (block_bytes + prompt_bytes_per_block)))


def _inside(span: Span, decode: Mapping[str, Span]) -> list[str]:
    """The decode servers whose whole span `span` holds (their hops' prompts can run there)."""
    return [d for d, other in decode.items() if span.start <= other.start and other.end <= span.end]


def _score(
    name: str, span: Span, decode: Mapping[str, Span], served: Counter[str], links: Links
) -> tuple[float, float, int]:
    inside = _inside(span, decode)
    need = sum(1 / (1 + served[d]) for d in inside)
    reach = sum(links.get(name, {}).get(d, 0.0) or 0.0 for d in inside)
    return need, reach, -span.start


def prefill_spans(
    names: Sequence[str],
    blocks: Sequence[int],
    num_blocks: int,
    decode: Mapping[str, Span] | None = None,
    links: Links | None = None,
) -> list[Span]:
    """One span per prefill server `names[k]` of `blocks[k]` blocks (see the module docstring)."""
    if len(names) != len(blocks):
        raise ValueError(f"{len(blocks)} block counts for {len(names)} prefill servers")
    links = links or {}
    spans: list[Span] = []
    served: Counter[str] = Counter()  # decode server -> earlier prefill servers containing it
    laid = 0  # where the next span starts without decode spans
    for name, length in zip(names, blocks, strict=True):
        if length < 1:
            raise ValueError(f"prefill server {name} cannot hold a block and a prompt")
        if length >= num_blocks:
            spans.append(Span(0, num_blocks))
            served.update(list(decode or ()))  # keys: a mapping would add its values
            continue
        if not decode:
            start = laid if laid + length <= num_blocks else num_blocks - length
            spans.append(Span(start, start + length))
            laid = (start + length) % num_blocks
            continue
        starts = {0, num_blocks - length}
        for other in decode.values():
            starts.add(min(other.start, num_blocks - length))
            starts.add(max(0, min(other.end - length, num_blocks - length)))
        best = max(
            (Span(start, start + length) for start in sorted(starts)),
            key=lambda span: _score(name, span, decode, served, links),
        )
        spans.append(best)
        served.update(_inside(best, decode))
    return spans
