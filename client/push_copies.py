"""When the client sends its own copy of a chain step to a server whose predecessor pushes it there
(`ClientOptions.push_copy_after="auto"`).

In a chain session each server pushes its output to the next one, and the client also has that output
(the server's answer): it sends it too, in case the push fails or comes late. While pushes work the copy
is work for nothing: the client's upload, the server's parsing of a message it then drops, and on a host
or LAN where a hop is CPU-bound, time on the token's path. So the copy waits: `COPY_FACTOR` times as
long as that server's pushed answers have taken (a moving average of the wait from asking to its
answer), at least `MIN_WAIT`. A step whose answer was not pushed (the push failed, came late, or the
copy won the race) sends the next step's copy at once, until a pushed answer comes again: a server
that pushes nothing costs one delayed step, not one per step. Until a first pushed answer has been
timed, the copy goes at once."""

from __future__ import annotations

from dataclasses import dataclass

COPY_FACTOR = 3.0  # the copy waits this many times the server's usual pushed answer
MIN_WAIT = 0.002  # seconds: a pushed answer on one host takes about a millisecond, give or take a tick
SMOOTHING = 0.2  # weight of the newest pushed answer in the moving average


@dataclass
class PushCopies:
    """One server session's pushed answers: how long they take, and whether the last one failed."""

    answer_seconds: float | None = None  # moving average of the wait from asking to a pushed answer
    failing: bool = False  # the last step's answer was not pushed: the next copy goes at once

    def copy_after(self) -> float | None:
        """Seconds the next step's copy waits for a pushed answer (None: it is sent at once)."""
        if self.failing or self.answer_seconds is None:
            return None
        return max(MIN_WAIT, COPY_FACTOR * self.answer_seconds)

    def answered(self, seconds: float, pushed: bool) -> None:
        """A step's answer came `seconds` after the client asked for it; `pushed`: the server ran it
        from its predecessor's push."""
        if pushed:
            last = self.answer_seconds
            self.answer_seconds = seconds if last is None else (1 - SMOOTHING) * last + SMOOTHING * seconds
        self.failing = not pushed
