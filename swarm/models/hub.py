"""Models named on the Hugging Face Hub: fetch only what a process holds, from one commit.

A model argument that is an existing directory is a local checkpoint. Anything else is a Hub id
(`ORG/NAME`), read through `huggingface_hub` with its own settings (`HF_ENDPOINT`, `HF_HOME` /
`HF_HUB_CACHE`, `HF_TOKEN`, `HF_HUB_OFFLINE`) and its cache, which transformers shares.

`resolve_model` fetches the small files every process needs (the config, the shard index, the
generation config; for clients also the tokenizer's files) from one commit, which it resolves
first, and returns that commit's snapshot directory. Everything downstream takes that directory
like a local checkpoint. Weights are fetched later and only as read: `CheckpointReader` asks
`ensure_file` for each shard it opens, so a server fetches the shards of its span (and, when it
moves, only the new ones) and a client the shards that hold its embeddings, final norm and head.
Every file of a snapshot comes from the snapshot's own commit, so revisions never mix; the commit
is also in the swarm's default name (`swarm.dht_keys.default_prefix`), so servers and clients of
different commits never meet.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from llm_swarm.swarm.errors import CheckpointError, SwarmUserError
from llm_swarm.swarm.hub_snapshot import hub_snapshot

CONFIG_FILE = "config.json"
# what every process reads besides the config (absent ones are skipped)
MODEL_FILES = ("generation_config.json", "model.safetensors.index.json")
# what a client reads to tokenize and to apply a chat template
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
DOWNLOAD_ATTEMPTS = 2  # a download cut short is resumed once, from where it stopped

logger = logging.getLogger(__name__)

# a token given to `resolve_model` for a Hub model, by snapshot directory: the shards fetched later
# for that snapshot are fetched with it (None: huggingface_hub's own, HF_TOKEN or a stored login)
_TOKENS: dict[Path, str | None] = {}


def is_hub_id(model: str | Path) -> bool:
    """Whether `model` names a Hub model rather than an existing local directory."""
    return not Path(model).expanduser().exists()


def resolve_model(
    model: str | Path, revision: str | None = None, token: str | None = None, tokenizer: bool = False
) -> Path:
    """The checkpoint directory of `model`: a local directory as it is, or a Hub id's snapshot at
    `revision` (default: its main branch) with the config, shard index and generation config
    fetched (and the tokenizer's files, for a client). Weights are fetched as they are read."""
    if not is_hub_id(model):
        if revision is not None:
            raise SwarmUserError(f"a revision names a commit of a Hub model; {model} is a local directory")
        return Path(model).expanduser()
    repo_id = str(model)
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise CheckpointError(
            f"model directory {repo_id!r} does not exist, and it is not a Hub model id (ORG/NAME) either"
        ) from None
    with hub_errors(repo_id, revision):
        config = Path(hf_hub_download(repo_id, CONFIG_FILE, revision=revision, token=token))
    snapshot = config.parent
    _TOKENS[snapshot] = token
    commit = snapshot.name
    for name in MODEL_FILES + (TOKENIZER_FILES if tokenizer else ()):
        try:
            with hub_errors(repo_id, commit, name):
                hf_hub_download(repo_id, name, revision=commit, token=token)
        except CheckpointError as error:
            if not isinstance(error.__cause__, EntryNotFoundError | LocalEntryNotFoundError):
                raise
    return snapshot


def ensure_file(model_dir: Path, file_name: str, refetch: bool = False) -> Path:
    """The path of `file_name` in checkpoint `model_dir`, fetched first when `model_dir` is a Hub
    snapshot that does not hold it yet (or again, with `refetch`, when the copy held is corrupt).
    Raises `CheckpointError` when the file is missing and cannot be fetched."""
    path = model_dir / file_name
    snapshot = hub_snapshot(model_dir)
    if snapshot is None or (path.is_file() and not refetch):
        return path
    repo_id, commit = snapshot
    token = _TOKENS.get(model_dir)
    cache_dir = model_dir.parent.parent.parent
    with hub_errors(repo_id, commit, file_name):
        if not path.is_file() or refetch:
            check_disk_space(repo_id, commit, file_name, token, cache_dir)
        for attempt in range(DOWNLOAD_ATTEMPTS):
            try:
                return Path(
                    hf_hub_download(
                        repo_id,
                        file_name,
                        revision=commit,
                        token=token,
                        cache_dir=cache_dir,
                        force_download=refetch,
                    )
                )
            except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
                raise
            except Exception as error:  # a dropped link: the next attempt resumes the partial file
                if attempt + 1 == DOWNLOAD_ATTEMPTS:
                    raise
                logger.warning("fetching %s of %s stopped (%s): resuming", file_name, repo_id, error)
                refetch = False
    raise AssertionError("unreachable")


def has_pickled_weights(model_dir: Path) -> bool:
    """Whether the checkpoint holds PyTorch `.bin` weights (locally, or on the Hub for a snapshot)."""
    if any(model_dir.glob("*.bin")):
        return True
    snapshot = hub_snapshot(model_dir)
    if snapshot is None:
        return False
    repo_id, commit = snapshot
    for name in PICKLED_WEIGHTS:
        try:
            url = hf_hub_url(repo_id, name, revision=commit)
            get_hf_file_metadata(url, token=_TOKENS.get(model_dir))
            return True
        except Exception:  # absent, or the Hub out of reach: nothing to tell the user then
            continue
    return False


def check_disk_space(repo_id: str, commit: str, file_name: str, token: str | None, cache_dir: Path) -> None:
    """Refuse to start a download that the cache's disk cannot hold (the Hub says each file's size)."""
    size = get_hf_file_metadata(hf_hub_url(repo_id, file_name, revision=commit), token=token).size
    cache_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache_dir).free
    if size is not None and size > free:
        raise CheckpointError(
            f"not enough disk for {repo_id}/{file_name}: {size / 2**30:.2f} GiB to fetch, "
            f"{free / 2**30:.2f} GiB free in {cache_dir} (set HF_HUB_CACHE to a larger disk)"
        )


@contextlib.contextmanager
def hub_errors(repo_id: str, revision: str | None, file_name: str = CONFIG_FILE) -> Iterator[None]:
    """Turns huggingface_hub's errors into `CheckpointError`s that say what to do."""
    where = repo_id + (f" at revision {revision}" if revision else "")
    try:
        yield
    except CheckpointError:
        raise
    except GatedRepoError as error:  # a kind of RepositoryNotFoundError: first
        raise CheckpointError(
            f"{repo_id} is gated: accept its licence on the Hub, then set HF_TOKEN (or pass --token)"
        ) from error
    except RepositoryNotFoundError as error:
        raise CheckpointError(
            f"no model {repo_id} on the Hub (a private one needs HF_TOKEN or --token)"
        ) from error
    except RevisionNotFoundError as error:
        raise CheckpointError(f"{repo_id} has no revision {revision!r}") from error
    except LocalEntryNotFoundError as error:  # a kind of EntryNotFoundError: first
        raise CheckpointError(
            f"{where}: {file_name} is not in the Hub cache and the Hub cannot be reached "
            "(offline, or HF_HUB_OFFLINE=1)"
        ) from error
    except EntryNotFoundError as error:
        raise CheckpointError(f"{where} has no file {file_name}") from error
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot fetch {file_name} of {where}: {error}") from error
