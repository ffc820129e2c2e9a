"""Which servers a client avoids, and for how long: failed ones (doubling at each repeated failure),
outvoted or malformed ones (liars), and ones that keep refusing sessions while announcing room."""

from __future__ import annotations

import logging
import time

from llm_swarm.client.options import ClientOptions
from llm_swarm.swarm.wire import PEER_LIMIT_PREFIX

logger = logging.getLogger(__name__)


class ServerBans:
    def __init__(self, options: ClientOptions):
        self.options = options
        self._bans: dict[str, tuple[int, float]] = {}  # peer -> (failures so far, banned until)
        self._refusals: dict[str, int] = {}  # peer -> "no cache room" answers while announcing room
        self.caught: dict[str, int] = {}  # peer -> steps where replicas outvoted it (wrong outputs)
        self.no_cache_room_refusals = (
            0  # sessions a server refused for lack of cache (for operators and tests)
        )

    def ban(self, peer_id: str) -> float:
        """Avoid a failed server for a while, doubling the time at each repeated failure; returns it."""
        failures = self._bans.get(peer_id, (0, 0.0))[0] + 1
        duration = min(self.options.ban_base * 2 ** (failures - 1), self.options.ban_max)
        self._avoid(peer_id, duration, failures)
        return duration

    def ban_liar(self, peer_id: str) -> None:
        """A server that sent a wrong output: counted, and avoided for `liar_ban` seconds."""
        self.caught[peer_id] = self.caught.get(peer_id, 0) + 1
        self._avoid(peer_id, self.options.liar_ban, self._bans.get(peer_id, (0, 0.0))[0] + 1)

    def is_banned(self, peer_id: str) -> bool:
        ban = self._bans.get(peer_id)
        return ban is not None and ban[1] > time.monotonic()

    def refused(self, peer_id: str, message: str = "") -> bool:
        """Count a "no cache room" answer from a server whose record announced room; True (and a ban)
        once it keeps refusing: a server that announces room it never grants only wastes our time.
        A refusal for our own per-peer share is no fault of the server's: it is not counted."""
        self.no_cache_room_refusals += 1
        if message.startswith(PEER_LIMIT_PREFIX):  # our own share there is used up: go elsewhere a while
            self._avoid(peer_id, self.options.ban_base, self._bans.get(peer_id, (0, 0.0))[0])
            return False
        self._refusals[peer_id] = self._refusals.get(peer_id, 0) + 1
        if self._refusals[peer_id] < self.options.max_refusals:
            return False
        self._refusals.pop(peer_id)
        duration = self.ban(peer_id)
        logger.warning(
            "server %s refused %d sessions while announcing cache room: avoiding it for %.0f s",
            peer_id[-8:],
            self.options.max_refusals,
            duration,
        )
        return True

    def _avoid(self, peer_id: str, seconds: float, failures: int) -> None:
        self._bans[peer_id] = (failures, time.monotonic() + seconds)
