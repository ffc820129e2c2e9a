"""What carrying a token between consecutive hops costs when servers push to each other (pure).

Eq. 1 is hub-spoke: every hop's output returns to the client, which sends it to the next hop, so
each hop costs the client's round trip to it. In a chain session (docs/architecture.md, "Chain
sessions") server i sends its output straight to server j and also answers the client, and j runs
the step from whichever copy arrives first. A token then costs half the client's round trip to the
first server, the faster of the two ways between consecutive servers, and half the round trip from
the last server back (docs/reference.md, "Chain sessions: what eq. 1 overstates"). These are the
`handover` and `exit_cost` of `RoutingGraph.shortest_pushed_chain`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from llm_swarm.swarm.server_info import ServerInfo


def pushed_handover(
    client_rtt: np.ndarray, server_rtt: np.ndarray, tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """`(handover, exit_cost)` over `tokens` tokens. `client_rtt[j]`: the client's round trip to
    server j (inf: unreachable); `server_rtt[i, j]`: the round trip server i measured to server j
    (inf: unknown, or one of them does not push, so the token goes through the client)."""
    client_rtt = np.asarray(client_rtt, dtype=float)
    server_rtt = np.asarray(server_rtt, dtype=float)
    if server_rtt.shape != (len(client_rtt), len(client_rtt)):
        raise ValueError("server_rtt needs one row and one column per server")
    half = client_rtt / 2
    via_client = half[:, None] + half[None, :]
    between = np.minimum(server_rtt / 2, via_client)
    # a server the client cannot reach cannot be the first or the last hop, nor answer it
    between[:, ~np.isfinite(client_rtt)] = np.inf
    handover = np.vstack([half[None, :], between]) * tokens
    return handover, half * tokens


def announced_server_rtts(peers: Sequence[str], records: Mapping[str, ServerInfo]) -> np.ndarray:
    """`[i, j]`: the round trip `peers[i]` announces to `peers[j]` (`ServerInfo.next_rtts`) where
    both take chain pushes; inf elsewhere (the token goes through the client)."""
    index = {peer: j for j, peer in enumerate(peers)}
    rtts = np.full((len(peers), len(peers)), math.inf)
    for i, peer in enumerate(peers):
        info = records.get(peer)
        if info is None or not info.chain_push:
            continue
        for other, rtt in info.next_rtts.items():
            j = index.get(other)
            if j is not None and records[other].chain_push:
                rtts[i, j] = rtt
    return rtts
