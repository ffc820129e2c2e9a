"""Route feasibility (Sun et al., Lemma 3.1; Sun, He and Hou, section 2.1; docs/reference.md section 2):
the one place it lives.

With 0-based half-open spans, server j may follow a node whose span ends at `prev_end` iff
`start_j <= prev_end <= end_j - 1`. The client is a dummy node with `end = 0`, and a chain is
complete once it reaches a server with `end == L`. Every block is processed by the first server on
the chain holding it, so j processes `q = end_j - prev_end` blocks. WS-RR, the PETALS router and GCA
all build their links from these two functions (through `routing_graph.RoutingGraph`).
"""

from __future__ import annotations

from llm_swarm.scheduler.algorithms.problem import Span

CLIENT_END = 0  # the client (source) behaves as a node whose span ends before block 0


def can_follow(prev_end: int, span: Span) -> bool:
    """Lemma 3.1: may a server holding `span` come right after a node whose span ends at `prev_end`?"""
    return span.start <= prev_end <= span.end - 1


def predecessor_ends(span: Span) -> range:
    """Every `prev_end` for which `can_follow(prev_end, span)` holds, in increasing order."""
    return range(span.start, span.end)


def blocks_processed(prev_end: int, span: Span) -> int:
    """`q_ij = end_j - end_i`: blocks (and cache slots per session) the follower spends on a request."""
    if not can_follow(prev_end, span):
        raise ValueError(
            f"a server holding [{span.start}, {span.end}) cannot follow block boundary {prev_end}"
        )
    return span.end - prev_end
