"""Output-length prediction: how well `swarm.length_prediction` predicts the Azure code
trace's answer lengths, and what it does to simulated WS-RR waiting.

    .venv/bin/python -m benchmarks.scheduling.length_prediction [--requests 1000] [--seeds 12] [--write]

1. Prediction: train on the first half of `data/azure_llm_inference_trace_code_2023.csv` (in time
   order), test on the second half: 200-token bucket accuracy (TetriInfer's measure; the
   predictor's likeliest bucket) and mean absolute error of the predicted length, next to the
   constant 128 (the scheduler's default `--l-out`).
2. Simulation: `swarm-sim`'s `ripe` scenario (Sun, He and Hou's RIPE Atlas deployment, cg-bp = CG-BP +
   WS-RR, no set-up delay) replaying `--requests` consecutive requests of the trace's second half
   at their recorded times, each seed a random window and deployment. Cache slots are sized for
   `--l-in` prompt tokens (8,192: the trace's longest prompts fit a slot), so sessions queue. Every
   length source routes the same requests on the same servers: `constant:128`, `max-new-tokens`
   (2,048: what a client of this trace declares), the predictor (warm-started on the first half,
   then learning online from finished requests; mean and median) and `oracle` (true lengths). It
   reports the measured waits (mean, p99) and the error of the wait WS-RR told each request at
   routing (mean |told - measured|), and the fraction of the constant -> oracle gap the predicted
   (mean) source closes. Bounds beside it say how much per-request knowledge closing the gap takes:
   the predictor trained on the test half, and sources that know each answer's true 200-token
   bucket, quartile or decile (`KnownClass`; no live scheduler has these).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.common import parse_bench_args, publish_table
from llm_swarm.scheduler.sim import length_info, workload
from llm_swarm.scheduler.sim.discrete_events import simulate
from llm_swarm.scheduler.sim.monte_carlo import CellConfig, make_scenario
from llm_swarm.scheduler.sim.policies import NONE, build_dispatcher
from llm_swarm.swarm.length_prediction import OutputLengthPredictor, output_bucket

ROOT = Path(__file__).resolve().parents[2]

BASELINE = 128
CAP = length_info.TRACE_MAX_NEW_TOKENS
HEADER = "## Output-length prediction"


def trained(records: list[workload.TraceRecord], statistic: str) -> OutputLengthPredictor:
    predictor = OutputLengthPredictor(default=BASELINE, statistic=statistic)
    for record in records:
        predictor.observe(record.l_in, record.l_out)
    return predictor


def prediction_rows(train: list[workload.TraceRecord], test: list[workload.TraceRecord]) -> list[str]:
    truth = np.array([r.l_out for r in test])
    true_buckets = np.array([output_bucket(r.l_out) for r in test])
    rows = [
        "| predictor (trained on the first half) | 200-token bucket accuracy | mean abs. error (tokens) "
        "| mean error (tokens) |",
        "|---|---:|---:|---:|",
    ]
    constant = np.full(len(test), BASELINE)
    accuracy = float(np.mean(true_buckets == output_bucket(BASELINE)))
    rows.append(_prediction_row(f"constant {BASELINE}", accuracy, constant, truth))
    predictors = {f"predicted ({s})": trained(train, s) for s in ("mean", "median")}
    # the best a predictor that sees only prompt lengths can do: trained on the test half itself
    predictors["in-sample bound (mean, trained on the test half)"] = trained(test, "mean")
    for name, predictor in predictors.items():
        answers = [predictor.predict(r.l_in, cap=CAP) for r in test]
        lengths = np.array([a.length for a in answers])
        accuracy = float(np.mean(true_buckets == np.array([a.bucket for a in answers])))
        rows.append(_prediction_row(name, accuracy, lengths, truth))
    return rows


def _prediction_row(name: str, accuracy: float, lengths: np.ndarray, truth: np.ndarray) -> str:
    error = lengths - truth
    return f"| {name} | {accuracy * 100:.1f}% | {np.abs(error).mean():.1f} | {error.mean():+.1f} |"


class KnownClass:
    """A length source that knows which class of lengths (between `edges`) each answer falls in and
    routes it by the class's mean on the train half: what a perfect classifier of that resolution
    would give (bench-only: no live source can know this)."""

    def __init__(self, train: list[workload.TraceRecord], edges: list[float]):
        self.edges = np.asarray(edges)
        lengths = np.array([r.l_out for r in train])
        classes = np.searchsorted(self.edges, lengths, side="right")
        self.means = {c: float(lengths[classes == c].mean()) for c in np.unique(classes)}
        self.overall = float(lengths.mean())

    def estimate(self, request) -> int:
        cls = int(np.searchsorted(self.edges, request.l_out, side="right"))
        return max(1, round(self.means.get(cls, self.overall)))

    def observe(self, request) -> None:
        pass


def sources(train: list[workload.TraceRecord], test: list[workload.TraceRecord]) -> dict[str, object]:
    """name -> a factory of the length source (a fresh one per run: predictors learn during it).
    The `BOUNDS` are not sources a live scheduler can have: they say how much per-request knowledge
    closing the gap takes."""
    lengths = np.array([r.l_out for r in train])
    buckets = [BUCKET * (i + 1) for i in range(CAP // BUCKET)]
    return {
        f"constant:{BASELINE}": lambda: length_info.ConstantLengths(BASELINE),
        f"max-new-tokens ({CAP})": lambda: length_info.DeclaredLengths(CAP),
        "predicted (mean)": lambda: length_info.PredictedLengths(trained(train, "mean"), CAP),
        "predicted (median)": lambda: length_info.PredictedLengths(trained(train, "median"), CAP),
        BOUNDS[0]: lambda: length_info.PredictedLengths(trained(test, "mean"), CAP),
        BOUNDS[1]: lambda: KnownClass(train, buckets),
        BOUNDS[2]: lambda: KnownClass(train, list(np.quantile(lengths, [0.25, 0.5, 0.75]))),
        BOUNDS[3]: lambda: KnownClass(train, list(np.quantile(lengths, np.arange(1, 10) / 10))),
        "oracle": lambda: None,
    }


BUCKET = 200  # TetriInfer's output buckets (`swarm.length_prediction.output_bucket`)
BOUNDS = (
    "bound: predictor trained on the test half",
    "bound: true 200-token bucket (a perfect TetriInfer classifier)",
    "bound: true quartile of the length",
    "bound: true decile of the length",
)


def simulate_waits(config: CellConfig, test: list[workload.TraceRecord], seed: int, lengths) -> tuple:
    """(measured waits, told waits) of one seed: the same deployment and requests for every source."""
    rng = np.random.default_rng(seed)
    scenario = make_scenario(config, rng)
    requests = workload.trace_replay(test, config.requests, None, None, rng)
    rate = (len(requests) - 1) / max(requests[-1].arrival - requests[0].arrival, 1e-9)
    dispatcher = build_dispatcher(config.policy, scenario, rate, rng, NONE, lengths)
    result = simulate(scenario.servers, scenario.model, dispatcher, requests, scenario.prefill)
    measured = np.array([r.start - r.arrival - r.setup for r in result.records])
    told = np.array([dispatcher.told_waits[r.id] for r in result.records])
    return measured, told


def simulation_rows(train, test, requests: int, seeds: int, l_in: int) -> tuple[list[str], dict]:
    config = CellConfig(
        scenario="ripe", policy="cg-bp", arrivals="azure", l_in=l_in, l_out=BASELINE, requests=requests,
        setup="none",
    )  # fmt: skip
    results = {}
    for name, make in sources(train, test).items():
        runs = [simulate_waits(config, test, seed, make()) for seed in range(seeds)]
        measured = np.concatenate([m for m, _ in runs])
        told = np.concatenate([t for _, t in runs])
        results[name] = {
            "mean": float(measured.mean()),
            "p99": float(np.percentile(measured, 99)),
            "error": float(np.abs(told - measured).mean()),
            "bias": float((told - measured).mean()),
        }
    rows = [
        "| length info | wait mean (s) | wait p99 (s) | told wait: mean abs. error (s) | told - measured (s) "
        "| constant -> oracle gap closed (wait mean / p99 / told-wait error) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    constant, oracle = results[f"constant:{BASELINE}"], results["oracle"]
    for name, r in results.items():
        closed = ""
        if name.startswith(("predicted", "bound")):
            closed = " / ".join(f"{gap_closed(constant[k], r[k], oracle[k]) * 100:.0f}%" for k in GAP_KEYS)
        rows.append(
            f"| {name} | {r['mean']:.2f} | {r['p99']:.2f} | {r['error']:.2f} | {r['bias']:+.2f} | {closed} |"
        )
    return rows, results


GAP_KEYS = ("mean", "p99", "error")


def gap_closed(constant: float, predicted: float, oracle: float) -> float:
    """The fraction of the constant -> oracle difference the predictor recovers (nan: no gap)."""
    gap = constant - oracle
    return (constant - predicted) / gap if abs(gap) > 1e-9 else float("nan")


def main() -> None:
    args = parse_bench_args(__doc__, requests=1000, seeds=12, l_in=8192)
    records = sorted(workload.load_azure_trace(), key=lambda r: r.offset)
    half = len(records) // 2
    train, test = records[:half], records[half:]
    lines = prediction_rows(train, test)
    lines += [""]
    sim_lines, _ = simulation_rows(train, test, args.requests, args.seeds, args.l_in)
    lines += sim_lines
    text = (
        f"Trace: {len(records)} requests; train = the first {half} (time order), test = the other "
        f"{len(test)}. Simulation: `ripe` scenario, cg-bp, {args.seeds} seeds x {args.requests} "
        f"consecutive test requests at their recorded times, slots sized for l_in = {args.l_in}, no set-up "
        "delay; every length source sees the same deployments and requests; a request starts as the live "
        "scheduler admits it (its chain has room, in predicted order). Predictors are warm-started on the "
        "train half and keep learning from finished requests."
    )
    publish_table(__file__, args, lines, HEADER, text)


if __name__ == "__main__":
    main()
