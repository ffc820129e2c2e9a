"""What a client asks the scheduler for and what a route is, as typed objects from the client's link
to the scheduler's core and back.

A route request is a client's id, its measured round trips to the servers it pinged, and the
session's shape; it crosses the wire as `scheduler.proto`'s `RouteRequest` and is rebuilt from it
(after the service checked its bounds) before the core sees it. A route is a chain of `RouteHop`s,
whoever chose it (the scheduler, or the client routing by itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from llm_swarm.swarm.scheduler_api import scheduler_pb2 as pb


@dataclass(frozen=True)
class SessionShape:
    batch_size: int
    max_length: int  # positions each server reserves cache for
    l_in: int  # expected prompt tokens (the prefill part of eq. 1)
    l_out: int  # expected generated tokens


@dataclass(frozen=True)
class RouteHop:
    """One server of a session's chain and the blocks `[start, end)` it processes for the session."""

    peer_id: str
    start: int
    end: int

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    def to_proto(self) -> pb.Hop:
        return pb.Hop(peer_id=self.peer_id, start=self.start, end=self.end)

    @classmethod
    def from_proto(cls, hop: pb.Hop) -> RouteHop:
        return cls(hop.peer_id, hop.start, hop.end)


@dataclass(frozen=True)
class RouteRequest:
    client_id: str  # how the scheduler tells one client's round-trip reports and sessions apart
    rtts: Mapping[str, float]  # seconds, by server peer id
    shape: SessionShape
    task: str = ""  # the kind of work the client declares ("": none); lengths are learned per label
    pushed: bool = False  # a chain session: priced with the servers' round trips to each other

    def to_proto(self) -> pb.RouteRequest:
        return pb.RouteRequest(
            client_id=self.client_id,
            rtts=[pb.ServerRtt(peer_id=peer, rtt=rtt) for peer, rtt in self.rtts.items()],
            l_in=self.shape.l_in,
            l_out=self.shape.l_out,
            batch_size=self.shape.batch_size,
            max_length=self.shape.max_length,
            task=self.task,
            pushed=self.pushed,
        )

    @classmethod
    def from_proto(cls, request: pb.RouteRequest) -> RouteRequest:
        shape = SessionShape(request.batch_size, request.max_length, request.l_in, request.l_out)
        rtts = {entry.peer_id: entry.rtt for entry in request.rtts}
        return cls(request.client_id, rtts, shape, request.task, request.pushed)
