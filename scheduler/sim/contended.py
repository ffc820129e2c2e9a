"""Contended servers: sessions advance token by token through the servers' own loops.

Sun et al.'s model (`scheduler.sim.discrete_events` without a service) fixes a request's timeline by eq. 1 the
moment it starts: a server's per-block time never depends on what else it runs. Here every server
runs the live server's iteration loop (`server/engine.py`):

- concurrent sessions' single-token steps over the same block range run as one *decode iteration*,
  collected over the batching window (`--batch-wait-ms`, 2 ms) unless every recently decoding
  session is already there; an iteration of `rows` rows over `q` blocks costs
  `q * (fixed + per_row*rows + per_context*context)` (`scheduler.sim.server_costs`);
- a prompt is a *prefill* step, run alone, chunk by chunk when longer than `--prefill-chunk`; which
  of a waiting prefill and waiting decode steps runs next is the live server's own rule
  (`swarm.step_scheduler`: Pang et al.'s with its caps), so a prefill delays the decode iterations
  behind it;
- the accelerator is `serial` (one iteration at a time, the default emulated delay and a real GPU)
  or `overlap` (each session's step takes its own device time whatever else runs, as
  `--compute-delay-overlap` and Sun et al.); a server's `host` part (the emulation's CPU forward)
  always runs one iteration at a time on its compute thread;
- a step reaches its server half a round trip after the client sends it and its result reaches the
  client half a round trip after the server is done (the prompt's round trip `t_prefill_cj`, a
  token's `t_cj`, as in eq. 1); the client sends the next hop's step at once.

So per-token times, TTFT and TPOT come out of the servers' queues. With no contention (one session,
serial, no host part, zero context cost) a request takes exactly eq. 1's time plus the batching
window where the server cannot know the session is alone (`tests/test_sim_contended.py`).

Prefill servers and cache hand-offs (`scheduler.sim.contended_roles`): a session's prompt for a hop may run on
a prefill server, which then hands the cache to the hop's decode server; the hand-offs run after
the prompt's pass, one hop after another (as `client/remote.py` does), and the first token
is the client's once they are done.

One event heap serves the whole simulation (the engine's); each server keeps its own queues and
wakes itself only when it has something to decide, so thousands of requests run in seconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from llm_swarm.scheduler.algorithms.problem import ServerSpec
from llm_swarm.scheduler.algorithms.routing_graph import ChainHop
from llm_swarm.scheduler.sim.host_cpu import HostCpuModel, SharedCpu
from llm_swarm.scheduler.sim.prefill import PrefillModel
from llm_swarm.scheduler.sim.server_costs import ACCELERATOR_MODELS, ServerCost
from llm_swarm.scheduler.sim.workload import Request
from llm_swarm.swarm import step_scheduler as rule
from llm_swarm.swarm.linear_fit import LinearCost

CLIENT = "client"
EPSILON = 1e-12  # a batching window this short is over (float noise of `oldest + window - now`)

Schedule = Callable[[float, Callable[[float, object], None], object], None]
Finished = Callable[[Request, float, float], None]  # (request, first token time, finish time)


@dataclass(frozen=True)
class ContendedConfig:
    """The servers' loop settings (defaults: the live server's, `server/config.py`)."""

    accelerator: str = "serial"  # or "overlap"
    rule: rule.SchedulerPolicy = field(default_factory=rule.SchedulerPolicy)
    prefill_chunk: int = 256  # a prompt longer than this runs in chunks of this many tokens; 0: whole
    active_horizon: float = 0.25  # a session is expected in a decode batch this long after its last step

    def __post_init__(self) -> None:
        if self.accelerator not in ACCELERATOR_MODELS:
            raise ValueError(f"--contended must be one of {ACCELERATOR_MODELS}, got {self.accelerator!r}")
        if self.prefill_chunk < 0 or not self.active_horizon >= 0:
            raise ValueError("--prefill-chunk and the active horizon must be >= 0")


@dataclass(eq=False)
class _Step:
    """One session's step at one server: a decode row or a prompt (`tokens` > 1)."""

    session: _Session
    server: int
    group: tuple[int, int]  # the block range [start, end): decode steps batch within one range
    blocks: int
    tokens: int  # 1 for a decode step; the prompt's length for a prefill
    context: int  # tokens already cached before this step
    ahead: int  # tokens the session may still decode, this one included (`N^d_i`)
    arrived: float
    done: int = 0  # prompt tokens computed so far (chunked prefill)
    skips: int = 0  # decode iterations that ran while this prefill waited
    started: bool = False  # a chunked prefill whose first chunk has run


