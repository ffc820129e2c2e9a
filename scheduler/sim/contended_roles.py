"""Prefill and decode roles, and cache hand-offs between servers, in the contended model.

A scenario may give each server a role (`swarm.server_info.ServerRole`: prefill, decode or both) and
the links between servers (round trip, bandwidth). Chains route only through servers that decode
(`decode`, `both`), as the live scheduler and clients route; the placement policies see only those.
Prefill servers hold the whole model when it fits their memory (else a contiguous span paired with
the decode servers' placement, the live scheduler's rule: `scheduler.algorithms.role_placement`),
and take only prompts.

When a session starts, for each hop of its chain the client's rule (`swarm.prefill_cost`, the same
arithmetic as `client/remote.py`) picks a prefill server holding the hop's blocks with room
for the prompt's cache, if its prefill of the prompt (its announced `tau_prefill`, scaled) plus the
hand-off at the link's rate beats the decode server's own prefill (`--disaggregate scheduler`: the
live scheduler's plan, `scheduler/service/prefill_routing.py`, which adds to each side the queue of
prompts it sent that server before). The prompt then runs on that
prefill server's loop; the cache (`tokens x kv bytes per token per block x blocks`) crosses the
link at its bandwidth, streamed in `stream_chunk`-token parts while the prompt runs (the servers'
`--prefill-chunk`, `HandOff.follow`), so after the prompt's pass only what its compute could not
hide is left (`swarm.prefill_cost.streamed_seconds`, with the prefill server's announced prefill
time), plus a round trip between the two servers (the push stream's last acknowledgement); every
such hop at once, each over its own link. With `stream_chunk=0` (clients before streaming) the whole
transfer comes after the prompt, plus a client round trip to the prefill server (its `HandOff`
request and `HandedOff` answer). A prefill server holds the prompt's cache from the session's start until its
hand-off is done. Links are not shared: concurrent hand-offs over one link each get its bandwidth.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from llm_swarm.scheduler.algorithms.problem import Span
from llm_swarm.scheduler.algorithms.role_placement import prefill_blocks
from llm_swarm.scheduler.algorithms.role_placement import prefill_spans as placed_prefill_spans
from llm_swarm.scheduler.algorithms.routing_graph import ChainHop
from llm_swarm.scheduler.sim.prefill import PrefillModel
from llm_swarm.scheduler.sim.scenarios import CLIENT, Link, Scenario
from llm_swarm.scheduler.sim.workload import Request
from llm_swarm.swarm.prefill_cost import (
    STREAM_CHUNK_TOKENS,
    choose_prefill_server,
    disaggregated_seconds,
    prompt_chunks,
    scaled_prefill_seconds,
    streamed_seconds,
)
from llm_swarm.swarm.server_info import ServerRole

SCHEDULER_POLICY = "scheduler"  # `--disaggregate scheduler`: the live scheduler's queue-aware plan


def parse_roles(text: str, count: int) -> tuple[ServerRole, ...]:
    """`swarm-sim --roles`: one role per server, comma-separated, `role*n` repeating one n times
    (e.g. `prefill*2,both*7`)."""
    roles: list[ServerRole] = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        name, _, times = item.partition("*")
        try:
            role = ServerRole(name.strip())
            repeat = int(times) if times else 1
        except ValueError:
            raise ValueError(
                f"--roles: {item!r} is not ROLE or ROLE*N with ROLE one of prefill, decode, both"
            ) from None
        if repeat < 1:
            raise ValueError(f"--roles: {item!r} repeats a role fewer than once")
        roles.extend([role] * repeat)
    if len(roles) != count:
        raise ValueError(f"--roles gives {len(roles)} roles for {count} servers")
    if not any(role.serves("decode") for role in roles):
        raise ValueError("--roles: no server decodes (every role is prefill)")
    return tuple(roles)


def subset(scenario: Scenario, indices: Sequence[int]) -> Scenario:
    """The scenario restricted to `indices` (in that order): servers, pings, names, prefill lines."""
    p = scenario.prefill
    return dataclasses.replace(
        scenario,
        servers=tuple(scenario.servers[j] for j in indices),
        ping_rtt=tuple(scenario.ping_rtt[j] for j in indices),
        gpu_names=tuple(scenario.gpu_names[j] for j in indices),
        prefill=PrefillModel(
            tuple(p.tau_base[j] for j in indices),
            tuple(p.tau_per_token[j] for j in indices),
            tuple(p.rtt_base[j] for j in indices),
            tuple(p.rtt_per_token[j] for j in indices),
        ),
        roles=None,
        server_links=None,
    )


@dataclass
class _PrefillServer:
    index: int  # in the contended model's server list
    span: Span
    room_bytes: float  # cache bytes left for prompts once its blocks are loaded
    held: list[tuple[float, float]]  # (release time, bytes) of the prompts it holds


class Disaggregation:
    """The per-session prefill plan and the hand-offs' time (see the module docstring).

    Servers are numbered as the contended model numbers them: the decode servers first (the engine's
    indices), then the prefill servers. `announced[k] = (tau_prefill, prefill_tokens, tau)` is what
    server k announces; `links[a][b]` joins servers a and b.
    """

    def __init__(
        self,
        num_decode: int,
        prefill_spans: Sequence[Span],
        room_bytes: Sequence[float],
        announced: Sequence[tuple[float, int, float]],
        links: Sequence[Sequence[Link]],
        client_rtt: Sequence[float],
        kv_token_bytes: float,
        policy: str = "auto",
        stream_chunk: int = STREAM_CHUNK_TOKENS,
    ):
        total = num_decode + len(prefill_spans)
        if len(announced) != total or len(links) != total or len(client_rtt) != total:
            raise ValueError("roles: announcements, links and client round trips must cover every server")
        if len(room_bytes) != len(prefill_spans):
            raise ValueError("roles: one cache room per prefill server")
        # "scheduler": the client's "auto" rule with the queue of prompts planned before added
        self.queue_aware = policy == SCHEDULER_POLICY
        policy = "auto" if self.queue_aware else policy
        choose_prefill_server({}, 0.0, policy)  # checks the policy's name
        self.num_decode, self.policy = num_decode, policy
        self.busy_until: dict[int, float] = {}  # "scheduler": server -> when its planned prompts end
        self.announced, self.links, self.client_rtt = list(announced), links, list(client_rtt)
        self.kv_token_bytes = kv_token_bytes
        self.stream_chunk = stream_chunk  # tokens per streamed part of a prompt's cache (0: after it)
        # the first token waits for the hand-offs (clients before 2026-11-26); else only the second
        self.first_token_waits = False
        self.prefill = [
            _PrefillServer(num_decode + k, span, room, [])
            for k, (span, room) in enumerate(zip(prefill_spans, room_bytes, strict=True))
        ]

    def _per_block(self, server: int, tokens: int) -> float:
        tau_prefill, prefill_tokens, tau = self.announced[server]
        return scaled_prefill_seconds(tau_prefill, prefill_tokens, tau, tokens)

    def plan(self, request: Request, hops: Sequence[ChainHop], now: float) -> tuple[int, ...]:
        """Per hop, the server its prompt runs on (the hop's own, or a prefill server's index)."""
        tokens = request.l_in
        chosen = []
        for hop in hops:
            blocks = hop.num_blocks
            prompt_bytes = tokens * self.kv_token_bytes * blocks
            costs: dict[int, float] = {}
            for server in self.prefill:
                server.held = [(t, b) for t, b in server.held if t > now]
                if server.span.start <= hop.start and hop.end <= server.span.end:
                    if server.room_bytes - sum(b for _, b in server.held) >= prompt_bytes:
                        link = self.links[server.index][hop.server].bandwidth_bps
                        costs[server.index] = self._queue(server.index, now) + disaggregated_seconds(
                            self._per_block(server.index, tokens),
                            blocks,
                            prompt_bytes,
                            link / 8,
                            prompt_chunks(tokens, self.stream_chunk),
                        )
            colocated = self._queue(hop.server, now) + self._per_block(hop.server, tokens) * blocks
            # clients spread over alike prefill servers by their session id; the scheduler's plan
            # spreads by its queues instead
            spread = None if self.queue_aware else request.id
            best = choose_prefill_server(costs, colocated, self.policy, spread) if tokens >= 2 else None
            if self.queue_aware:
                runner = hop.server if best is None else best
                start = max(self.busy_until.get(runner, now), now)
                self.busy_until[runner] = start + self._per_block(runner, tokens) * blocks
            if best is None:
                chosen.append(hop.server)
                continue
            self.prefill[best - self.num_decode].held.append((math.inf, prompt_bytes))
            chosen.append(best)
        return tuple(chosen)

    def _queue(self, server: int, now: float) -> float:
        return max(self.busy_until.get(server, now) - now, 0.0) if self.queue_aware else 0.0

    def handoff_seconds(
        self, request: Request, hops: Sequence[ChainHop], prompt_servers: Sequence[int], now: float
    ) -> float:
        """The hand-offs after the prompt's pass, all hops at once as the client starts them (each over
        its own link); frees each prompt's cache when its own hand-off ends. Returns the longest."""
        elapsed = 0.0
        for hop, source in zip(hops, prompt_servers, strict=True):
            if source == hop.server:
                continue
            link = self.links[source][hop.server]
            cache_bytes = request.l_in * self.kv_token_bytes * hop.num_blocks
            transfer = 8 * cache_bytes / link.bandwidth_bps
            if self.stream_chunk:  # streamed during the prompt: what its pass could not hide is left
                # (the prompt's compute as announced; its order went before the prompt, no round trip)
                prefill = self._per_block(source, request.l_in) * hop.num_blocks
                chunks = prompt_chunks(request.l_in, self.stream_chunk)
                seconds = link.rtt + streamed_seconds(prefill, transfer, chunks) - prefill
            else:
                seconds = self.client_rtt[source] + link.rtt + transfer
            elapsed = max(elapsed, seconds)
            held = self.prefill[source - self.num_decode].held
            for k, (release, size) in enumerate(held):
                if math.isinf(release) and size == cache_bytes:
                    held[k] = (now + seconds, size)
                    break
        return elapsed


