"""Which servers take prompts only: the scheduler's placement of prefill/decode roles, pure.

Servers may run as `prefill` (prompts only, their caches handed to decode servers), `decode` or
`both` (colocated). A prefill role pays where a server prefills fast for its decode speed and its
prompts' caches cross a fast link to servers that decode the same blocks (DistServe: the two phases
of a stage sit where the cache crosses a fast link; HexGen-2: caches routed over the best links).

The planner, given the servers (`tau`, `tau_prefill`), the block placement, the server-to-server
link rates (bytes/s; a link not measured counts as none), the cache bytes per token per block and
the workload:

1. orders the placed servers by their prefill-to-decode speed ratio `l_in * tau / tau_prefill`
   (highest first: the ones relatively best at prompts);
2. moves them to `prefill` one by one (`candidates`), skipping a server when that would leave a
   block that no decode-capable server holds, or when some block of its span has no decode-capable
   holder whose link from it pays (`hand_off_pays`: its prefill plus the cache's transfer beats the
   decode server's own prefill; an unknown link never pays, so without measured links nothing
   moves);
3. scores all-`both` (colocated) and each greedy prefix with the caller's `evaluate` (the contended
   simulator's goodput, `scheduler.sim.role_planning`), stopping after `patience` prefixes in a row
   that do not improve (default: none, every prefix is scored: a router that still finds a fast
   colocated server keeps routing there, so roles often pay only once every such server prefills),
   and keeps colocated unless a prefix scores strictly higher by `min_gain`.

Servers not moved keep `both`: in the client's rule a `decode` server differs from a `both` one only
in refusing other sessions' prompts, which no plan here asks of it. `hand_off_targets` is DistServe's
pairing: a prefill server's decode servers for each block, over its fastest links first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from llm_swarm.scheduler.algorithms.problem import Placement, ServerSpec

PREFILL, DECODE, BOTH = "prefill", "decode", "both"
ROLE_NAMES = (PREFILL, DECODE, BOTH)

Roles = tuple[str, ...]  # one role per server, in the server list's order
Links = Mapping[str, Mapping[str, float]]  # sender name -> receiver name -> bytes/s


@dataclass(frozen=True)
class RoleWorkload:
    """The workload the roles are planned for: nominal prompt and answer lengths, arrival rate."""

    l_in: int
    l_out: int
    rate: float | None = None  # requests/s; None: not known (only the evaluator reads it)

    def __post_init__(self) -> None:
        if self.l_in < 1 or self.l_out < 1:
            raise ValueError(f"role planning needs l_in, l_out >= 1, got {self.l_in}, {self.l_out}")
        if self.rate is not None and not 0 < self.rate < math.inf:
            raise ValueError(f"role planning needs a positive arrival rate, got {self.rate}")


@dataclass(frozen=True)
class RoleInputs:
    servers: Sequence[ServerSpec]
    placement: Placement  # one span (or None) per server
    num_blocks: int
    links: Links
    kv_token_bytes: float  # attention cache bytes per token per block (keys and values)
    workload: RoleWorkload

    def __post_init__(self) -> None:
        if len(self.placement) != len(self.servers):
            raise ValueError(f"{len(self.placement)} spans for {len(self.servers)} servers")
        if self.num_blocks < 1 or not self.kv_token_bytes > 0:
            raise ValueError("role planning needs at least one block and positive cache bytes per token")
        names = [s.name for s in self.servers]
        if len(set(names)) != len(names):
            raise ValueError("server names must be unique")
        for sender, row in self.links.items():
            for receiver, rate in row.items():
                if not rate >= 0:  # also rejects nan
                    raise ValueError(f"link {sender} -> {receiver}: rate must be >= 0 bytes/s, got {rate}")


@dataclass(frozen=True)
class RolePlan:
    roles: Roles
    targets: Mapping[str, tuple[str, ...]]  # prefill server -> its decode servers, fastest link first
    score: float  # the evaluator's score of `roles` (nan when nothing was evaluated)
    colocated_score: float
    evaluated: tuple[tuple[Roles, float], ...] = field(default=())
    reason: str = ""

    @property
    def colocated(self) -> bool:
        return all(role == BOTH for role in self.roles)

    def describe(self, names: Sequence[str]) -> str:
        """One line: who prefills (and where its caches go), or colocated."""
        if self.colocated:
            return f"colocated (every server both): {self.reason}"
        parts = [
            f"{name} -> {','.join(self.targets.get(name, ())) or '?'}"
            for name, role in zip(names, self.roles, strict=True)
            if role == PREFILL
        ]
        return f"prefill: {'; '.join(parts)} ({self.reason})"


def check_role(text: str) -> str | None:
    """The role named by `text` (case and spaces ignored; empty: none), or None when it names none."""
    role = text.strip().lower()
    return role if role in ROLE_NAMES else None


def prefill_ratio(server: ServerSpec, l_in: int) -> float:
    """`l_in * tau / tau_prefill`: prompt tokens per second over decode tokens per second (0 unknown)."""
    if not server.tau or not server.tau_prefill:
        return 0.0
    return l_in * server.tau / server.tau_prefill


def link_rate(links: Links, sender: str, receiver: str) -> float | None:
    """The measured rate from `sender` to `receiver` in bytes/s (None: not measured, or 0)."""
    rate = links.get(sender, {}).get(receiver)
    return rate if rate else None


def hand_off_pays(inputs: RoleInputs, prefill: int, decode: int, blocks: int) -> bool:
    """Whether `prefill`'s prompt over `blocks` blocks plus the cache's transfer to `decode` beats
    `decode`'s own prefill (the client's rule, `swarm.prefill_cost`; an unknown link never pays)."""
    p, d = inputs.servers[prefill], inputs.servers[decode]
    rate = link_rate(inputs.links, p.name, d.name)
    if rate is None or not p.tau_prefill or not d.tau_prefill:
        return False
    transfer = inputs.workload.l_in * inputs.kv_token_bytes * blocks / rate
    return p.tau_prefill * blocks + transfer < d.tau_prefill * blocks


def decode_covered(inputs: RoleInputs, roles: Roles) -> bool:
    """Whether every block is held by at least one server that decodes (`decode` or `both`)."""
    covered = [False] * inputs.num_blocks
    for span, role in zip(inputs.placement, roles, strict=True):
        if span is not None and role != PREFILL:
            for block in range(span.start, min(span.end, inputs.num_blocks)):
                covered[block] = True
    return all(covered)


def hand_off_targets(inputs: RoleInputs, roles: Roles, prefill: int) -> tuple[str, ...]:
    """DistServe's pairing: the decode-capable servers holding blocks of `prefill`'s span whose link
    from it pays, fastest link first (empty when its span has a block without one)."""
    span = inputs.placement[prefill]
    if span is None:
        return ()
    name = inputs.servers[prefill].name
    found: list[tuple[float, str]] = []
    reached = [False] * span.length
    for j, (other, role) in enumerate(zip(inputs.placement, roles, strict=True)):
        if j == prefill or other is None or role == PREFILL:
            continue
        start, end = max(span.start, other.start), min(span.end, other.end)
        if start >= end or not hand_off_pays(inputs, prefill, j, end - start):
            continue
        for block in range(start, end):
            reached[block - span.start] = True
        found.append(
            (-(link_rate(inputs.links, name, inputs.servers[j].name) or 0.0), inputs.servers[j].name)
        )
    if not all(reached):
        return ()
    return tuple(receiver for _, receiver in sorted(found))


def candidates(inputs: RoleInputs, max_prefill: int | None = None) -> list[Roles]:
    """The greedy prefixes of step 2 of the module docstring (colocated not included)."""
    l_in = inputs.workload.l_in
    order = sorted(
        (
            j
            for j, span in enumerate(inputs.placement)
            if span is not None and prefill_ratio(inputs.servers[j], l_in)
        ),
        key=lambda j: (-prefill_ratio(inputs.servers[j], l_in), inputs.servers[j].name),
    )
    roles: list[str] = [BOTH] * len(inputs.servers)
    found: list[Roles] = []
    limit = len(inputs.servers) if max_prefill is None else max_prefill
    for j in order:
        if len(found) >= limit:
            break
        trial = tuple(PREFILL if k == j else role for k, role in enumerate(roles))
        if not decode_covered(inputs, trial) or not hand_off_targets(inputs, trial, j):
            continue
        # a server already moved must still reach decode servers once this one stops decoding
        if any(trial[k] == PREFILL and not hand_off_targets(inputs, trial, k) for k in range(len(trial))):
            continue
        roles = list(trial)
        found.append(trial)
    return found


def targets_of(inputs: RoleInputs, roles: Roles) -> dict[str, tuple[str, ...]]:
    return {
        inputs.servers[j].name: hand_off_targets(inputs, roles, j)
        for j, role in enumerate(roles)
        if role == PREFILL
    }


def plan_roles(
    inputs: RoleInputs,
    evaluate: Callable[[Roles], float],
    min_gain: float = 0.0,
    max_prefill: int | None = None,
    patience: int | None = None,
) -> RolePlan:
    """Colocated unless a greedy prefix of prefill servers scores higher than colocated by more than
    `min_gain` (a fraction) under `evaluate` (higher is better, e.g. goodput in requests/s)."""
    if not 0 <= min_gain < math.inf:
        raise ValueError(f"min_gain must be >= 0, got {min_gain}")
    if patience is not None and patience < 1:
        raise ValueError(f"patience must be >= 1, got {patience}")
    colocated: Roles = (BOTH,) * len(inputs.servers)
    options = candidates(inputs, max_prefill)
    if not options:
        return RolePlan(
            colocated, {}, math.nan, math.nan, (),
            "no server's prompts can move: no decode server of its blocks over a measured link that pays",
        )  # fmt: skip
    base = evaluate(colocated)
    evaluated: list[tuple[Roles, float]] = [(colocated, base)]
    best, best_score, stale = colocated, base, 0
    for roles in options:
        score = evaluate(roles)
        evaluated.append((roles, score))
        if score > best_score:
            best, best_score, stale = roles, score, 0
            continue
        stale += 1
        if patience is not None and stale >= patience:
            break
    if best != colocated and best_score > base * (1 + min_gain):
        gain = best_score / base if base > 0 else math.inf
        reason = f"roles score {best_score:.3g} against colocated {base:.3g} ({gain:.2f}x)"
        return RolePlan(best, targets_of(inputs, best), best_score, base, tuple(evaluated), reason)
    reason = f"no role plan beats colocated ({base:.3g}; best prefix {max(s for _, s in evaluated[1:]):.3g})"
    return RolePlan(colocated, {}, base, base, tuple(evaluated), reason)
