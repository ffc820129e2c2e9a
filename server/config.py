"""A server process's configuration: one self-validating object, made by the CLI or by tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_swarm.server.joining import RELAY_MODES
from llm_swarm.swarm.closed_swarm import SwarmSecret
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.models.adapters import MAX_ADAPTERS, AdapterSource
from llm_swarm.swarm.prefill_cost import STREAM_CHUNK_TOKENS
from llm_swarm.swarm.record_validator import MAX_RECORD_TTL
from llm_swarm.swarm.server_info import ServerRole

MAX_ANNOUNCE_PERIOD = (MAX_RECORD_TTL - 1) / 2  # records live 2 periods + 1 s; validators allow no more


@dataclass
class ServerConfig:
    model_dir: str
    initial_peers: list[str]
    start: int | None  # None (with end None): managed, the span comes from the scheduler
    end: int | None
    memory_bytes: int
    dht_prefix: str
    dtype: str = "float32"
    device: str = "cpu"
    quant: str = "none"  # "int8" or "nf4": bitsandbytes blocks (CUDA)
    host: str = "127.0.0.1"
    port: int = 0
    public_name: str = ""
    max_length: int = 2048  # longest session accepted
    slot_tokens: int = 2048  # session length that announced cache slots are counted for
    max_batch_size: int = 64
    announce_period: float = 10.0
    # an idle server (no session open) re-announces every this many periods; records live two of them
    idle_announce_factor: float = 3.0
    session_idle_timeout: float = 300.0
    compute_delay: float = 0.0
    # emulation: seconds per block per token on top, so a long prefill costs what it would on a GPU
    compute_delay_per_token: float = 0.0
    compute_delay_overlap: bool = False  # emulation: concurrent sessions' delays overlap (see handler)
    # on CUDA, single-token decode steps replay captured CUDA graphs (swarm.models.decode_graphs);
    # this turns that off (every step eager, as on the CPU)
    no_cuda_graphs: bool = False
    batch_wait_ms: float = 2.0  # window for batching concurrent decode steps; 0 = no batching
    # a prefill longer than this runs in chunks of this many tokens, decode iterations of other
    # sessions in between (server/engine.py); 0: whole prefills
    # longer prefills run in chunks of this many tokens, decode iterations in between; 256 measured
    # best over emulated links (BENCHMARKS.md "Chunked prefill"): decoders' p99 gap 1.31x the quiet
    # one while 2,000-token prompts arrive (3.02x whole), prompts' first token 1.07x; 128 costs them
    # 1.43x, 512 lets decoders wait 1.61x
    prefill_chunk: int = STREAM_CHUNK_TOKENS
    drain_timeout: float = 10.0  # on SIGTERM or a move, let open sessions finish for up to this long
    # the prompt length the announced `tau_prefill` is measured on; clients and the scheduler scale it
    # linearly, so a server with a large fixed cost per step should measure at a typical prompt length
    prefill_tokens: int = 20
    scheduler_timeout: float = 10.0  # managed: choose blocks locally if no scheduler answers this long
    assignment_poll: float = 2.0  # managed: seconds between assignment requests while serving
    scheduler_rpc_timeout: float = 3.0  # bound on each DHT lookup / RPC to the scheduler
    metrics_port: int | None = None  # Prometheus endpoint on `host`; None: no endpoint
    identity_path: str | None = None  # RSA key of the peer id and record signatures; None: fresh per run
    scheduler_key: str | None = None  # managed: the only scheduler public key to follow; None: none
    swarm_secret: SwarmSecret | None = None  # closed swarm: only holders of it may talk to us
    max_sessions_per_peer: int = 64
    max_peer_cache_fraction: float = 0.5  # of the session cache one peer may reserve
    max_session_lifetime: float = 24 * 3600.0  # seconds a session may live, however active
    extra_dht_options: dict = field(default_factory=dict)
    relay: str = "auto"  # reachability: check, and serve through a relay when behind NAT (server.joining)
    relay_peers: list[str] = field(default_factory=list)  # circuit relays besides the bootstrap peers
    serve_as_relay: bool = False  # relay for others (needs a public address), within bounded resources
    # also write the legacy roster and per-block records that clients and schedulers before the sharded
    # roster read (they grow with the swarm); turn off once every reader of the swarm is current
    legacy_records: bool = True
    # LoRA adapters (peft) for the blocks served, each checked and loaded at start-up; sessions name one
    adapters: tuple[AdapterSource, ...] = ()
    # which phase of sessions this server takes: prompts ("prefill": its caches go to decode servers by
    # hand-off), "decode", or "both"
    role: str = "both"
    # seconds between probes of the links to a few servers holding our blocks (their rates are announced
    # for clients' hand-off decisions; server/link_probes.py); 0: learn rates from hand-offs only
    link_probe_period: float = 300.0
    # seconds between pinging the servers that hold the block after ours (their round trips are
    # announced, for pricing chain sessions; server/next_server_pings.py); 0: never
    next_ping_period: float = 60.0
    # streams served directly too (TLS on a port of their own, swarm/direct_listener.py), for peers that
    # can reach it; 0: any free port; they are announced at `--announce-host`, else at `host`
    direct_port: int = 0
    no_direct_streams: bool = False
    # chain pushes go over a next server's direct stream when our ping to it took at most this long
    # (seconds): on a LAN the p2p daemons cost as much as the network; farther, libp2p's connection
    # is already open
    direct_max_rtt: float = 0.02
    announce_host: str | None = None

    def __post_init__(self) -> None:
        """Every value checked where the config is made, whoever makes it (messages name the CLI flags)."""
        if (self.start is None) != (self.end is None) or (
            self.start is not None and not 0 <= self.start < self.end
        ):
            raise SwarmUserError(f"blocks {self.start}:{self.end} are not a span (start < end, or both None)")
        counts = ("max_length", "slot_tokens", "max_batch_size", "max_sessions_per_peer", "prefill_tokens")
        for name in counts:
            if getattr(self, name) < 1:
                raise SwarmUserError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 < self.announce_period <= MAX_ANNOUNCE_PERIOD or not self.session_idle_timeout > 0:
            raise SwarmUserError(
                f"--announce-period must be in (0, {MAX_ANNOUNCE_PERIOD:.0f}] and --session-timeout positive"
            )
        if not 1 <= self.idle_announce_factor <= MAX_ANNOUNCE_PERIOD / self.announce_period:
            raise SwarmUserError(
                f"--idle-announce-factor must be in [1, {MAX_ANNOUNCE_PERIOD:.0f} / --announce-period], "
                f"got {self.idle_announce_factor}"
            )
        if not 0 < self.max_peer_cache_fraction <= 1:
            fraction = self.max_peer_cache_fraction
            raise SwarmUserError(f"--max-peer-cache-fraction must be in (0, 1], got {fraction}")
        # `not x > 0` and `not x >= 0` also reject nan
        for name in ("max_session_lifetime", "scheduler_timeout", "assignment_poll", "scheduler_rpc_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise SwarmUserError(f"--{name.replace('_', '-')} must be positive, got {value}")
        periods = ("compute_delay", "compute_delay_per_token", "drain_timeout")
        for name in (*periods, "link_probe_period", "next_ping_period"):
            value = getattr(self, name)
            if not value >= 0:  # also refuses NaN
                raise SwarmUserError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if self.prefill_chunk < 0:
            raise SwarmUserError("--prefill-chunk must be >= 0 (0: prefills run whole)")
        if not self.batch_wait_ms >= 0:
            raise SwarmUserError(f"--batch-wait-ms must be >= 0, got {self.batch_wait_ms}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise SwarmUserError(f"--metrics-port must be in 0..65535, got {self.metrics_port}")
        if not self.direct_max_rtt >= 0:
            raise SwarmUserError(f"--direct-max-rtt must be >= 0, got {self.direct_max_rtt}")
        if not 0 <= self.direct_port < 65536:
            raise SwarmUserError(f"--direct-port must be in 0..65535, got {self.direct_port}")
        if not 0 <= self.port < 65536 or self.memory_bytes <= 0:
            raise SwarmUserError(
                f"--port must be in 0..65535 and --memory positive, got {self.port} and {self.memory_bytes}"
            )
        names = [source.name for source in self.adapters]
        if len(names) > MAX_ADAPTERS or len(set(names)) != len(names):
            raise SwarmUserError(f"--adapters: at most {MAX_ADAPTERS}, with different names; got {names}")
        if self.role not in tuple(ServerRole):
            raise SwarmUserError(f"--role must be prefill, decode or both, got {self.role!r}")
        if self.relay not in RELAY_MODES:
            raise SwarmUserError(f"--relay must be one of {', '.join(RELAY_MODES)}, got {self.relay!r}")

    @property
    def managed(self) -> bool:
        return self.start is None