def prefill_spans(
    scenario: Scenario, indices: Sequence[int], decode: Mapping[str, Span] | None = None
) -> tuple[list[Span], list[float]]:
    """Spans of the prefill servers `indices` and their prompt room, by the scheduler's rule
    (`scheduler.algorithms.role_placement`): the whole model where it fits with room for one
    nominal prompt, else as many blocks as fit, paired with the `decode` servers' spans (by name)
    over the scenario's links, or laid one after another without them."""
    model, l_in = scenario.model, scenario.l_in
    width = model.kv_dim or model.hidden_size or 0
    prompt_per_block = 2 * width * model.dtype_bytes * l_in
    names = [scenario.servers[j].name for j in indices]
    memory = [scenario.servers[j].memory_bytes for j in indices]
    blocks = [prefill_blocks(m, model.num_blocks, model.block_bytes, prompt_per_block) for m in memory]
    spans = placed_prefill_spans(names, blocks, model.num_blocks, decode, link_rates(scenario))
    rooms = [
        scenario.servers[j].memory_bytes - model.block_bytes * span.length
        for j, span in zip(indices, spans, strict=True)
    ]
    return spans, rooms


def link_rates(scenario: Scenario) -> dict[str, dict[str, float]]:
    """The scenario's server-to-server links by name, in bytes/s (the planners' unit)."""
    if scenario.server_links is None:
        return {}
    names = [server.name for server in scenario.servers]
    return {
        names[a]: {names[b]: link.bandwidth_bps / 8 for b, link in enumerate(row) if a != b}
        for a, row in enumerate(scenario.server_links)
    }


