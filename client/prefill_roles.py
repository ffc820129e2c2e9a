"""Prefill and decode on different servers (HexGen-2, Splitwise, DistServe): a session's prompt runs on
servers started with `--role prefill`, and their caches are handed to the decode servers the session
routed to (`swarm.handoff_wire`), which then generate.

Per hop of the decode chain, the client looks for a prefill server holding the hop's blocks and
disaggregates where it pays (`ClientOptions.disaggregate = "auto"`): the prompt's upload is the same
either way, so a prefill server is used when its prefill of the prompt plus the cache's hand-off to
the decode server (at the link rate measured before, by the client or announced by the prefill server;
0 when unmeasured, the hand-off's own limit then bounds the loss) is shorter than the decode server's
own prefill. "always" uses any prefill server there is, "never" none. Any failure falls back to what
colocated serving does: the decode server computes the prompt itself (a replay of the prompt).

`DisaggregatedPrefill` is a part of `RemoteBlockSession` (client/remote.py).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence

from client.stream import ServerStream, StepInput
from swarm.handoff_wire import HandOff
from swarm.prefill_cost import announced_rate, choose_prefill_server, hop_prefill_costs, prefill_seconds
from swarm.route_request import RouteHop

logger = logging.getLogger(__name__)

MIN_PROMPT = 2  # a one-token prompt is a decode step: nothing to disaggregate


class DisaggregatedPrefill:
    _prefill: dict[int, ServerStream]  # decode chain index -> the prefill stream that takes its prompt
    # the prompt's hand-offs, still crossing after its output was returned (`_prefill_step`)
    _handing: asyncio.Future | None = None

    def _scheduled_choice(self, chain: list[RouteHop], planned: Sequence[RouteHop]) -> dict[int, str]:
        """The scheduler's plan for the prompt (`RouteReply.prefill`: a prefill server per hop it
        chose); entries that name no known prefill server holding their hop's blocks are ignored
        (those hops prefill on their own server). `disaggregate="never"` keeps every prompt on its
        decode server; "always" uses the client's own rule."""
        policy = self.connection.options.disaggregate
        if policy == "never" or self.shape.l_in < MIN_PROMPT:
            return {}
        if policy == "always":
            return self._choose_prefill(chain)
        prefill_servers = self.connection.routable_among(self.connection.known_servers, "prefill")
        index_of = {(hop.start, hop.end): index for index, hop in enumerate(chain)}
        chosen: dict[int, str] = {}
        ignored = []
        for hop in planned:
            info = prefill_servers.get(hop.peer_id)
            index = index_of.get((hop.start, hop.end))
            if index is None or info is None or not (info.start <= hop.start and hop.end <= info.end):
                ignored.append(hop)
                continue
            chosen[index] = hop.peer_id
        if ignored:  # one line, however many entries a faulty scheduler sends
            logger.info(
                "session %s: ignoring %d of the scheduler's %d prefill hops (e.g. %s)",
                self.session_id[:8],
                len(ignored),
                len(planned),
                ignored[0],
            )
        return chosen

    def _choose_prefill(self, chain: list[RouteHop]) -> dict[int, str]:
        """The client's own rule: per hop, the prefill server whose prefill plus hand-off beats the
        decode server's own prefill (`swarm.prefill_cost`), if any."""
        connection = self.connection
        policy = connection.options.disaggregate
        if policy == "never" or self.shape.l_in < MIN_PROMPT:
            return {}
        servers = connection.known_servers
        prefill_servers = connection.routable_among(servers, "prefill")
        chosen: dict[int, str] = {}
        measured = connection.link_rates

        def link_rate(peer: str, info, decode_peer: str) -> float | None:
            return measured.get((peer, decode_peer)) or announced_rate(info, decode_peer)

        for index, hop in enumerate(chain):
            blocks = hop.end - hop.start
            costs = hop_prefill_costs(hop, prefill_servers, self.shape.l_in, self.shape.batch_size, link_rate)
            if not costs or hop.peer_id not in servers:
                continue
            colocated = prefill_seconds(servers[hop.peer_id], self.shape.l_in) * blocks
            peer = choose_prefill_server(costs, colocated, policy, spread=self.session_id)
            if peer is not None:
                chosen[index] = peer
        return chosen

    async def _open_prefill(self, chain: list[RouteHop], chosen: dict[int, str]) -> dict[int, ServerStream]:
        """Sessions on the chosen prefill servers for those hops' prompts, all opened at once (and at
        once with the decode chain: `RemoteBlockSession._open_with_prefill`); a server that will not
        take one leaves its hop to prefill on its decode server (opened to receive a cache that then
        never comes, it serves the session as any other)."""
        streams = {
            index: ServerStream(
                RouteHop(peer, chain[index].start, chain[index].end), uuid.uuid4().hex, self.shape
            )
            for index, peer in chosen.items()
        }
        results = await asyncio.gather(
            *(stream.open(self.connection) for stream in streams.values()), return_exceptions=True
        )
        plan: dict[int, ServerStream] = {}
        for (index, stream), result in zip(streams.items(), results, strict=True):
            if isinstance(result, Exception):  # that server will not take it: its decode server will
                stream.close()
                logger.info(
                    "session %s: no prefill on %s (%s)", self.session_id[:8], stream.hop.peer_id[-8:], result
                )
            elif isinstance(result, BaseException):
                for other in streams.values():
                    other.close()
                raise result
            else:
                plan[index] = stream
        return plan

    def _adopt_prefill(self, plan: dict[int, ServerStream], how: str) -> None:
        """The session's first chain is open: its prompt goes to `plan`'s prefill servers (`how` says
        who chose them, for the log)."""
        self._prefill = plan
        if plan:
            logger.info(
                "session %s: its prompt goes to prefill servers %s (%s)",
                self.session_id[:8],
                ", ".join(f"{s.hop.peer_id[-6:]}[{s.hop.start}:{s.hop.end}]" for s in plan.values()),
                how,
            )

    async def _handed_off(self) -> None:
        """Wait until the last prompt's hand-offs are done (the chain is then the decode servers);
        raises what a hand-off raised that no fallback could handle. Every later step, and the
        session's end, waits here first."""
        handing, self._handing = self._handing, None
        if handing is not None:
            await handing

    async def _prefill_step(self, step: StepInput):
        """The session's prompt through the prefill servers planned for it (the other hops as usual),
        then each prefill server's cache handed to its hop's decode server.

        The prompt's output (the first token's hidden states) returns as soon as the prefill servers
        computed it; the hand-offs finish in the background (`_handing`) while the client samples
        the first token, and the next step waits for them (`_handed_off`). So the first token does
        not wait for the last part of the cache to cross (Splitwise and DistServe answer the first
        token from the prefill instance too); the second one does, if it is not there yet.
        `ClientOptions.first_token_before_handoff = False` waits for the hand-offs here instead."""
        plan, self._prefill = self._prefill, {}
        if step.position != 0 or step.hidden.shape[1] < MIN_PROMPT:  # not a prompt: nothing to do
            for stream in plan.values():
                stream.close()
            return await self._chain_step(step)
        decode = {index: self.streams[index] for index in plan}
        for index, stream in plan.items():
            self.streams[index] = stream
        # each prefill server pushes its cache while the prompt runs (Splitwise's streaming): asked
        # before the step, it sends every chunk of the prompt's cache as soon as it is computed
        orders = {}
        for index, stream in plan.items():
            target = decode[index]
            info = self.connection.known_servers.get(stream.hop.peer_id)
            if info is None or not info.prefill_chunk:  # it predates streaming: a hand-off after the prompt
                continue
            try:
                allowed = self._handoff_allowed(stream, target, step.end)
                orders[index] = await stream.follow(
                    target, target.cache_token, allowed, step.end, self._timeout
                )
            except Exception as error:  # the step after it fails over this hop as any failed step does
                logger.info("session %s: no streamed hand-off (%s)", self.session_id[:8], error)
        try:
            output = await self._chain_step(step)
        except BaseException:
            for index, stream in plan.items():
                if self.streams[index] is stream:
                    self.streams[index] = decode[index]
                stream.close()
            raise
        self._handing = asyncio.ensure_future(self._finish_handoffs(plan, decode, orders))
        if not self.connection.options.first_token_before_handoff:
            await self._handed_off()
        return output

    async def _finish_handoffs(
        self, plan: dict[int, ServerStream], decode: dict[int, ServerStream], orders: dict[int, HandOff]
    ) -> None:
        """Each prefill server's cache to its hop's decode server (or the fallbacks); then the chain
        is the decode servers."""
        # every hop's cache crosses its own link at once: one hop's hand-off never waits for another's
        handed = [
            index for index, stream in enumerate(self.streams) if index in plan and stream is plan[index]
        ]
        results = await asyncio.gather(
            *(self._hand_prefill(self.streams[index], decode[index], orders.get(index)) for index in handed),
            return_exceptions=True,
        )
        by_hop = dict(zip(handed, results, strict=True))
        failure = next((result for result in results if isinstance(result, BaseException)), None)
        if failure is not None:  # only a fatal error gets here (others fell back to replay or failover)
            for result in results:
                for stream in result if not isinstance(result, BaseException) else ():
                    stream.close()
            raise failure
        chain: list[ServerStream] = []
        for index, stream in enumerate(self.streams):
            if index in by_hop:
                chain += by_hop[index]
            else:
                if index in decode:  # its prompt failed over elsewhere: the reserved decode session goes
                    decode[index].close()
                chain.append(stream)
        self.streams = chain

    @property
    def _timeout(self) -> float:
        return self.connection.options.request_timeout

    def _handoff_allowed(self, prefill: ServerStream, target: ServerStream, length: int) -> float:
        """How long a hand-off of `length` positions may take: the decode server's own prefill of them
        (what a replay costs instead), at least 0.5 s; the request timeout if it is unknown."""
        info = self.connection.known_servers.get(target.hop.peer_id)
        if info is None:
            return self._timeout
        return max(prefill_seconds(info, length) * (target.hop.end - target.hop.start), 0.5)

    async def _hand_prefill(
        self, prefill: ServerStream, target: ServerStream, order: HandOff | None
    ) -> list[ServerStream]:
        """`target` holding `prefill`'s cache: handed off (streamed during the prompt under `order`,
        else pushed now), else rebuilt by replay, else a failover."""
        timeout = self._timeout
        how = "hand-off" if order is None else "hand-off streamed during the prompt"
        try:
            if order is not None:
                reply = await prefill.handed_off(order, target, timeout)
            else:
                allowed = self._handoff_allowed(prefill, target, prefill.length)
                reply = await prefill.hand_off(target, target.cache_token, allowed, timeout)
            rate = reply.bytes / max(reply.seconds, 1e-6)
            self.connection.link_rates[(prefill.hop.peer_id, target.hop.peer_id)] = rate
        except Exception as error:
            how = f"replay ({error})"
            try:
                await self._catch_up(target, prefill.history, last=True)
            except Exception as replay_error:
                logger.info("session %s: replay of the prompt failed (%s)", self.session_id[:8], replay_error)
                target.close()
                prefill.close()
                return await self._replace(prefill)
        logger.info(
            "session %s: prompt of blocks %d:%d on prefill server %s, cache to %s by %s",
            self.session_id[:8],
            target.hop.start,
            target.hop.end,
            prefill.hop.peer_id[-8:],
            target.hop.peer_id[-8:],
            how,
        )
        prefill.close()
        return [target]
