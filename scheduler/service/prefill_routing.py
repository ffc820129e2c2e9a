"""The prompt phase of a session the scheduler routes (WS-RR routes a session's two phases).

WS-RR picks the decode chain; then, per hop of it, this picks where the prompt runs: a server started
with `--role prefill` that holds the hop's blocks (its cache is then handed to the hop's decode
server, docs/architecture.md "Prefill and decode roles"), or the decode server itself. The rule is
the client's (`swarm.prefill_cost`: the prefill server's prefill plus the cache's transfer over the
announced link against the decode server's own prefill), with what only the scheduler sees added:
how long each server is already busy with the prompts it was given. A client alone sends every
prompt to the fastest prefill server; the scheduler spreads them, each to the earliest finish.

Busy time counts the prefills this scheduler routed (from the session's expected start), not
decoding or sessions routed by others: it is a queue estimate, not a measurement. It is bounded: one
entry per server of the roster, dropped once past.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llm_swarm.swarm.prefill_cost import choose_prefill_server, hop_prefill_costs, prefill_seconds
from llm_swarm.swarm.route_request import RouteHop
from llm_swarm.swarm.server_info import ServerInfo

MIN_PROMPT = 2  # a one-token prompt is a decode step: nothing to disaggregate (as the client's rule)


class PrefillPlanner:
    """Where each routed session's prompt runs, per hop; see the module docstring."""

    def __init__(self, block_windows: Sequence[int | None] = ()) -> None:
        self.busy_until: dict[str, float] = {}  # peer -> when the prompts routed to it are done
        # each block's sliding window (None: full attention): a sliding block hands off only its ring
        self.block_windows = block_windows

    def plan(
        self,
        hops: Sequence[RouteHop],
        records: Mapping[str, ServerInfo],
        l_in: int,
        batch_size: int,
        start_at: float,
    ) -> tuple[RouteHop, ...]:
        """Prefill hops (the prefill server, the decode hop's blocks) for the hops of `hops` whose
        prompt should run elsewhere than on their decode server; the others run it themselves. The
        chosen servers' busy time grows by the prompt's prefill."""
        self._forget(records, start_at)
        if l_in < MIN_PROMPT:
            return ()
        prefill_servers = {
            peer: info
            for peer, info in records.items()
            if info.routable and info.has_blocks and info.role.serves("prefill")
        }
        chosen_hops = []
        for hop in hops:
            decode = records.get(hop.peer_id)
            if decode is None:
                continue
            blocks = hop.num_blocks
            costs = {
                peer: self._queue(peer, start_at) + seconds
                for peer, seconds in hop_prefill_costs(
                    hop, prefill_servers, l_in, batch_size, block_windows=self.block_windows
                ).items()
            }
            colocated = self._queue(hop.peer_id, start_at) + prefill_seconds(decode, l_in) * blocks
            chosen = choose_prefill_server(costs, colocated)
            runner = chosen if chosen is not None else hop.peer_id
            work = prefill_seconds(records[runner], l_in) * blocks
            self.busy_until[runner] = max(self.busy_until.get(runner, start_at), start_at) + work
            if chosen is not None:
                chosen_hops.append(RouteHop(chosen, hop.start, hop.end))
        return tuple(chosen_hops)

    def _queue(self, peer: str, start_at: float) -> float:
        return max(self.busy_until.get(peer, start_at) - start_at, 0.0)

    def _forget(self, records: Mapping[str, ServerInfo], now: float) -> None:
        for peer in [peer for peer, done in self.busy_until.items() if peer not in records or done < now]:
            del self.busy_until[peer]
