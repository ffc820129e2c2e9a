"""JSON in and out for `swarm-plan` (docs/reference.md section 4): parsing, validation and output shapes.

Validation is strict because a planner fed a typo silently plans for the wrong swarm: unknown or
duplicate keys, wrong types, missing, negative or non-finite values all raise `PlanInputError`
with a one-line message naming the offending field (e.g. `servers[2] (mig1).tau: must be >= 0`).
Which optional server fields a command needs is checked by `placing.require_server_fields`.
`problem_json` writes a typed problem back as problem.json (the scheduler's record for operators).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llm_swarm.scheduler.algorithms.chains import DEFAULT_RHO_BAR
from llm_swarm.scheduler.algorithms.placing import PlanInputError, PlanProblem, server_where
from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec, Span
from llm_swarm.scheduler.algorithms.routing_graph import ChainHop

MODEL_KEYS = {"num_blocks", "block_bytes", "cache_bytes", "hidden_size", "kv_dim", "dtype_bytes"}
SERVER_KEYS = {
    "name", "memory_bytes", "tau", "tau_prefill", "rtt", "rtt_prefill", "tau_c", "tau_p",
    "forward_rps", "network_rps", "inference_rps", "tau_per_session",
}  # fmt: skip
PROBLEM_KEYS = {"model", "servers", "num_requests", "arrival_rate", "l_out", "c", "rho_bar"}
ROUTING_KEYS = PROBLEM_KEYS | {"placement", "client", "l_in", "active"}


@dataclass(frozen=True)
class RoutingProblem:
    """A parsed routing.json: a problem, a placement and one request to route."""

    problem: PlanProblem
    placement: tuple[Span | None, ...]  # aligned with problem.servers
    client: str
    l_out: int
    l_in: int | None = None  # informational: rtt_prefill and tau_prefill are already for l_in
    # server index -> sessions there, as (remaining seconds, cache slots)
    active: Mapping[int, Sequence[tuple[float, int]]] = field(default_factory=dict)


def parse_problem(text: str | bytes) -> PlanProblem:
    return _problem_from(_load_object(text, PROBLEM_KEYS))


def parse_routing(text: str | bytes) -> RoutingProblem:
    document = _load_object(text, ROUTING_KEYS)
    problem = _problem_from(document)
    names = {server.name: j for j, server in enumerate(problem.servers)}
    placement = _placement_from(_required(document, "placement", ""), names, problem.model.num_blocks)
    client = _required(document, "client", "")
    if not isinstance(client, str) or not client:
        raise PlanInputError("client: must be a non-empty string")
    if not any(client in server.rtt for server in problem.servers):
        raise PlanInputError(f"client: no server has an rtt to client {client!r}")
    l_out = _integer(document, "l_out", "", minimum=1, required=True)
    l_in = _integer(document, "l_in", "", minimum=0)
    active = _active_from(document.get("active", {}), names)
    return RoutingProblem(problem, placement, client, l_out, l_in, active)


# -- output shapes -----------------------------------------------------------------------------


def problem_json(problem: PlanProblem) -> dict[str, Any]:
    """problem.json for a typed problem, exact floats: `parse_problem` of it gives the same problem."""
    model = problem.model
    document: dict[str, Any] = {
        "model": {key: getattr(model, key) for key in sorted(MODEL_KEYS) if getattr(model, key) is not None},
        "servers": [_server_json(server) for server in problem.servers],
    }
    optional = {
        "num_requests": problem.num_requests,
        "arrival_rate": problem.arrival_rate,
        "l_out": problem.l_out,
        "c": problem.capacity,
        "rho_bar": problem.rho_bar if problem.rho_bar != DEFAULT_RHO_BAR else None,
    }
    document.update({key: value for key, value in optional.items() if value is not None})
    return document


def _server_json(server: ServerSpec) -> dict[str, Any]:
    document: dict[str, Any] = {"name": server.name, "memory_bytes": server.memory_bytes}
    for key in sorted(SERVER_KEYS - {"name", "memory_bytes"}):
        value = getattr(server, key)
        if value is not None:
            document[key] = dict(value) if isinstance(value, Mapping) else value
    return document


def placement_json(servers: Sequence[ServerSpec], spans: Sequence[Span | None]) -> list[dict[str, Any]]:
    """`[{"name", "start", "end"}]` for every server; no blocks -> start and end null
    (docs/reference.md 4)."""
    return [
        {"name": server.name, "start": span.start if span else None, "end": span.end if span else None}
        for server, span in zip(servers, spans, strict=True)
    ]


def chain_json(servers: Sequence[ServerSpec], hops: Sequence[ChainHop]) -> list[dict[str, Any]]:
    """A route's chain: each server and the blocks `[start, end)` it processes for the request."""
    return [{"name": servers[hop.server].name, "start": hop.start, "end": hop.end} for hop in hops]


