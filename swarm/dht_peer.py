"""How every process of ours joins the DHT: identity, record validators and (closed swarms) authorizer.

Servers and schedulers write records, so they run with an identity (`swarm.identity`): the p2p
daemon's key is the key that signs their records. Clients and monitors only read, with the same
validators. Keeping this in one place means no node of ours ever runs without validation.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hivemind.dht import DHT
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.mpfuture import MPFuture

from llm_swarm.swarm.closed_swarm import SwarmSecret
from llm_swarm.swarm.dht_process import SwarmDHT
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.identity import load_identity, owner_subkey, public_key_text, temporary_identity_path
from llm_swarm.swarm.record_validator import swarm_validators


@dataclass(frozen=True)
class PeerIdentity:
    private_key: RSAPrivateKey
    path: str
    created: bool  # a fresh key nobody can hold yet (hivemind need not check that it is free)

    @property
    def public_key(self) -> str:
        return public_key_text(self.private_key)

    @property
    def owner(self) -> bytes:
        """The DHT subkey of this peer's records."""
        return owner_subkey(self.public_key)


def open_identity(path: str | None) -> PeerIdentity:
    """The identity in `path` (created if missing), or a fresh one for this run if `path` is None."""
    target = path if path is not None else temporary_identity_path()
    created = not Path(target).exists()
    return PeerIdentity(load_identity(target), target, created)


def forget_identity(identity: PeerIdentity) -> None:
    """Delete a per-run identity (made by `open_identity(None)`) and its private directory."""
    path = Path(identity.path)
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        path.parent.rmdir()


def dht_options(identity: PeerIdentity | None, secret: SwarmSecret | None) -> dict:
    """Keyword arguments for `hivemind.DHT` that make it one of our nodes."""
    options: dict = {"record_validators": swarm_validators(identity.private_key if identity else None)}
    if identity is not None:
        options["identity_path"] = identity.path
        if identity.created:
            options["check_if_identity_free"] = False
    if secret is not None:
        options["authorizer"] = secret.authorizer()
    return options


logger = logging.getLogger(__name__)

DHT_START_TIMEOUT = 30.0  # a peer is normally ready in about a second
DHT_START_ATTEMPTS = 3
CLIENT_BOOTSTRAP_WAIT = 0.0  # seconds a reader waits for the routing-table traversal before starting
STACK_DUMP_WAIT = 1.0  # seconds a stuck DHT process gets to write its threads' stacks
EXIT_WAIT = 5.0  # seconds a DHT process that reported a failure gets to exit by itself


class _DiagnosableDHT(SwarmDHT):
    """hivemind's DHT whose process writes every thread's stack to `stack_file` on SIGUSR1, so that a
    start that never finishes says where it is stuck instead of only timing out."""

    def __init__(self, *args, stack_file: str, **kwargs):
        super().__init__(*args, **kwargs)
        self._stack_file = stack_file

    def run(self) -> None:
        with open(self._stack_file, "w") as stacks:
            faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
            super().run()


def _stuck_report(dht: _DiagnosableDHT, stack_file: str) -> str:
    """What a DHT process that did not report ready was doing (or how it ended), for the log."""
    if not dht.is_alive():
        return f"its process ended with exit code {dht.exitcode}"
    with contextlib.suppress(ProcessLookupError):
        os.kill(dht.pid, signal.SIGUSR1)
    time.sleep(STACK_DUMP_WAIT)
    stacks = Path(stack_file).read_text(errors="replace").strip() if Path(stack_file).exists() else ""
    return "its process was still running; its threads:\n" + (stacks or "(no stacks were written)")


def start_dht(
    initial_peers: list[str],
    *,
    client_mode: bool = True,
    identity: PeerIdentity | None = None,
    secret: SwarmSecret | None = None,
) -> DHT:
    """A DHT peer of ours (validators, identity, authorizer), ready. Its background process has been
    seen (in CI, under load) to never report ready; `DHT(start=True)` would then wait forever, so each
    try is bounded, a stuck try is reported with its threads' stacks, and the next try starts afresh.
    Any other failure (e.g. no peer answers) is a clear error."""
    # a reader is ready once a bootstrap peer answered: hivemind would also wait for the traversal that
    # fills its routing table (one new connection per DHT node it meets: it grows with the swarm),
    # which goes on in the background and is not needed before the first lookup (each lookup starts
    # from the nodes it knows) (with one bootstrap peer only: the bound also cuts the wait for the
    # other peers' answers)
    quick = {"bootstrap_timeout": CLIENT_BOOTSTRAP_WAIT} if client_mode and len(initial_peers) == 1 else {}
    if client_mode:  # a reader's p2p daemon asks libp2p's DHT (to find peers) but does not serve it:
        quick["dht_mode"] = "client"  # no other daemon adds it to its routing table or refreshes with it
        # and it writes nothing: hivemind would send every value a read found to the nearest node that
        # lacked it (10-13 stores, each checked by its receiver, before a new client's first token at 24
        # servers); the roster needs no such copies (its writers store it on several nodes), and a reader
        # that writes is one more way to spread what it read
        quick["cache_nearest"] = 0
    report = ""
    for attempt in range(1, DHT_START_ATTEMPTS + 1):
        handle, stack_file = tempfile.mkstemp(prefix="dht-start-", suffix=".stacks")
        os.close(handle)
        dht = _DiagnosableDHT(
            initial_peers=initial_peers,
            client_mode=client_mode,
            start=False,
            stack_file=stack_file,
            **dht_options(identity, secret),
            **quick,
        )
        try:
            dht.run_in_background(await_ready=True, timeout=DHT_START_TIMEOUT)
            return dht
        except Exception as error:
            if not isinstance(error, TimeoutError):
                # it reported the error and leaves by itself; killing it at once could take a lock it
                # still holds (hivemind's futures share them between processes) with it
                dht.join(EXIT_WAIT)
                if dht.is_alive():
                    dht.kill()
                    dht.join(5)
                    MPFuture.reset_backend()
                closed = " (a closed swarm refuses peers without its secret)" if secret is None else ""
                raise SwarmUserError(
                    f"could not join the swarm's DHT at {initial_peers}: {error}{closed}"
                ) from None
            report = _stuck_report(dht, stack_file)
            if dht.is_alive():
                dht.kill()
            dht.join(5)
            logger.warning(
                "a DHT peer was not ready after %.0f s (try %d of %d): %s",
                DHT_START_TIMEOUT,
                attempt,
                DHT_START_ATTEMPTS,
                report,
            )
            if attempt == 1:  # the side that waits for "ready" may be the stuck one: its threads, once
                logger.warning("threads of the process waiting for that DHT peer:\n%s", _own_stacks())
            # hivemind's futures between processes share locks and one result pipe per process; a
            # process killed while holding one of them (or a stuck result reader) would keep every
            # later DHT of this process from reporting ready. Fresh ones for the next try.
            MPFuture.reset_backend()
        finally:
            Path(stack_file).unlink(missing_ok=True)
    raise SwarmUserError(
        f"could not start a DHT peer for initial peers {initial_peers} "
        f"({DHT_START_ATTEMPTS} tries of {DHT_START_TIMEOUT:.0f} s); the last one: {report[-6000:]}"
    )


def _own_stacks() -> str:
    with tempfile.TemporaryFile("w+") as stacks:
        faulthandler.dump_traceback(file=stacks, all_threads=True)
        stacks.seek(0)
        return stacks.read()
