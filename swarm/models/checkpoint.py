"""Read selected tensors from a local Hugging Face safetensors checkpoint.

A server holding blocks 40..49 of a 70-block model must not read the other 60 blocks: the index
file (`model.safetensors.index.json`) says which shard holds each tensor, so only those shards are
opened, and only the requested tensors are read from them (safetensors maps the file lazily).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, PretrainedConfig

from llm_swarm.swarm.errors import CheckpointError
from llm_swarm.swarm.hub_snapshot import hub_snapshot
from llm_swarm.swarm.models.hub import ensure_file, has_pickled_weights

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def load_config(model_dir: str | Path) -> PretrainedConfig:
    """The checkpoint's `config.json`, with a clear error when the directory is not a checkpoint."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {str(model_dir)!r} does not exist")
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(f"{str(model_dir)!r} is not a model checkpoint: it has no config.json")
    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        # transformers raises ValueError for unknown model types and OSError/JSON errors for bad files
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"cannot read {model_dir / 'config.json'}: {first_line}") from None


class CheckpointReader:
    """Knows which file holds each tensor of a checkpoint; opens files only when asked for their tensors.

    Opened shards stay open (memory-mapped, nothing read until asked) until `close()`, so reading a
    span block by block opens each shard once. Use it as a context manager.
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._handles: dict[str, object] = {}
        self.opened_files: list[str] = []  # file names opened, in order (tests check this)
        self.weight_map = self._read_weight_map()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._handles.clear()  # safe_open handles release their mapping when dropped

    def _read_weight_map(self) -> dict[str, str]:
        index_path = self.model_dir / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{index_path} is corrupt: expected JSON with a 'weight_map'") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path} is corrupt: 'weight_map' is not an object")
            return {str(name): str(file) for name, file in weight_map.items()}
        if hub_snapshot(self.model_dir) is not None:  # a single-file Hub model: fetched on first read
            with contextlib.suppress(CheckpointError):
                ensure_file(self.model_dir, SINGLE_FILE)
        single_path = self.model_dir / SINGLE_FILE
        if single_path.is_file():
            return {name: SINGLE_FILE for name in self._handle(SINGLE_FILE).keys()}
        if has_pickled_weights(self.model_dir):
            raise CheckpointError(
                f"{self.model_dir} holds only PyTorch .bin weights; llm-swarm reads safetensors "
                "(re-save the model with save_pretrained(..., safe_serialization=True))"
            )
        raise CheckpointError(f"{self.model_dir} has no {SINGLE_FILE} or {INDEX_FILE}")

    def _handle(self, file_name: str):
        if file_name not in self._handles:
            path = ensure_file(self.model_dir, file_name)  # a Hub snapshot's shard is fetched now
            if not path.is_file():
                raise CheckpointError(f"checkpoint file {path} is missing")
            try:
                self._handles[file_name] = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as error:
                if hub_snapshot(self.model_dir) is None:
                    raise CheckpointError(f"checkpoint file {path} is corrupt: {error}") from None
                self._handles[file_name] = self._refetched(file_name, error)
            self.opened_files.append(file_name)
        return self._handles[file_name]

    def _refetched(self, file_name: str, error: Exception):
        """A Hub shard that does not open (truncated or corrupted on disk), fetched once more."""
        logger.warning("%s of %s does not open (%s): fetching it again", file_name, self.model_dir, error)
        path = ensure_file(self.model_dir, file_name, refetch=True)
        try:
            return safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError) as again:
            raise CheckpointError(
                f"checkpoint file {path} is corrupt, also when fetched again: {again}"
            ) from None

    def names_with_prefix(self, prefix: str) -> list[str]:
        return [name for name in self.weight_map if name.startswith(prefix)]

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Read the named tensors, opening each needed shard once."""
        names_by_file: dict[str, list[str]] = defaultdict(list)
        for name in names:
            if name not in self.weight_map:
                raise CheckpointError(f"checkpoint {self.model_dir} has no tensor {name!r}")
            names_by_file[self.weight_map[name]].append(name)
        tensors: dict[str, torch.Tensor] = {}
        for file_name, file_names in names_by_file.items():
            try:
                tensors.update(self._read_file(file_name, file_names))
            except (SafetensorError, OSError) as error:
                if hub_snapshot(self.model_dir) is None:
                    raise CheckpointError(
                        f"cannot read {file_names[0]!r} from {file_name}: {error}"
                    ) from None
                self._handles[file_name] = self._refetched(file_name, error)
                try:
                    tensors.update(self._read_file(file_name, file_names))
                except (SafetensorError, OSError) as again:
                    raise CheckpointError(
                        f"cannot read {file_name}, also when fetched again: {again}"
                    ) from None
        return tensors

    def _read_file(self, file_name: str, names: list[str]) -> dict[str, torch.Tensor]:
        handle = self._handle(file_name)
        available = set(handle.keys())
        for name in names:
            if name not in available:
                raise CheckpointError(f"{self.model_dir / file_name} lacks {name!r} named in the index")
        return {name: handle.get_tensor(name) for name in names}