def json_number(value: float) -> float | None:
    """JSON has no infinity: an unbounded value (e.g. an unstable queue's response time) is null."""
    return value if math.isfinite(value) else None


def dumps(document: Mapping[str, Any]) -> str:
    return json.dumps(document, allow_nan=False)


# -- parsing helpers ---------------------------------------------------------------------------


def _load_object(text: str | bytes, allowed: set[str]) -> dict[str, Any]:
    try:
        document = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise PlanInputError(f"malformed JSON: {error}") from None
    except RecursionError:
        raise PlanInputError("malformed JSON: nested too deeply") from None
    return _object(document, "input", allowed)


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise PlanInputError(f"duplicate key {key!r}")
        document[key] = value
    return document


def _problem_from(document: dict[str, Any]) -> PlanProblem:
    model = _model_from(_required(document, "model", ""))
    raw_servers = _required(document, "servers", "")
    if not isinstance(raw_servers, list) or not raw_servers:
        raise PlanInputError("servers: must be a non-empty list")
    servers = tuple(_server_from(raw, j) for j, raw in enumerate(raw_servers))
    seen: set[str] = set()
    for server in servers:
        if server.name in seen:
            raise PlanInputError(f"servers: duplicate name {server.name!r}")
        seen.add(server.name)
    rho_bar = _number(document, "rho_bar", "", positive=True)
    if rho_bar is not None and rho_bar >= 1:
        raise PlanInputError(f"rho_bar: must be below 1, got {rho_bar}")
    return PlanProblem(
        model=model,
        servers=servers,
        num_requests=_integer(document, "num_requests", "", minimum=1),
        arrival_rate=_number(document, "arrival_rate", "", positive=True),
        l_out=_integer(document, "l_out", "", minimum=1),
        capacity=_capacity_from(document),
        rho_bar=DEFAULT_RHO_BAR if rho_bar is None else rho_bar,
    )


def _model_from(raw: Any) -> ModelSpec:
    document = _object(raw, "model", MODEL_KEYS)
    hidden_size = _integer(document, "hidden_size", "model", minimum=1)
    kv_dim = _integer(document, "kv_dim", "model", minimum=1)
    if kv_dim is not None and hidden_size is not None and kv_dim > hidden_size:
        raise PlanInputError(f"model.kv_dim: must not exceed hidden_size ({hidden_size}), got {kv_dim}")
    dtype_bytes = _integer(document, "dtype_bytes", "model", minimum=1)
    return ModelSpec(
        num_blocks=_integer(document, "num_blocks", "model", minimum=1, required=True),
        block_bytes=_number(document, "block_bytes", "model", positive=True, required=True),
        cache_bytes=_number(document, "cache_bytes", "model", positive=True, required=True),
        hidden_size=hidden_size,
        kv_dim=kv_dim,
        dtype_bytes=2 if dtype_bytes is None else dtype_bytes,
    )


def _server_from(raw: Any, j: int) -> ServerSpec:
    where = f"servers[{j}]"
    document = _object(raw, where, SERVER_KEYS)
    name = _required(document, "name", where)
    if not isinstance(name, str) or not name:
        raise PlanInputError(f"{where}.name: must be a non-empty string")
    where = server_where(j, name)
    return ServerSpec(
        name=name,
        memory_bytes=_number(document, "memory_bytes", where, required=True),
        tau=_number(document, "tau", where),
        tau_prefill=_number(document, "tau_prefill", where),
        rtt=_rtt_map(document, "rtt", where),
        rtt_prefill=_rtt_map(document, "rtt_prefill", where),
        tau_c=_number(document, "tau_c", where),
        tau_p=_number(document, "tau_p", where),
        forward_rps=_number(document, "forward_rps", where, positive=True),
        network_rps=_number(document, "network_rps", where, positive=True),
        inference_rps=_number(document, "inference_rps", where, positive=True),
        tau_per_session=_number(document, "tau_per_session", where),
    )


def _capacity_from(document: Mapping[str, Any]) -> int | str | None:
    if document.get("c") == "auto":
        return "auto"
    if isinstance(document.get("c"), str):
        raise PlanInputError(f'c: must be a positive integer or "auto", got {document["c"]!r}')
    return _integer(document, "c", "", minimum=1)