def uniform_links(count: int, rtt: float, bandwidth_bps: float) -> tuple[tuple[Link, ...], ...]:
    """Every pair of servers joined by the same link (a server to itself: free)."""
    if not (rtt >= 0 and bandwidth_bps > 0):
        raise ValueError("server links need a round trip >= 0 and a positive bandwidth")
    same = Link(0.0, math.inf)
    return tuple(
        tuple(same if a == b else Link(rtt, bandwidth_bps) for b in range(count)) for a in range(count)
    )


def _by_role(scenario: Scenario) -> tuple[list[int], list[int]]:
    """(indices of the servers that decode, indices of the prefill-only servers)."""
    roles = scenario.roles or tuple(ServerRole.BOTH for _ in scenario.servers)
    if len(roles) != len(scenario.servers):
        raise ValueError("the scenario gives a role count different from its server count")
    decode = [j for j, role in enumerate(roles) if ServerRole(role).serves("decode")]
    prefill = [j for j, role in enumerate(roles) if ServerRole(role) == ServerRole.PREFILL]
    return decode, prefill


def decoding(scenario: Scenario) -> Scenario:
    """The scenario of the servers that decode (the scenario itself when every server does): what
    the placement policies and routing see."""
    decode, _prefill = _by_role(scenario)
    return subset(scenario, decode) if len(decode) < len(scenario.servers) else scenario


def split(
    scenario: Scenario,
    policy: str = "auto",
    stream_chunk: int = STREAM_CHUNK_TOKENS,
    decode_spans: Sequence[Span | None] | None = None,
) -> tuple[Scenario, list[int], Disaggregation | None]:
    """(the scenario of the servers that decode, the contended model's order of the scenario's
    servers, the prefill plan or None when no server has the prefill role). `stream_chunk`: see
    `Disaggregation` (0: caches handed off after the prompt, as clients did before streaming).
    `decode_spans`: the placement of the servers that decode (in their order), which prefill servers
    that cannot hold the whole model pair with; None: not placed yet."""
    decode, prefill = _by_role(scenario)
    order = decode + prefill
    if not prefill:
        return decoding(scenario), order, None
    if scenario.server_links is None:
        raise ValueError("prefill servers need the links between servers (--link-mbps and --link-rtt-ms)")
    placed = None
    if decode_spans is not None:
        placed = {
            scenario.servers[j].name: span
            for j, span in zip(decode, decode_spans, strict=True)
            if span is not None
        }
    spans, rooms = prefill_spans(scenario, prefill, placed)
    model = scenario.model
    width = model.kv_dim or model.hidden_size or 0
    announced = [(s.tau_prefill, scenario.l_in, s.tau) for s in (scenario.servers[j] for j in order)]
    links = [[scenario.server_links[a][b] for b in order] for a in order]
    client_rtt = [scenario.servers[j].rtt[CLIENT] for j in order]
    plan = Disaggregation(
        len(decode),
        spans,
        rooms,
        announced,
        links,
        client_rtt,
        2 * width * model.dtype_bytes,
        policy,
        stream_chunk,
    )
    return subset(scenario, decode), order, plan
