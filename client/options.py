"""`ClientOptions`: how a client routes, waits, fails over, verifies and moves sessions; checked
when made."""

from __future__ import annotations

from dataclasses import dataclass

from llm_swarm.swarm.adapter_names import check_adapter_name
from llm_swarm.swarm.closed_swarm import SwarmSecret
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.task_label import check_label


@dataclass
class ClientOptions:
    refresh_period: float = 1.0  # seconds a fetched list of servers stays fresh
    rtt_ttl: float = 60.0  # seconds a measured RTT stays valid
    failed_ping_ttl: float = 3.0  # seconds a server that did not answer a ping is skipped before retrying
    ping_timeout: float = 5.0  # first contact with a server: records may name peers that do not exist
    probe_per_block: int = 4  # routing pings at most this many unmeasured servers per block (widened
    # when no chain forms among them), so a client's start-up does not grow with the swarm
    request_timeout: float = 30.0  # seconds to wait for any one reply
    wait_for_room: float = 60.0  # seconds to wait for cache room before giving up
    wait_for_servers: float = 15.0  # seconds to wait for some server to cover missing blocks
    max_failovers: int = 8  # failures one step survives before the session gives up
    ban_base: float = 1.0  # a failed server is avoided for ban_base * 2^(failures-1) s, at most ban_max
    ban_max: float = 60.0
    # the prompt length routing assumes for a session opened without `prompt_tokens` (generate()
    # always gives the real one); the rest of the session's max_length counts as generated tokens
    expected_l_in: int = 20
    use_scheduler: bool = True  # ask the scheduler for routes when one signed by scheduler_key is announced
    scheduler_key: str | None = None  # the scheduler's public key (ssh-rsa ...); None: never use one
    scheduler_timeout: float = 3.0  # seconds to wait for a scheduler reply before routing locally
    scheduler_retry: float = 5.0  # after the scheduler failed, route locally this long before asking again
    scheduler_distrust: float = 60.0  # after the scheduler said something impossible, ignore it this long
    swarm_secret: SwarmSecret | None = None  # closed swarms: the secret every peer holds
    max_refusals: int = 3  # "no cache room" answers a server announcing room may give before a ban
    # replica verification: this fraction of each hop's steps (drawn unpredictably) also runs on another
    # server holding the same blocks; a third decides a disagreement and the liar is banned for liar_ban
    verify_fraction: float = 0.0
    liar_ban: float = 3600.0
    # how a failover rebuilds a replacement server's cache (client/replay.py): "prefill" runs one
    # catch-up prefill (equal within the dtype's rounding; one forward of server compute), "exact"
    # reruns the recorded steps from one message (a bit-identical cache, but one forward per step:
    # measured 14.4x a token after 500 tokens over 50 ms links, against 2.7x, BENCHMARKS.md), "steps"
    # sends the recorded steps one round trip each (what servers without the Replay message understand)
    replay_mode: str = "prefill"
    # chain sessions: each server pushes a step's output straight to the next server of the chain,
    # which answers as soon as it ran it (swarm/chain_wire.py), so a token costs one round trip to the
    # chain plus the servers' links between them; False: every output comes back to the client first
    # (hub-spoke), as servers that predate pushes serve anyway
    chain_push: bool = True
    # in a chain session, seconds the client waits for a server's answer to a step its predecessor
    # pushed before it sends its own copy of the step's input: None sends it at once (a failed push
    # costs nothing), a delay saves the client's upload and the server's work while pushes work (a
    # failed one costs it); "auto" waits a few times as long as that server's pushed answers took
    # (`client.push_copies`), and sends the copy at once while pushes to it fail
    push_copy_after: float | str | None = "auto"
    # streams to servers that announce a direct address and answered a ping within `direct_max_rtt`
    # seconds go over TLS straight to the server (swarm/direct_listener.py), skipping both p2p daemons;
    # farther servers, and any whose direct address fails, are reached over libp2p
    direct_streams: bool = True
    direct_max_rtt: float = 0.02
    # a session's steps and their answers go as compact binary frames (swarm/step_frame.py) to
    # servers that announce them, over either path; False: as protobuf messages, as to servers that
    # predate frames
    step_frames: bool = True
    # this client's upload bandwidth (Mbit/s): what a replay costs against a server-to-server hand-off
    uplink_mbps: float = 20.0
    # a session on a server that leaves: "auto" moves its cache by hand-off when that is expected to
    # beat a replay (client/handoff_cost.py), "always" hands off whenever one server takes all its
    # blocks, "never" replays (servers that predate hand-offs are replayed to anyway)
    handoff: str = "auto"
    # prompts on servers started with --role prefill, their caches handed to the decode chain: "auto"
    # where it is expected to pay (client/remote.py), "always" wherever one holds a hop's blocks,
    # "never"
    disaggregate: str = "auto"
    # a disaggregated prompt's first token returns as soon as the prefill servers computed it, and the
    # next step waits for the cache hand-offs (True); False holds the first token until they are done,
    # so that the hand-off counts in the time to the first token rather than between tokens (for SLOs
    # whose TPOT target is tight next to the hand-off); every token arrives no later with True
    first_token_before_handoff: bool = True
    # a scheduler with SLO targets (swarm-scheduler --slo-ttft/--slo-tpot) tells a session expected to miss
    # them at once: False gives up (SwarmUnavailable: swarm-api answers 503), True waits for admission anyway
    accept_slo_miss: bool = False
    # the LoRA adapter every session and forward of this client uses (PETALS' `active_adapter`): only
    # servers announcing it are routed through; None: the plain model
    active_adapter: str | None = None
    # what kind of work this client's sessions are ("code", "chat"...; at most 64 printable characters):
    # a scheduler learns output lengths per label and routes by them (swarm-scheduler --l-out-prediction)
    task_label: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "refresh_period",
            "rtt_ttl",
            "failed_ping_ttl",
            "ping_timeout",
            "request_timeout",
            "uplink_mbps",
            "direct_max_rtt",
        ):
            if not getattr(self, name) > 0:
                raise SwarmUserError(f"ClientOptions.{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.verify_fraction <= 1.0:
            raise SwarmUserError(
                f"ClientOptions.verify_fraction must be in [0, 1], got {self.verify_fraction}"
            )
        if self.probe_per_block < 1:
            raise SwarmUserError(f"ClientOptions.probe_per_block must be >= 1, got {self.probe_per_block}")
        copy_after = self.push_copy_after
        if copy_after not in (None, "auto") and not (
            isinstance(copy_after, int | float)
            and not isinstance(copy_after, bool)
            and 0 <= copy_after <= self.request_timeout
        ):
            raise SwarmUserError(
                "ClientOptions.push_copy_after must be None, 'auto' or in [0, request_timeout], got "
                f"{copy_after!r}"
            )
        if self.replay_mode not in ("exact", "prefill", "steps"):
            raise SwarmUserError(
                f"ClientOptions.replay_mode must be exact, prefill or steps, got {self.replay_mode!r}"
            )
        for name in ("handoff", "disaggregate"):
            if getattr(self, name) not in ("auto", "always", "never"):
                raise SwarmUserError(
                    f"ClientOptions.{name} must be auto, always or never, got {getattr(self, name)!r}"
                )
        if self.max_failovers < 0 or self.max_refusals < 1:
            raise SwarmUserError("ClientOptions.max_failovers must be >= 0 and max_refusals >= 1")
        if self.active_adapter is not None:
            check_adapter_name(self.active_adapter)
        try:
            check_label(self.task_label)
        except ValueError as error:
            raise SwarmUserError(f"ClientOptions.task_label: {error}") from None
        if self.scheduler_key is not None:
            from llm_swarm.swarm.identity import read_public_key

            self.scheduler_key = read_public_key(self.scheduler_key)
