"""Where a client model's blocks come from: the swarm serving a model, joined through its DHT."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from llm_swarm.client.backend import BlockBackend
from llm_swarm.client.connection import ClientOptions, SwarmConnection
from llm_swarm.client.remote import RemoteBlocks
from llm_swarm.swarm.dht_keys import default_prefix, validate_prefix
from llm_swarm.swarm.model_limits import ModelLimits
from llm_swarm.swarm.models.checkpoint import load_config
from llm_swarm.swarm.models.hub import resolve_model

ModelT = TypeVar("ModelT")


def swarm_backend(
    model_dir: str | Path,
    initial_peers: list[str],
    dht_prefix: str | None = None,
    options: ClientOptions | None = None,
    active_adapter: str | None = None,
) -> RemoteBlocks:
    """The blocks of `model_dir`'s model as served by the swarm at `initial_peers`, found under
    `dht_prefix` (default: the model directory's name, as servers announce it); `active_adapter`: a
    LoRA adapter the servers announce, for every forward (`ClientOptions.active_adapter`)."""
    if active_adapter is not None:
        options = dataclasses.replace(options or ClientOptions(), active_adapter=active_adapter)
    config = load_config(model_dir)
    prefix = validate_prefix(dht_prefix) if dht_prefix else default_prefix(str(model_dir))
    connection = SwarmConnection(list(initial_peers), prefix, ModelLimits.from_config(config), options)
    return RemoteBlocks(connection)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a client model comes from: a model (a directory or a Hub id at `revision`, with `token`)
    whose blocks the swarm at `initial_peers` serves under `dht_prefix`."""

    model_dir: str | Path
    initial_peers: list[str]
    dht_prefix: str | None = None
    options: ClientOptions | None = None
    active_adapter: str | None = None
    revision: str | None = None
    token: str | None = None

    def load(self, from_local_parts: Callable[..., ModelT], **parts: Any) -> ModelT:
        """`from_local_parts(model_dir, backend, **parts)` on the swarm's blocks; the swarm is left if
        loading the client's parts fails."""
        # a Hub id: its config and generation config now, the shards of the client's modules as read
        model_dir = resolve_model(self.model_dir, self.revision, self.token)
        backend = swarm_backend(
            model_dir, self.initial_peers, self.dht_prefix, self.options, self.active_adapter
        )
        try:
            return from_local_parts(model_dir, backend, **parts)
        except BaseException:
            backend.connection.shutdown()
            raise


def leave_swarm(backend: BlockBackend) -> None:
    """Leave the swarm (close the client's DHT peer); local backends have nothing to close."""
    connection = getattr(backend, "connection", None)
    if connection is not None:
        connection.shutdown()
