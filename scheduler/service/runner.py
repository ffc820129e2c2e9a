"""The scheduler process: a DHT peer, a gRPC server, and the loop that keeps the core current.

Every `roster_read_period` seconds it reads the roster keys that are due from the DHT (all of them
within `full_pass` seconds: `swarm.dht_records.RosterReader`); every `refresh` seconds it lets the
core review the placement and admit waiting sessions, and re-publishes its address and placement
under the scheduler key (so servers and clients find it without configuration, and see a dead
scheduler's record expire).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from llm_swarm.scheduler.service.auth import SwarmProofInterceptor
from llm_swarm.scheduler.service.core import CoreSettings, SchedulerCore
from llm_swarm.scheduler.service.grpc_api import SchedulerApi
from llm_swarm.scheduler.service.metrics import SchedulerMetrics
from llm_swarm.scheduler.service.view import ModelShape
from llm_swarm.scheduler.service.web import make_app, start_web
from llm_swarm.swarm.cli.signals import stop_on_signals, terminate_like_interrupt
from llm_swarm.swarm.closed_swarm import SwarmSecret
from llm_swarm.swarm.dht_peer import PeerIdentity, dht_options, forget_identity, open_identity
from llm_swarm.swarm.dht_process import SwarmDHT
from llm_swarm.swarm.dht_records import RosterReader, publish_scheduler
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.model_limits import ModelLimits
from llm_swarm.swarm.scheduler_api import scheduler_pb2_grpc as pb_grpc
from llm_swarm.swarm.until_stop import DHT_READ_TIMEOUT, Stopped, until_stop

logger = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    initial_peers: list[str]
    dht_prefix: str
    shape: ModelShape
    core: CoreSettings
    host: str = "127.0.0.1"
    port: int = 0
    announce_host: str | None = None  # address published in the DHT (default: host)
    refresh: float = 0.5  # seconds between admission ticks and record publications
    # seconds between roster reads (each reads the keys that are due). One read is one DHT search that
    # asks several servers whatever the number of keys, so reads, not keys, are what servers pay for:
    # at 0.5 s, answering them was the larger part of what 24 idle servers spent
    roster_read_period: float = 2.0
    # every roster key is re-read at least this often: how late the scheduler may see a server leave,
    # fill up or join (placement settles for `settle` s after a change anyway; admission counts its
    # own grants at once and only learns from records what other clients hold)
    full_pass: float = 4.0
    record_ttl: float = 20.0  # the DHT record of a dead scheduler disappears after this long
    address_file: str | None = None  # write "host:port" here once serving (for scripts and tests)
    http_host: str | None = None  # status page, /api/status and /metrics (default: host)
    http_port: int | None = 0  # 0: any free port; None: no web server
    limits: ModelLimits | None = None  # what server records may say (default: the block count only)
    identity_path: str | None = None  # the key clients and servers trust us by; None: fresh per run
    public_key_file: str | None = None  # write our public key here (what clients and servers are given)
    swarm_secret: SwarmSecret | None = None  # closed swarm: DHT authorizer, and proofs on every RPC
    max_message_bytes: int = 1 << 20  # gRPC requests larger than this are refused unread

    def __post_init__(self) -> None:
        """Every value checked where the config is made (messages name `swarm-scheduler`'s flags)."""
        if not 0 <= self.port <= 65535:
            raise SwarmUserError(f"--port must be in 0..65535, got {self.port}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise SwarmUserError(f"--http-port must be in 0..65535 (or -1 for none), got {self.http_port}")
        for name in ("refresh", "roster_read_period", "full_pass", "record_ttl"):
            if not getattr(self, name) > 0:
                raise SwarmUserError(f"{name.replace('_', ' ')} must be positive, got {getattr(self, name)}")
        if self.max_message_bytes < 1024:
            raise SwarmUserError(f"max_message_bytes must be at least 1024, got {self.max_message_bytes}")


class SchedulerService:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.core = SchedulerCore(config.shape, config.core, time.monotonic())
        self.metrics = SchedulerMetrics()
        self.api = SchedulerApi(self.core, metrics=self.metrics)
        self.dht: SwarmDHT | None = None
        self.roster: RosterReader | None = None
        self.identity: PeerIdentity | None = None
        self.limits = config.limits or ModelLimits(num_blocks=config.shape.num_blocks)
        self.address = ""
        self._stop = asyncio.Event()

    async def run(self) -> None:
        config = self.config
        loop = asyncio.get_running_loop()
        self.identity = open_identity(config.identity_path)
        self._share_public_key()
        self.dht = SwarmDHT(
            initial_peers=config.initial_peers,
            client_mode=True,
            start=True,
            **dht_options(self.identity, config.swarm_secret),
        )
        self.roster = RosterReader(
            self.dht, config.dht_prefix, self.limits, config.full_pass, config.roster_read_period
        )
        stop_on_signals(loop, self._stop.set)
        interceptors = [SwarmProofInterceptor(config.swarm_secret)] if config.swarm_secret else []
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[("grpc.max_receive_message_length", config.max_message_bytes)],
        )
        pb_grpc.add_SchedulerServicer_to_server(self.api, server)
        port = server.add_insecure_port(f"{config.host}:{config.port}")
        await server.start()
        self.address = f"{config.announce_host or config.host}:{port}"
        logger.info(
            "scheduler for %s serving gRPC on %s (policy %s, period %.0f s, l_in %d, l_out %d)",
            config.dht_prefix,
            self.address,
            config.core.plan.policy,
            config.core.period,
            config.core.l_in,
            config.core.l_out,
        )
        web_runner = None
        if config.http_port is not None:
            app = make_app(self._status, f"llm-swarm: {config.dht_prefix}", "scheduler", self._metrics)
            http_host = config.http_host or config.host
            web_runner, http_port = await start_web(app, http_host, config.http_port)
            self.api.status_url = f"http://{config.announce_host or http_host}:{http_port}/"
            logger.info("status page at %s", self.api.status_url)
        if config.address_file:
            with open(config.address_file, "w") as file:
                file.write(self.address + "\n")
        try:
            await self._loop()
        finally:
            if web_runner is not None:
                await web_runner.cleanup()
            await server.stop(grace=1.0)
            self.dht.shutdown()
            if config.identity_path is None:
                forget_identity(self.identity)  # a per-run key: nobody can trust it after us
            logger.info("stopped")

    async def _loop(self) -> None:
        config = self.config
        last_published, published_epoch = -float("inf"), -1
        last_read = -float("inf")
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if now - last_read >= config.roster_read_period:
                    last_read = now
                    started = time.perf_counter()
                    # bounded, and given up at a stop: a DHT that stopped answering must hold
                    # neither routing (`api.pump` runs in this loop) nor the scheduler's stop
                    roster = await until_stop(self.roster.read(), self._stop, DHT_READ_TIMEOUT)
                    read = time.perf_counter()
                    self.core.update_roster(roster, now)
                    self.metrics.refresh.labels(part="read").set(read - started)
                started = time.perf_counter()
                self.core.review(now)
                self.metrics.refresh.labels(part="review").set(time.perf_counter() - started)
            except Stopped:
                break
            except Exception as error:  # a flaky DHT read must not stop routing; next round retries
                logger.warning("roster update failed: %s", error or type(error).__name__)
            self.api.pump()
            if self.core.epoch != published_epoch or now - last_published > config.record_ttl / 3:
                try:
                    await publish_scheduler(
                        self.dht,
                        config.dht_prefix,
                        self.identity.owner,
                        self._record(),
                        ttl=config.record_ttl,
                        wait=False,
                    )
                    last_published, published_epoch = now, self.core.epoch
                except Exception as error:
                    logger.warning("publishing the scheduler record failed: %s", error)
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=config.refresh)
            except TimeoutError:
                pass

    def _share_public_key(self) -> None:
        """Clients and managed servers follow us only if given this key: print it, and write it out."""
        key = self.identity.public_key
        if self.config.public_key_file:
            with open(self.config.public_key_file, "w") as file:
                file.write(key + "\n")
        logger.info(
            "scheduler public key (give it to clients and servers as --scheduler-key)%s: %s",
            f", written to {self.config.public_key_file}" if self.config.public_key_file else "",
            key,
        )
        if self.config.identity_path is None:
            logger.warning("no --identity-path: this key is new and lasts only for this run")

    async def _status(self) -> dict:
        return {**self.core.status(time.monotonic()), "status_url": self.api.status_url}

    def _metrics(self) -> bytes:
        self.metrics.update(self.core.status(time.monotonic()))
        return self.metrics.exposition()

    def _record(self) -> dict:
        core = self.core
        return {
            "address": self.address,
            "status_url": self.api.status_url,
            "policy": core.settings.plan.policy,
            "epoch": core.epoch,
            "num_requests": core.num_requests,
            "placement": {
                peer: [span.start, span.end] if span else None for peer, span in core.assignment.items()
            },
        }


def run_scheduler(config: SchedulerConfig) -> None:
    terminate_like_interrupt()  # while joining: a SIGTERM still leaves the DHT through `finally`
    asyncio.run(SchedulerService(config).run())