@dataclass(eq=False)
class _Session:
    request: Request
    hops: tuple[ChainHop, ...]
    prompt_servers: tuple[int, ...]  # per hop: where its prompt runs (the hop's server, or a prefill server)
    token: int = 0  # 0: the prompt's pass; k >= 1: the k-th decode pass
    hop: int = 0
    first_token: float = float("nan")


class _Server:
    """One server's queues and compute thread (`server/engine.py`'s `BatchingEngine`)."""

    __slots__ = ("index", "cost", "busy", "decodes", "groups", "prefills", "recent", "wake_at")

    def __init__(self, index: int, cost: ServerCost):
        self.index, self.cost = index, cost
        self.busy = False
        self.decodes: list[_Step] = []  # in arrival order
        self.groups: dict[tuple[int, int], int] = {}  # block range -> its steps in `decodes`
        self.prefills: deque[_Step] = deque()
        # block range -> session id -> its last decode step's arrival
        self.recent: dict[tuple[int, int], dict[int, float]] = {}
        self.wake_at: float | None = None


class ContendedService:
    """The engine's service model (`engine.simulate(..., service=...)`).

    `servers[:n]` are the engine's servers (the ones chains route through), any after them prefill
    servers (`roles`); `costs` and `prefill` (per-request prompt round trips; None: the servers'
    nominal ones) cover them all.
    """

    def __init__(
        self,
        servers: Sequence[ServerSpec],
        costs: Sequence[ServerCost],
        config: ContendedConfig = ContendedConfig(),
        prefill: PrefillModel | None = None,
        roles=None,  # scheduler.sim.contended_roles.Disaggregation | None
        host_cpu: HostCpuModel | None = None,
    ):
        if len(costs) != len(servers):
            raise ValueError("the contended model needs one cost per server")
        if prefill is not None and len(prefill.tau_base) != len(servers):
            raise ValueError("the prefill model must cover every server of the contended model")
        self.specs, self.config, self.prefill, self.roles = list(servers), config, prefill, roles
        self.serial = config.accelerator == "serial"
        self.servers = [_Server(j, cost) for j, cost in enumerate(costs)]
        self.host_cpu = host_cpu  # None: every server's host part runs on its own CPU
        self.cpu: SharedCpu | None = None
        self._schedule: Schedule | None = None
        self._finished: Finished | None = None
        self.iterations = 0  # decode iterations and prefill runs, all servers (for tests and benchmarks)
        self.handoffs = 0  # hops whose prompt ran on a prefill server

    def stats(self) -> dict[str, float]:
        return {"iterations": float(self.iterations), "handoffs": float(self.handoffs)}

    def bind(self, schedule: Schedule, finished: Finished) -> None:
        """The engine's event queue (`schedule(time, callback, argument)`) and its completion call."""
        self._schedule, self._finished = schedule, finished
        if self.host_cpu is not None:
            self.cpu = SharedCpu(self.host_cpu, schedule)

    # -- sessions (the client) -------------------------------------------------------------------

    def start(self, request: Request, hops: tuple[ChainHop, ...], now: float) -> None:
        """The request holds its chain's caches from `now`: its prompt goes out."""
        if self._schedule is None:
            raise RuntimeError("bind the service to an engine before starting requests")
        prompt_servers = tuple(h.server for h in hops)
        if self.roles is not None:
            prompt_servers = self.roles.plan(request, hops, now)
            self.handoffs += sum(p != h.server for p, h in zip(prompt_servers, hops, strict=True))
        session = _Session(request, hops, prompt_servers)
        self._send(session, now)

    def _round_trip(self, session: _Session, server: int) -> float:
        if session.token > 0:
            return self.specs[server].rtt[CLIENT]
        if self.prefill is not None:
            return self.prefill.rtt_prefill(server, session.request.l_in)
        return self.specs[server].rtt_prefill[CLIENT]

    def _send(self, session: _Session, now: float) -> None:
        """The client sends the current hop's step (after its own CPU work for it, on a shared
        host); it reaches the server half a round trip later."""
        hop = session.hops[session.hop]
        server = session.prompt_servers[session.hop] if session.token == 0 else hop.server
        l_in = session.request.l_in
        tokens = l_in if session.token == 0 else 1
        context = 0 if session.token == 0 else l_in + session.token - 1
        step = _Step(
            session,
            server,
            (hop.start, hop.end),
            hop.num_blocks,
            tokens,
            context,
            ahead=max(l_in + session.request.l_out - context, 1),
            arrived=now,
        )
        client = 0.0
        if self.cpu is not None:
            client = self.host_cpu.client_s + (self.host_cpu.client_token_s if session.hop == 0 else 0.0)
        if client > 0:
            self.cpu.run(now, client, self._transmit, step)
        else:
            self._transmit(now, step)

    def _transmit(self, now: float, step: _Step) -> None:
        arrival = now + self._round_trip(step.session, step.server) / 2
        if self.cpu is not None and self.host_cpu.handler_s > 0:  # the server's handling of it first
            self._schedule(arrival, self._handle, step)
        else:
            self._schedule(arrival, self._arrive, step)

    def _handle(self, now: float, step: _Step) -> None:
        self.cpu.run(now, self.host_cpu.handler_s, self._arrive, step)

    def _step_done(self, now: float, step: _Step) -> None:
        """The server finished `step`; its result reaches the client half a round trip later."""
        back = now + self._round_trip(step.session, step.server) / 2
        if self.cpu is None:  # nothing shared changes meanwhile: act on it now, for `back`
            self._receive(back, step.session)
        else:  # the client's CPU work must start at `back` on the shared cores
            self._schedule(back, self._receive, step.session)

    def _receive(self, now: float, session: _Session) -> None:
        """The client has the hop's result at `now`: the next hop, the next token, or the end."""
        if session.hop + 1 < len(session.hops):
            session.hop += 1
            self._send(session, now)
            return
        session.hop = 0
        if session.token == 0:
            session.first_token = now
            if self.roles is not None:  # the prompt's caches reach the decode servers before the next
                # step leaves; the first token does not wait for them (as the client: `_prefill_step`)
                now += self.roles.handoff_seconds(session.request, session.hops, session.prompt_servers, now)
                if self.roles.first_token_waits:
                    session.first_token = now
        if session.token + 1 >= session.request.l_out:
            self._end(session, now)
            return
        session.token += 1
        self._send(session, now)

    def _end(self, session: _Session, now: float) -> None:
        for hop in session.hops:  # the server forgets it: no batch waits for it any more
            seen = self.servers[hop.server].recent.get((hop.start, hop.end))
            if seen is not None:
                seen.pop(session.request.id, None)
        self._finished(session.request, session.first_token, now)

    # -- servers (their loops) ------------------------------------------------------------------

    def _arrive(self, now: float, step: _Step) -> None:
        step.arrived = now
        server = self.servers[step.server]
        if step.tokens == 1:
            server.decodes.append(step)
            server.groups[step.group] = server.groups.get(step.group, 0) + 1
            seen = server.recent.setdefault(step.group, {})
            seen.pop(step.session.request.id, None)  # re-inserted: the dict stays oldest first
            seen[step.session.request.id] = now
        else:
            server.prefills.append(step)
        if not server.busy:
            self._decide(server, now)

    def _wake(self, now: float, server: _Server) -> None:
        if server.wake_at != now:
            return  # superseded by an earlier wake-up, or already acted on
        server.wake_at = None
        if not server.busy:
            self._decide(server, now)

    def _decide(self, server: _Server, now: float) -> None:
        if not server.prefills:  # the common case, decoding only: the rule reduces to its window
            if not server.decodes:
                return
            batch, expected = self._batch(server, now)
            if len(batch) < self.config.rule.max_batch_rows and not 0 < expected <= len(batch):
                wait = self.config.rule.batch_wait - (now - batch[0].arrived)
                if wait > EPSILON:
                    self._wait(server, now + wait)
                    return
            self._run_decode(server, batch, now)
            return
        batch, expected = self._batch(server, now) if server.decodes else ([], 0)
        head = server.prefills[0]
        view = rule.QueueView(
            now=now,
            decode_rows=len(batch),
            decode_oldest=batch[0].arrived if batch else None,
            decode_sessions=len(batch),
            decode_expected=expected,
            decode_ahead_max=max((s.ahead for s in batch), default=0),
            decode_ahead_rows=sum(s.ahead for s in batch),
            prefill_tokens=self._next_tokens(head),
            prefill_oldest=head.arrived,
            prefill_skips=head.skips,
            prefill_started=head.started,
        )
        blocks = batch[0].blocks if batch else head.blocks
        decision = rule.decide(view, self._rule_costs(server, blocks), self.config.rule)
        action, wait = decision.action, decision.wait
        if action is rule.Action.WAIT and wait > EPSILON:
            self._wait(server, now + wait)
        elif action is rule.Action.PREFILL:
            self._run_prefill(server, now)
        elif batch:  # DECODE, or a window already over
            self._run_decode(server, batch, now)

    def _wait(self, server: _Server, wake: float) -> None:
        """Decide again at `wake` unless something happens first (an earlier wake-up stands)."""
        if server.wake_at is None or wake < server.wake_at:
            server.wake_at = wake
            self._schedule(wake, self._wake, server)

    def _batch(self, server: _Server, now: float) -> tuple[list[_Step], int]:
        """The decode batch that would run next (the oldest step's block range, oldest first, one
        step per session, up to `max_batch_rows`) and how many sessions of that range decoded
        within the active horizon (the ones the batch may expect)."""
        decodes = server.decodes
        group = decodes[0].group
        limit = self.config.rule.max_batch_rows
        if len(server.groups) == 1 and len(decodes) <= limit:
            batch = list(decodes)
        else:
            batch = []
            for step in decodes:
                if step.group == group:
                    batch.append(step)
                    if len(batch) >= limit:
                        break
        seen = server.recent.get(group)
        if not seen:
            return batch, 0
        oldest = now - self.config.active_horizon
        while seen:
            key = next(iter(seen))
            if seen[key] >= oldest:
                break
            del seen[key]
        return batch, len(seen)

    def _rule_costs(self, server: _Server, blocks: int) -> rule.CostModel:
        """What the live engine's fits of its compute thread's run times would say: the host part,
        plus the device's where the device runs on the thread (`serial`)."""
        host, device = server.cost.host, server.cost.device
        fixed, per_row = host.fixed, host.per_row
        if self.serial:
            fixed, per_row = fixed + device.fixed, per_row + device.per_row
        head = server.prefills[0] if server.prefills else None
        prefill_blocks = head.blocks if head else blocks

        def prefill(tokens: int) -> float:
            seconds = host.prefill(tokens) + (device.prefill(tokens) if self.serial else 0.0)
            return prefill_blocks * seconds

        return rule.CostModel(LinearCost(blocks * fixed, blocks * per_row), prefill)

    def _next_tokens(self, step: _Step) -> int:
        chunk = self.config.prefill_chunk
        left = step.tokens - step.done
        return min(left, chunk) if chunk and step.tokens > chunk else left

    def _run_decode(self, server: _Server, batch: list[_Step], now: float) -> None:
        if len(batch) == len(server.decodes):
            server.decodes = []
            server.groups.clear()
        else:
            taken = {id(s) for s in batch}
            server.decodes = [s for s in server.decodes if id(s) not in taken]
            group = batch[0].group
            left = server.groups[group] - len(batch)
            if left:
                server.groups[group] = left
            else:
                del server.groups[group]
        for waiting in server.prefills:
            waiting.skips += 1
        rows, context = len(batch), sum(s.context for s in batch)
        host = batch[0].blocks * server.cost.host.decode(rows, context)
        self.iterations += 1
        if self.cpu is None:
            self._decode_device(now + host, (server, batch, context))
        else:  # the host part competes for the machine's cores
            server.busy = True
            self.cpu.run(now, host, self._decode_device, (server, batch, context))

    def _decode_device(self, at: float, payload: tuple[_Server, list[_Step], int]) -> None:
        """The decode iteration's device part, from `at` (its host part done)."""
        server, batch, context = payload
        device, blocks = server.cost.device, batch[0].blocks
        if self.serial:
            self._occupy(server, at + blocks * device.decode(len(batch), context), batch)
            return
        for step in batch:  # each session's device time overlaps the others' (and the next iteration)
            self._schedule(at + blocks * device.decode(1, step.context), self._step_done, step)
        self._occupy(server, at, [])

    def _run_prefill(self, server: _Server, now: float) -> None:
        step = server.prefills.popleft()
        tokens = self._next_tokens(step)
        host = step.blocks * server.cost.host.prefill(tokens)
        step.done += tokens
        self.iterations += 1
        if self.cpu is None:
            self._prefill_device(now + host, (server, step, tokens))
        else:
            server.busy = True
            self.cpu.run(now, host, self._prefill_device, (server, step, tokens))

    def _prefill_device(self, at: float, payload: tuple[_Server, _Step, int]) -> None:
        """The prefill's (or chunk's) device part, from `at`; an unfinished prompt goes back to the
        head of the queue."""
        server, step, tokens = payload
        finished = step.done >= step.tokens
        requeue = None if finished else step
        if self.serial:
            end = at + step.blocks * server.cost.device.prefill(tokens)
            self._occupy(server, end, [step] if finished else [], requeue)
            return
        if finished:  # overlap: the whole prompt's device time, once, after its last host chunk
            whole = step.blocks * server.cost.device.prefill(step.tokens)
            self._schedule(at + whole, self._step_done, step)
        self._occupy(server, at, [], requeue)

    def _occupy(self, server: _Server, until: float, done: list[_Step], requeue: _Step | None = None) -> None:
        server.busy = True
        self._schedule(until, self._free, (server, done, requeue))

    def _free(self, now: float, payload: tuple[_Server, list[_Step], _Step | None]) -> None:
        server, done, requeue = payload
        server.busy = False
        if requeue is not None:  # the rest of a chunked prompt waits at the head as a new arrival
            requeue.arrived, requeue.skips, requeue.started = now, 0, True
            server.prefills.appendleft(requeue)
        for step in done:
            self._step_done(now, step)
        if not server.busy:
            self._decide(server, now)
