"""Output-length prediction: the pure predictor, what the scheduler learns from end
reports (through `SchedulerCore`, without the network), and the simulator's `--length-info`."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_swarm.client.options import ClientOptions
from llm_swarm.scheduler.service.core import CoreSettings, SchedulerCore
from llm_swarm.scheduler.service.planner import PlanSettings
from llm_swarm.scheduler.sim import length_info
from llm_swarm.scheduler.sim.cli import main as sim_main
from llm_swarm.scheduler.sim.discrete_events import simulate
from llm_swarm.scheduler.sim.monte_carlo import CellConfig, make_requests, make_scenario, run_seed
from llm_swarm.scheduler.sim.policies import NONE, build_dispatcher
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.length_prediction import (
    MAX_LENGTH,
    MIN_OBSERVATIONS,
    NUM_OUTPUT_BUCKETS,
    NUM_PROMPT_BUCKETS,
    OutputLengthPredictor,
    SessionLengthLearner,
    output_bucket,
    prompt_bucket,
)
from llm_swarm.swarm.route_request import RouteRequest, SessionShape
from llm_swarm.swarm.server_info import ServerInfo, ServerState
from tests.test_scheduler_core import BLOCK, SHAPE, TOKEN, L, info

pytestmark = pytest.mark.version_neutral  # scheduler and simulator code: no transformers

lengths_strategy = st.lists(st.integers(1, 5000), min_size=1, max_size=300)

# -- the predictor ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1, 0, 2.5, MAX_LENGTH + 1, True, "12", None])
def test_observations_and_queries_that_are_not_token_counts_are_refused(bad):
    predictor = OutputLengthPredictor()
    with pytest.raises(ValueError, match="l_out"):
        predictor.observe(10, bad)
    with pytest.raises(ValueError, match="l_in"):
        predictor.observe(bad, 10)
    with pytest.raises(ValueError, match="l_in"):
        predictor.predict(bad)
    assert predictor.observations == 0


@pytest.mark.parametrize("bad", ["x" * 65, "tab\there", "new\nline", 7])
def test_labels_are_short_printable_strings(bad):
    with pytest.raises(ValueError, match="label"):
        OutputLengthPredictor().observe(10, 10, bad)


def test_bad_settings_are_refused():
    for kwargs in ({"statistic": "mode"}, {"default": 0}, {"min_observations": 0}, {"window": 2}):
        with pytest.raises(ValueError):
            OutputLengthPredictor(**kwargs)


@settings(max_examples=60, deadline=None)
@given(lengths_strategy, st.integers(1, 100_000))
def test_the_mean_and_median_are_those_of_the_observations(lengths, l_in):
    mean = OutputLengthPredictor(min_observations=1)
    median = OutputLengthPredictor(statistic="median", min_observations=1)
    for length in lengths:
        mean.observe(l_in, length)
        median.observe(l_in, length)
    assert mean.predict(l_in).length == max(round(statistics.fmean(lengths)), 1)
    ordered = sorted(lengths)
    low, high = ordered[(len(ordered) - 1) // 2], ordered[len(ordered) // 2]
    # the grouped median lies in the bins of the middle observations (bins are at most ~9% wide)
    assert low / 1.1 - 1 <= median.predict(l_in).length <= high * 1.1 + 1
    if len(set(lengths)) == 1 and lengths[0] <= 32:  # short lengths have a bin each: exact
        assert median.predict(l_in).length == lengths[0]


@settings(max_examples=60, deadline=None)
@given(lengths_strategy, st.integers(1, MAX_LENGTH), st.sampled_from(["mean", "median"]))
def test_predictions_stay_within_the_declared_cap(lengths, cap, statistic):
    predictor = OutputLengthPredictor(statistic=statistic, min_observations=1)
    for length in lengths:
        predictor.observe(100, length)
    answer = predictor.predict(100, cap=cap)
    assert 1 <= answer.length <= cap
    assert 0 <= answer.bucket <= output_bucket(cap)
    # within the observations' range, up to the width of the longest one's bin (at most ~9%)
    assert min(lengths) / 1.1 - 1 <= predictor.predict(100, cap=MAX_LENGTH).length <= max(lengths) * 1.1 + 1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=MIN_OBSERVATIONS, max_size=200))
def test_the_bucket_is_the_likeliest_200_token_bucket(lengths):
    predictor = OutputLengthPredictor()
    for length in lengths:
        predictor.observe(50, length)
    counts = np.bincount([output_bucket(length) for length in lengths], minlength=NUM_OUTPUT_BUCKETS)
    assert predictor.predict(50).bucket == int(np.argmax(counts))


def test_sparse_buckets_fall_back_to_the_label_then_everyone_then_the_constant():
    predictor = OutputLengthPredictor(default=128)
    assert predictor.predict(1000).source == "constant" and predictor.predict(1000).length == 128
    for _ in range(MIN_OBSERVATIONS):
        predictor.observe(1000, 300, "chat")  # prompt bucket 9 (512..1023)
    for _ in range(MIN_OBSERVATIONS):
        predictor.observe(40, 10)  # prompt bucket 5 (32..63), unlabelled
    assert predictor.predict(1000, "chat").source == "label+prompt"
    assert predictor.predict(40, "chat").source == "label"  # the label beats the prompt length
    assert predictor.predict(40, "chat").length == 300
    assert predictor.predict(40).length == 10 and predictor.predict(40).source == "prompt"
    assert predictor.predict(5000).source == "global"  # no prompt of that size seen
    assert predictor.predict(5000).length == (300 + 10) // 2
    assert predictor.predict(5000, "code").source == "global"  # an unknown label
    assert prompt_bucket(1) == 0 and prompt_bucket(1023) == 9 and prompt_bucket(MAX_LENGTH) == 20


def test_memory_is_bounded_whatever_is_observed():
    predictor = OutputLengthPredictor(max_labels=4, window=32, min_observations=4)
    rng = np.random.default_rng(0)
    for k in range(3000):
        predictor.observe(int(rng.integers(1, MAX_LENGTH)), int(rng.integers(1, MAX_LENGTH)), f"label-{k}")
    assert len(predictor.labels) == 4
    assert predictor.num_histograms <= (1 + 4) * (1 + NUM_PROMPT_BUCKETS)
    assert predictor.predict(10).observations < 2 * 32  # old observations fade: counts stay bounded
    # labels past the limit are learned as unlabelled sessions, and asking about them works
    assert predictor.predict(10, "label-2999").source in ("prompt", "global")


def test_old_observations_fade_so_the_prediction_follows_a_change():
    predictor = OutputLengthPredictor(window=64)
    for _ in range(200):
        predictor.observe(10, 500)
    for _ in range(400):
        predictor.observe(10, 20)
    assert predictor.predict(10).length < 30


# -- the scheduler's learning path ---------------------------------------------------------------------


def test_reports_are_clamped_to_the_declared_length_and_bad_ones_teach_nothing():
    learner = SessionLengthLearner(OutputLengthPredictor(min_observations=1))
    for tokens in (-5, 2.5, math.nan, "9", True, MAX_LENGTH):
        assert not learner.session_ended("c", 10, 60, tokens, ttft=1.0)
    assert not learner.session_ended("c", 10, 60, 0, ttft=0.0)  # nothing reported (proto3's 0)
    assert not learner.session_ended("c", 10, 60, 0, ttft=math.nan)
    assert learner.predictor.observations == 0
    assert learner.session_ended("c", 10, 60, 0, ttft=0.5)  # a first token and no later step: 1 token
    assert learner.predictor.predict(10).length == 1
    assert learner.session_ended("liar", 10, 60, 100_000)  # clamped to the 60 it declared
    assert learner.predictor.predict(10).length == round((1 + 60) / 2)


def test_one_client_holds_at_most_its_share_of_recent_observations():
    learner = SessionLengthLearner(OutputLengthPredictor(), window=40, share=0.25)
    learned = [learner.session_ended("liar", 10, 2048, 2047) for _ in range(40)]
    assert sum(learned) == 10  # a quarter of the last 40 ended sessions
    for k in range(200):
        learner.session_ended(f"honest-{k}", 10, 2048, 11)  # 12-token answers
    # the liar's reports rolled out of the window; it may teach again, a quarter at most
    learned = [learner.session_ended("liar", 10, 2048, 2047) for _ in range(40)]
    assert sum(learned) == 10
    assert learner.predictor.predict(10).length < 2048 * 0.25


SLOT = TOKEN * (4 + 60)  # s_c for the core's l_in=4, l_out=60


def _server(sessions: int, span: tuple[int, int] | None = None) -> ServerInfo:
    """One server of every block with cache room for `sessions` sessions of one slot per block."""
    state = ServerState.ONLINE if span else ServerState.JOINING
    return info(L * BLOCK + sessions * SLOT * L, 0.001, span, state=state, slot_tokens=64)


def _core(prediction: bool, sessions: int = 4) -> SchedulerCore:
    settings_ = CoreSettings(
        plan=PlanSettings(num_requests=1), l_in=4, l_out=60, settle=0.0, l_out_prediction=prediction
    )
    core = SchedulerCore(SHAPE, settings_, 0.0)
    core.update_roster({"peer-a": _server(sessions)}, 0.0)
    core.review(0.1)
    span = core.assignment["peer-a"]
    core.update_roster({"peer-a": _server(sessions, (span.start, span.end))}, 0.2)
    return core


def _route(core: SchedulerCore, client: str, l_out: int, now: float, task: str = ""):
    return core.route(RouteRequest(client, {"peer-a": 0.01}, SessionShape(1, 64, 4, l_out), task), now)


@pytest.mark.parametrize("prediction", [True, False])
def test_the_scheduler_learns_answer_lengths_from_ended_sessions(prediction):
    """Clients declare 60 tokens and generate 12 (11 steps after the first): once enough sessions
    ended, the scheduler with --l-out-prediction routes as if they had declared 12; without the
    flag it learns the same but keeps routing by the declared 60."""
    core = _core(prediction)
    declared = _route(core, "c0", 60, 1.0)
    core.end_session(declared.session.session_id, ttft=0.1, tpot=0.01, tokens=11, now=1.5)
    told_twelve = _route(_core(prediction), "c0", 12, 1.0).completion
    now = 2.0
    for k in range(MIN_OBSERVATIONS):
        decision = _route(core, f"c{k % 3}", 60, now)
        assert decision.session.admitted
        now += 0.5
        core.end_session(decision.session.session_id, ttft=0.1, tpot=0.01, tokens=11)
    assert core.lengths.predictor.observations == MIN_OBSERVATIONS + 1
    later = _route(core, "c9", 60, now)
    expected = told_twelve if prediction else declared.completion
    assert later.completion == pytest.approx(expected)
    # the declared length stays the bound: a client asking for 5 tokens is routed by 5
    assert _route(core, "c8", 5, now).completion < later.completion


def test_lengths_are_learned_per_declared_task_label():
    """ "code" sessions answer 50 tokens, "chat" ones 6: once each label has enough ended sessions, a
    session is routed by its own label's length, an unlabelled one by everyone's."""
    core = _core(prediction=True)
    routed_as = {
        length: _route(_core(prediction=True), "probe", length, 1.0).completion for length in (6, 50)
    }
    now = 2.0
    for k in range(2 * MIN_OBSERVATIONS):
        task, steps = ("code", 49) if k % 2 else ("chat", 5)
        decision = _route(core, f"c{k % 4}", 60, now, task)
        now += 0.5
        core.end_session(decision.session.session_id, ttft=0.1, tpot=0.01, tokens=steps)
    assert _route(core, "c9", 60, now, "chat").completion == pytest.approx(routed_as[6], rel=1e-6)
    assert _route(core, "c9", 60, now, "code").completion == pytest.approx(routed_as[50], rel=1e-6)
    assert routed_as[6] < _route(core, "c9", 60, now).completion < routed_as[50]
    with pytest.raises(SwarmUserError, match="task_label"):
        ClientOptions(task_label="x" * 65)


def test_only_sessions_the_scheduler_admitted_teach_it_once_each():
    core = _core(prediction=True, sessions=1)
    running = _route(core, "c0", 60, 1.0)
    waiting = _route(core, "c1", 60, 1.0)  # the server has room for one: it waits
    assert running.session.admitted and not waiting.session.admitted
    core.end_session(waiting.session.session_id, tokens=30, ttft=0.1)  # never ran: not learned
    assert core.lengths.predictor.observations == 0
    core.end_session(running.session.session_id, tokens=30, ttft=0.1)
    core.end_session(running.session.session_id, tokens=30, ttft=0.1)  # a second end: unknown session
    core.end_session("never-routed", tokens=30, ttft=0.1)
    assert core.lengths.predictor.observations == 1


# -- the simulator -------------------------------------------------------------------------------------


def test_length_info_is_checked_where_the_config_is_made():
    for bad in ("constant:0", "constant:x", "constant:", "predicted:3", "exact"):
        with pytest.raises(ValueError, match="--length-info"):
            CellConfig(length_info=bad)
    assert CellConfig(length_info="constant:64").length_info == "constant:64"
    assert CellConfig(arrivals="azure").declared_l_out == length_info.TRACE_MAX_NEW_TOKENS
    assert CellConfig(arrivals="azure", max_l_out=512).declared_l_out == 512
    assert CellConfig().declared_l_out is None


TRACE_CELL = {"scenario": "ripe", "arrivals": "azure", "l_in": 8192, "requests": 120, "setup": "none"}


def _run(config: CellConfig, seed: int, lengths):
    rng = np.random.default_rng(seed)
    scenario = make_scenario(config, rng)
    requests = make_requests(config, rng)
    rate = (len(requests) - 1) / (requests[-1].arrival - requests[0].arrival)
    dispatcher = build_dispatcher(config.policy, scenario, rate, rng, NONE, lengths)
    return simulate(scenario.servers, scenario.model, dispatcher, requests, scenario.prefill), dispatcher


def test_live_admission_with_true_lengths_starts_requests_when_eq_20_said():
    """With exact lengths, starting a request as soon as its chain has room (the live scheduler's
    admission, used for estimated lengths) is starting it at eq. 20's wait (the oracle's rule)."""
    config = CellConfig(**TRACE_CELL)
    timed, _ = _run(config, 1, None)
    admitted, dispatcher = _run(config, 1, length_info.OracleLengths())
    assert any(r.start > r.arrival for r in timed.records)  # sessions do queue here
    assert [r.start for r in admitted.records] == pytest.approx([r.start for r in timed.records])
    assert [dispatcher.told_waits[r.id] for r in admitted.records] == pytest.approx(
        [r.start - r.arrival for r in admitted.records]
    )


@pytest.mark.parametrize("spec", ["constant:128", "max-new-tokens", "predicted"])
def test_every_length_source_serves_every_request_for_its_true_length(spec):
    config = CellConfig(**TRACE_CELL, length_info=spec)
    oracle = run_seed(CellConfig(**TRACE_CELL), 1)
    result = run_seed(config, 1)
    assert len(result.records) == config.requests  # the engine checks memory at every start
    # the engine runs each for its true length, whatever routing assumed
    assert [r.l_out for r in result.records] == [r.l_out for r in oracle.records]
    assert all(p <= c for p, c in zip(result.peak_slots, result.slot_capacity, strict=True))


def test_the_predicted_source_learns_from_finished_requests():
    config = CellConfig(**TRACE_CELL, length_info="predicted")
    source = length_info.length_source(config.length_info, config.l_out, config.declared_l_out)
    result, dispatcher = _run(config, 2, source)
    assert source.predictor.observations == len(result.records)
    told = np.array([dispatcher.told_waits[r.id] for r in result.records])
    constant, constant_dispatcher = _run(config, 2, length_info.ConstantLengths(128))
    told_constant = np.array([constant_dispatcher.told_waits[r.id] for r in constant.records])
    measured = np.array([r.start - r.arrival for r in result.records])
    measured_constant = np.array([r.start - r.arrival for r in constant.records])
    # answers of ~30 tokens: the constant 128 tells far longer waits than happen, the predictor less so
    assert np.abs(told - measured).mean() < np.abs(told_constant - measured_constant).mean()


def test_swarm_sim_takes_the_flag(capsys):
    argv = ["--scenario", "ripe", "--arrivals", "azure", "--requests", "30", "--seeds", "1", "--json"]
    assert sim_main([*argv, "--length-info", "predicted"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["length_info"] == "predicted"
    assert sim_main([*argv, "--length-info", "nope"]) == 2
    assert "--length-info must be one of" in capsys.readouterr().err


# -- the server's side: its engine's decode work ahead (server/session_lengths.py) -----------------------


def test_the_residual_length_of_a_running_session_follows_the_tail():
    predictor = OutputLengthPredictor()
    for k in range(100):  # 90 answers of 10 tokens, 10 of 200: mean 29
        predictor.observe(64, 200 if k % 10 == 0 else 10)
    assert predictor.predict_remaining(64, 0, cap=1000) == pytest.approx(29, abs=1)
    # past 10 tokens only the long answers remain: about 200 - 50 left at 50
    assert predictor.predict_remaining(64, 50, cap=1000) == pytest.approx(150, abs=8)
    assert predictor.predict_remaining(64, 50, cap=60) == 10  # never past the cap
    assert predictor.predict_remaining(64, 500, cap=1000) == 500  # longer than anything seen: the cap
    assert OutputLengthPredictor().predict_remaining(64, 3, cap=100) == 97  # nothing learned: the cap
    for bad in (-1, 1.5, None):
        with pytest.raises(ValueError):
            predictor.predict_remaining(64, bad, cap=100)


def test_a_server_learns_its_sessions_lengths_and_expects_less_decode_work():
    import torch

    from llm_swarm.server.engine import _Step
    from llm_swarm.server.session import Session
    from llm_swarm.server.session_lengths import SessionLengths
    from llm_swarm.swarm.models.cache import SpanCache

    lengths = SessionLengths()

    def session(peer: str, prompt: int = 20, max_length: int = 2068) -> Session:
        cache = SpanCache(1, 1, 1, 4, max_length, torch.float32)
        return Session(uuid_like(peer), peer, 0, 1, 1, max_length, cache, 0)

    def uuid_like(peer: str) -> str:
        return f"{peer}-{len(lengths.learner._recent)}"

    fresh = session("p0")
    lengths.saw_step(fresh, 0, 20)
    assert lengths.ahead(fresh, 25) == 2068 - 25  # nothing learned yet: the cache room
    for k in range(40):  # 40 sessions of several peers, each answering 12 tokens of 2,048 allowed
        done = session(f"peer{k % 8}")
        lengths.saw_step(done, 0, 20)
        done.cache.length = 20 + 12 - 1
        assert lengths.ended(done)
    assert lengths.ahead(fresh, 20) == 11  # its first decode step: 12 tokens in all, 1 from the prefill
    assert lengths.ahead(fresh, 20 + 30) == 2068 - 50  # past every answer seen: the cache room again
    replayed = session("p1")  # a session whose prompt this server never saw teaches and expects nothing
    replayed.cache.length = 500
    assert lengths.ahead(replayed, 500) is None and not lengths.ended(replayed)
    step = _Step(None, fresh.cache, torch.zeros(1, 1, 4), 20, None, arrived=0.0)
    assert step.ahead == 2068 - 20
    step.expected_ahead = lengths.ahead(fresh, 20)
    assert step.ahead == 11
