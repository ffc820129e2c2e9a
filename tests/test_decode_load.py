"""The server's measured slowdown per decoding session (`server.decode_load`), on hand-made steps."""

from __future__ import annotations

import pytest

from llm_swarm.server.decode_load import DecodeLoad

pytestmark = pytest.mark.version_neutral  # no transformers code: one leg runs it


def test_the_fit_gives_each_sessions_share_per_block_once_enough_varied_steps_were_seen():
    load = DecodeLoad(horizon=0.5, min_steps=10)
    assert load.decoding("a", now=0.0) == 1
    for _ in range(20):  # alone: 40 ms a step, nothing to fit a slope on
        load.observe(1, 0.040)
    assert load.tau_per_session(num_blocks=4) is None  # one load level only
    assert load.decoding("b", now=0.1) == 2 and load.decoding("c", now=0.2) == 3
    for _ in range(20):  # three sessions at once: 80 ms a step, 20 ms per session
        load.observe(3, 0.080)
    assert load.tau_per_session(num_blocks=4) == pytest.approx(0.020 / 4, rel=1e-2)


def test_sessions_stop_counting_when_they_end_or_go_quiet_and_bad_readings_are_ignored():
    load = DecodeLoad(horizon=0.5, min_steps=1)
    load.decoding("a", now=0.0)
    load.decoding("b", now=0.1)
    load.forget("b")
    assert load.decoding("c", now=0.2) == 2  # a, c
    assert load.decoding("d", now=0.9) == 1  # a and c sent nothing for more than 0.5 s
    for sessions, seconds in ((0, 1.0), (2, float("nan")), (2, -1.0)):
        load.observe(sessions, seconds)
    assert load.tau_per_session(num_blocks=4) is None  # nothing was measured
