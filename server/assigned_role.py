"""A managed server's role as the scheduler assigns it (`swarm-scheduler --roles auto`).

`Assignment.role` is `prefill`, `decode`, `both` or empty (both: a scheduler without `--roles auto`
or one older than the field). The server announces the role it adopts; clients route decode steps
only to servers that decode and send prompts to prefill servers by their own rule, so sessions
already open continue where they are and only new sessions follow the new role. A server started
with `--role prefill` or `--role decode` keeps that role and says once per assigned role that it
ignores it; an unknown role string is ignored with a warning (once per string).
"""

from __future__ import annotations

import logging

from llm_swarm.swarm.server_info import ServerRole

logger = logging.getLogger(__name__)


class AssignedRole:
    """The role a server announces: its `--role`, or the scheduler's where `--role` was left at both."""

    def __init__(self, configured: str):
        self.configured = ServerRole(configured)
        self.fixed = self.configured != ServerRole.BOTH  # an explicit --role prefill|decode stays
        self.role = self.configured
        self._reported: set[str] = set()  # roles already logged as ignored or unknown

    def follow(self, assigned: str) -> bool:
        """Adopt `assigned` (the scheduler's text); returns whether the announced role changed."""
        text = assigned.strip().lower() or ServerRole.BOTH.value
        try:
            wanted = ServerRole(text)
        except ValueError:
            if text not in self._reported:
                self._reported.add(text)
                logger.warning("the scheduler assigned an unknown role %r: ignored", assigned[:64])
            return False
        if self.fixed:
            if wanted != self.configured and text not in self._reported:
                self._reported.add(text)
                logger.info(
                    "started with --role %s: keeping it, ignoring the scheduler's role %s",
                    self.configured,
                    wanted,
                )
            return False
        if wanted == self.role:
            return False
        logger.info(
            "scheduler assigned role %s (was %s): open sessions continue, new ones follow it",
            wanted,
            self.role,
        )
        self.role = wanted
        return True
