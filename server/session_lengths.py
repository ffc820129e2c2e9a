"""How long this server's sessions keep decoding: the engine's decode-work term from learned lengths.

The engine's rule between a waiting prefill and the decode steps (Pang et al., `swarm.step_scheduler`)
weighs the decode work still ahead of the waiting sessions (`C_d`). Without more, a session's work
ahead is its cache room: the `max_length` its client reserved, usually `max_new_tokens` more than the
prompt, which real answers mostly stay far below (the Azure code trace: median 13 generated tokens).
Here the server learns the answer lengths of its own sessions (`swarm.length_prediction`, per
prompt-length bucket) and expects of a running session the mean residual length: what sessions of
its prompt length that got this far generated beyond it on average.

What is learned is seen, not claimed: the prompt is the session's step at position 0, and the answer
the positions its cache reached. A client still controls its own sessions' lengths, so at most a
share of recent observations come from one peer (`SessionLengthLearner`), and what is learned only
moves this server's choice between prefilling and decoding, never admission or anyone's output.
Sessions whose prompt this server did not see (a replay's catch-up, a handed-off cache) teach
nothing and keep the cache room as their work ahead.
"""

from __future__ import annotations

from llm_swarm.server.session import Session
from llm_swarm.swarm.length_prediction import OutputLengthPredictor, SessionLengthLearner


class SessionLengths:
    def __init__(self) -> None:
        self.learner = SessionLengthLearner(OutputLengthPredictor())

    @staticmethod
    def saw_step(session: Session, position: int, tokens: int) -> None:
        if position == 0 and session.prompt_tokens is None:
            session.prompt_tokens = tokens

    def ahead(self, session: Session, position: int) -> int | None:
        """Tokens a decode step at `position` is expected to have still ahead of it, this one
        included (None: unknown, the engine uses the cache room)."""
        prompt = session.prompt_tokens
        room = session.max_length - position
        if prompt is None or position < prompt or room < 1 or session.max_length <= prompt:
            return None
        # the prefill produced token 1; a step at `position` feeds token `position - prompt + 1` and
        # produces the next; the last position a session may feed produces token `cap`
        cap = session.max_length - prompt + 1
        generated = min(position - prompt + 1, cap)
        return min(self.learner.predictor.predict_remaining(prompt, generated, cap=cap), room)

    def ended(self, session: Session) -> bool:
        """Learn from a closing session (before its cache is dropped); returns whether it taught."""
        prompt, cache = session.prompt_tokens, session.cache
        if prompt is None or cache is None or cache.length < prompt or session.max_length <= prompt:
            return False
        generated = cache.length - prompt + 1  # the last generated token is never fed back
        return self.learner.session_ended(
            session.peer, prompt, session.max_length - prompt + 1, tokens=generated - 1, ttft=1.0
        )
