"""The one configuration object of a `swarm-api` process; it validates itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from llm_swarm.client.connection import ClientOptions
from llm_swarm.swarm.errors import SwarmUserError


@dataclass(frozen=True)
class ApiConfig:
    model_dir: Path
    initial_peers: tuple[str, ...]
    model_name: str  # what /v1/models lists and requests must name (default: the DHT prefix)
    dht_prefix: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (logged)
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1/* when set
    max_concurrent: int = 16  # generations running at once
    max_queued: int = 64  # requests waiting for a slot beyond those; more get 429
    max_tokens: int = 1024  # the most a request may ask for
    max_context: int = 2048  # prompt plus completion tokens, at most
    default_max_tokens: int = 16  # OpenAI's default for completions
    # the tokens one request's choices may hold together (each: prompt + max_tokens): bounds n times
    # max_tokens, batches of prompts and echoed long prompts (`client.api.planning`)
    max_request_tokens: int = 16384
    options: ClientOptions = field(default_factory=ClientOptions)

    def __post_init__(self) -> None:
        if not self.initial_peers:
            raise SwarmUserError("--initial-peers is required: the multiaddr of at least one DHT peer")
        if not (self.model_dir / "config.json").is_file():
            raise SwarmUserError(f"{self.model_dir} is not a checkpoint directory (no config.json)")
        if not 0 <= self.port < 65536:
            raise SwarmUserError(f"--port must be in 0..65535, got {self.port}")
        if self.api_key is not None and len(self.api_key) < 8:
            raise SwarmUserError("--api-key must be at least 8 characters")
        if self.max_concurrent < 1 or self.max_queued < 0:
            raise SwarmUserError("--max-concurrent must be >= 1 and --max-queued >= 0")
        if not 1 <= self.default_max_tokens <= self.max_tokens < self.max_context:
            raise SwarmUserError("need 1 <= default max tokens <= --max-tokens < --max-context")
        if self.max_request_tokens < self.max_context:
            raise SwarmUserError("--max-request-tokens must be at least --max-context (one full request)")