def _placement_from(raw: Any, names: Mapping[str, int], num_blocks: int) -> tuple[Span | None, ...]:
    if not isinstance(raw, list):
        raise PlanInputError("placement: must be a list of {name, start, end}")
    spans: list[Span | None] = [None] * len(names)
    placed: set[str] = set()
    for k, entry in enumerate(raw):
        where = f"placement[{k}]"
        document = _object(entry, where, {"name", "start", "end"})
        name = _required(document, "name", where)
        if name not in names:
            raise PlanInputError(f"{where}.name: unknown server {name!r}")
        if name in placed:
            raise PlanInputError(f"{where}.name: server {name!r} placed twice")
        placed.add(name)
        if document.get("start") is None and document.get("end") is None:
            continue  # a server given no blocks
        start = _integer(document, "start", where, minimum=0, required=True)
        end = _integer(document, "end", where, minimum=1, required=True)
        if not start < end <= num_blocks:
            raise PlanInputError(f"{where}: need 0 <= start < end <= {num_blocks}, got [{start}, {end})")
        spans[names[name]] = Span(start, end)
    return tuple(spans)


def _active_from(raw: Any, names: Mapping[str, int]) -> dict[int, list[tuple[float, int]]]:
    if not isinstance(raw, dict):
        raise PlanInputError("active: must map server names to lists of [remaining_seconds, slots]")
    active: dict[int, list[tuple[float, int]]] = {}
    for name, sessions in raw.items():
        if name not in names:
            raise PlanInputError(f"active: unknown server {name!r}")
        if not isinstance(sessions, list):
            raise PlanInputError(f"active.{name}: must be a list of [remaining_seconds, slots]")
        entries = []
        for k, pair in enumerate(sessions):
            where = f"active.{name}[{k}]"
            if not isinstance(pair, list) or len(pair) != 2:
                raise PlanInputError(f"{where}: must be [remaining_seconds, slots]")
            remaining = _check_number(pair[0], f"{where}[0]", positive=False)
            slots = _check_integer(pair[1], f"{where}[1]", minimum=1)
            entries.append((remaining, slots))
        active[names[name]] = entries
    return active


def _rtt_map(document: Mapping[str, Any], key: str, where: str) -> dict[str, float]:
    raw = document.get(key, {})
    if not isinstance(raw, dict):
        raise PlanInputError(f"{_at(where, key)}: must map client names to seconds")
    return {
        client: _check_number(value, f"{_at(where, key)}.{client}", positive=False)
        for client, value in raw.items()
    }


def _object(raw: Any, where: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise PlanInputError(f"{where}: must be a JSON object")
    unknown = sorted(set(raw) - allowed)
    if unknown:
        listed = ", ".join(map(repr, unknown))
        raise PlanInputError(f"{where}: unknown key(s) {listed}; allowed: {', '.join(sorted(allowed))}")
    return raw


def _required(document: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in document or document[key] is None:
        raise PlanInputError(f"{_at(where, key)}: missing")
    return document[key]


def _optional(
    document: Mapping[str, Any], key: str, where: str, required: bool, check: Callable[[Any, str], Any]
) -> Any:
    if required:
        _required(document, key, where)
    if document.get(key) is None:
        return None
    return check(document[key], _at(where, key))


def _number(
    document: Mapping[str, Any], key: str, where: str, positive: bool = False, required: bool = False
) -> Any:
    return _optional(document, key, where, required, lambda value, at: _check_number(value, at, positive))


def _integer(document: Mapping[str, Any], key: str, where: str, minimum: int, required: bool = False) -> Any:
    return _optional(document, key, where, required, lambda value, at: _check_integer(value, at, minimum))


def _check_number(value: Any, where: str, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PlanInputError(f"{where}: must be a number, got {json.dumps(value)}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer beyond float range
        finite = False
    if not finite:
        raise PlanInputError(f"{where}: must be finite, got {value}")
    if value < 0 or (positive and value == 0):
        raise PlanInputError(f"{where}: must be {'> 0' if positive else '>= 0'}, got {value}")
    return float(value)


def _check_integer(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 66.0 is a fine way to write 66
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanInputError(f"{where}: must be an integer, got {json.dumps(value)}")
    if value < minimum:
        raise PlanInputError(f"{where}: must be >= {minimum}, got {value}")
    return value


def _at(where: str, key: str) -> str:
    """A field's path for messages: `servers[0] (mig1).tau`, or just `num_requests` at the top level."""
    return f"{where}.{key}" if where else key
