"""`swarm-plan` end to end (docs/reference.md section 4): JSON inputs, every exit path.

The cases run the command's `main` in this process with its own stdin, stdout and stderr (what a
subprocess would see, without importing everything again for each); the last test runs the
installed command itself once.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from llm_swarm.scheduler.plan import cli as plan_cli

pytestmark = pytest.mark.version_neutral  # no transformers code: one leg runs it

_SCRIPT = Path(sys.executable).with_name("swarm-plan")
COMMAND = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "llm_swarm.scheduler.plan.cli"]


def run(args: list[str], document: object | str) -> subprocess.CompletedProcess:
    """`swarm-plan ARGS < document`, in-process: its exit status and what it printed."""
    text = document if isinstance(document, str) else json.dumps(document)
    stdin = io.TextIOWrapper(io.BytesIO(text.encode()), encoding="utf-8")
    stdout, stderr = io.StringIO(), io.StringIO()
    saved_stdin, sys.stdin = sys.stdin, stdin
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = plan_cli.main(args)
            except SystemExit as exit_:  # argparse: --help and usage errors
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.stdin = saved_stdin
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


def ok(args: list[str], document: object) -> dict:
    result = run(args, document)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def server(name: str, memory: float, tau: float, rtt_c1: float, prefill_ratio: float = 3.0) -> dict:
    """A problem document's server seen by one client `c1`; its prefill round trip 5 ms longer."""
    return {
        "name": name,
        "memory_bytes": memory,
        "tau": tau,
        "tau_prefill": prefill_ratio * tau,
        "rtt": {"c1": rtt_c1},
        "rtt_prefill": {"c1": rtt_c1 + 0.005},
    }


CLUSTERED = {
    "model": {"num_blocks": 70, "block_bytes": 1323397667, "cache_bytes": 8486912, "hidden_size": 14336},
    "servers": [
        server("mig1", 9.1e9, 0.0162488, 0.055),
        server("a100a", 79.13e9, 0.00322, 0.1),
        server("a100b", 79.13e9, 0.00322, 0.1),
    ],
    "num_requests": 66,
}

FIG2 = {
    "model": {"num_blocks": 3, "block_bytes": 1, "cache_bytes": 0.1},
    "servers": [
        {"name": f"j{i}", "memory_bytes": 3 if i == 2 else 2, "tau_c": 2 if i == 2 else 1, "tau_p": i * 1e-3}
        for i in range(1, 6)
    ],
    "c": 1,
}


def routing(active: dict) -> dict:
    document = copy.deepcopy(CLUSTERED)
    document.update(
        placement=[
            {"name": "mig1", "start": 0, "end": 4},
            {"name": "a100a", "start": 0, "end": 42},
            {"name": "a100b", "start": 28, "end": 70},
        ],
        client="c1",
        l_in=20,
        l_out=128,
        active=active,
    )
    return document


def test_place_cg_bp():
    output = ok(["place", "--algo", "cg-bp"], CLUSTERED)
    assert output["placement"] == [
        {"name": "mig1", "start": 0, "end": 4},
        {"name": "a100a", "start": 0, "end": 42},
        {"name": "a100b", "start": 28, "end": 70},
    ]
    assert output["order"] == ["a100a", "a100b", "mig1"] and output["num_requests"] == 66
    assert math.isclose(output["bound"], 0.00322 * 70 + 2 * 0.1)


def test_place_cg_bp_chooses_r_from_the_arrival_rate():
    document = {key: value for key, value in CLUSTERED.items() if key != "num_requests"}
    output = ok(["place", "--algo", "cg-bp"], {**document, "arrival_rate": 0.5, "l_out": 128})
    assert 1 <= output["num_requests"] < 66  # lambda*T1 + sqrt(lambda*T1), T1 about 44 s here


def test_place_petals_and_gbp_cr():
    output = ok(["place", "--algo", "petals"], CLUSTERED)
    assert output["placement"][0] == {"name": "mig1", "start": 0, "end": 4}
    assert output["order"] == ["mig1", "a100a", "a100b"]  # join order
    output = ok(["place", "--algo", "gbp-cr"], FIG2)
    assert output["c"] == 1 and output["order"] == ["j1", "j2", "j3", "j4", "j5"]
    assert [(p["start"], p["end"]) for p in output["placement"]] == [(0, 1), (1, 3), (0, 1), (1, 2), (2, 3)]


def test_every_server_appears_in_the_placement_even_without_blocks():
    document = copy.deepcopy(CLUSTERED)
    document["servers"].append(server("phone", 1e9, 0.5, 0.3))
    output = ok(["place", "--algo", "cg-bp"], document)
    assert output["placement"][-1] == {"name": "phone", "start": None, "end": None}


def test_route_ws_rr_waits_for_a_busy_server():
    output = ok(["route", "--algo", "ws-rr"], routing({}))
    assert output["chain"] == [
        {"name": "a100a", "start": 0, "end": 42},
        {"name": "a100b", "start": 42, "end": 70},
    ]
    assert output["wait"] == 0.0 and output["cost"] > 0
    # a100a has floor((79.13e9 - 42*s_m)/s_c) = 2774 slots; fill them: the request waits for the
    # first session to end (5 s) unless another chain is cheaper -- here none is.
    busy = ok(["route", "--algo", "ws-rr"], routing({"a100a": [[10.0, 2000], [5.0, 774]]}))
    assert busy["chain"] == output["chain"] and busy["wait"] == 5.0
    assert math.isclose(busy["cost"], output["cost"] + 5.0)


def test_route_petals():
    output = ok(["route", "--algo", "petals"], routing({}))
    assert [hop["name"] for hop in output["chain"]] == ["a100a", "a100b"] and output["wait"] == 0.0
    assert math.isclose(output["cost"], 2 * (0.1 / 2 + 0.018) + 70 * 0.00322)


def test_compose_fig2_three_chains_of_capacity_five():
    output = ok(["compose"], {**FIG2, "arrival_rate": 1.0})
    assert output["c"] == 1
    assert [(c["servers"], c["blocks"], c["capacity"]) for c in output["chains"]] == [
        (["j1", "j2"], [1, 2], 5),
        (["j1", "j4", "j5"], [1, 1, 1], 5),
        (["j3", "j4", "j5"], [1, 1, 1], 5),
    ]
    assert math.isclose(output["service_rate"], 5 / 3.005 + 5 / 3.010 + 5 / 3.012)
    lower, upper = output["response_time_bounds"]
    assert 3.005 < lower <= upper
    assert "response_time_bounds" not in ok(["compose"], FIG2)  # only with an arrival rate


def test_compose_tunes_c():
    tuned = ok(["compose"], {**FIG2, "c": "auto", "arrival_rate": 1.0})
    assert tuned["c"] >= 1 and tuned["chains"]
    surrogate = ok(["compose", "--c-objective", "surrogate"], {**FIG2, "c": "auto", "arrival_rate": 0.5})
    assert surrogate["c"] == 3  # c*K(c): c = 1, 2 need 2 chains (rate 0.67 < 0.71, 0.67 >= 0.36), c = 3 one


def test_help_has_examples():
    for args in [["--help"], ["place", "--help"], ["route", "--help"], ["compose", "--help"]]:
        result = run(args, "")
        assert result.returncode == 0 and "example" in result.stdout and "swarm-plan" in result.stdout


def infeasible(args: list[str], document: object) -> dict:
    result = run(args, document)
    assert result.returncode == 3, result.stderr
    output = json.loads(result.stdout)
    assert set(output) == {"error", "uncovered_blocks"} and output["error"]
    return output


def test_infeasible_inputs_exit_3_with_the_uncovered_blocks():
    too_many = {**CLUSTERED, "num_requests": 100_000}  # not even one block fits with that many caches
    assert infeasible(["place", "--algo", "cg-bp"], too_many)["uncovered_blocks"] == list(range(70))
    small = {**CLUSTERED, "servers": CLUSTERED["servers"][:2]}  # mig1 + one a100: 4 + 42 blocks
    assert infeasible(["place", "--algo", "cg-bp"], small)["uncovered_blocks"] == list(range(46, 70))
    assert infeasible(["place", "--algo", "petals"], small)["uncovered_blocks"] == list(
        range(53, 70)
    )  # 4 + 49
    unplaced = routing({})
    unplaced["placement"][2] = {"name": "a100b", "start": None, "end": None}
    assert infeasible(["route", "--algo", "ws-rr"], unplaced)["uncovered_blocks"] == list(range(42, 70))
    assert infeasible(["route", "--algo", "petals"], unplaced)["uncovered_blocks"] == list(range(42, 70))
    assert infeasible(["compose"], {**FIG2, "c": 50})["uncovered_blocks"] == [0, 1, 2]


def with_change(base: dict, path: list, value: object) -> dict:
    document = copy.deepcopy(base)
    target = document
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return document


def clustered_cg_bp(case: str, path: list, value: object, mentions: str) -> tuple:
    """An `INVALID` case: `place --algo cg-bp` on CLUSTERED with the value at `path` set to `value`
    (KeyError: removed), failing with a line that mentions `mentions`."""
    return (case, ["place", "--algo", "cg-bp"], with_change(CLUSTERED, path, value), mentions)


INVALID = [
    ("malformed JSON", ["place", "--algo", "cg-bp"], '{"model": {"num_blocks": 70,', "malformed JSON"),
    ("not an object", ["place", "--algo", "cg-bp"], "[1, 2]", "must be a JSON object"),
    clustered_cg_bp("unknown top key", ["requests"], 3, "'requests'"),
    clustered_cg_bp("unknown model key", ["model", "layers"], 3, "'layers'"),
    clustered_cg_bp("unknown server key", ["servers", 0, "gpu"], "x", "'gpu'"),
    clustered_cg_bp("negative", ["servers", 1, "tau"], -1, "a100a).tau"),
    clustered_cg_bp("zero size", ["model", "cache_bytes"], 0, "cache_bytes"),
    clustered_cg_bp("missing", ["model", "num_blocks"], KeyError, "missing"),
    clustered_cg_bp("missing R", ["num_requests"], KeyError, "num_requests"),
    clustered_cg_bp("wrong type", ["num_requests"], "66", "integer"),
    clustered_cg_bp("bool", ["servers", 0, "memory_bytes"], True, "number"),
    clustered_cg_bp("fraction", ["num_requests"], 6.5, "integer"),
    ("NaN", ["place", "--algo", "cg-bp"], json.dumps(CLUSTERED).replace("0.055", "NaN"), "finite"),
    (
        "duplicate",
        ["place", "--algo", "cg-bp"],
        json.dumps(CLUSTERED)[:-1] + ', "num_requests": 3}',
        "duplicate",
    ),
    (
        "needs tau",
        ["place", "--algo", "cg-bp"],
        with_change(CLUSTERED, ["servers", 0, "tau"], KeyError),
        "tau",
    ),
    (
        "needs width",
        ["place", "--algo", "petals"],
        with_change(CLUSTERED, ["model", "hidden_size"], KeyError),
        "hidden",
    ),
    ("needs c", ["compose"], with_change(FIG2, ["c"], KeyError), "c: missing"),
    ("bad c", ["place", "--algo", "gbp-cr"], with_change(FIG2, ["c"], "many"), "auto"),
    ("auto needs rate", ["compose"], with_change(FIG2, ["c"], "auto"), "arrival_rate"),
    ("rho_bar", ["compose"], with_change(FIG2, ["rho_bar"], 1.5), "rho_bar"),
    ("unknown server", ["route", "--algo", "ws-rr"], routing({"gpu9": [[1.0, 2]]}), "gpu9"),
    ("bad session", ["route", "--algo", "ws-rr"], routing({"a100a": [[1.0, 0]]}), "active.a100a[0][1]"),
    (
        "bad span",
        ["route", "--algo", "ws-rr"],
        with_change(routing({}), ["placement", 0, "end"], 99),
        "placement[0]",
    ),
    ("unknown client", ["route", "--algo", "ws-rr"], with_change(routing({}), ["client"], "c9"), "c9"),
    ("missing l_out", ["route", "--algo", "petals"], with_change(routing({}), ["l_out"], KeyError), "l_out"),
]


@pytest.mark.parametrize(("case", "args", "document", "mentions"), INVALID, ids=[case[0] for case in INVALID])
def test_invalid_input_exits_2_with_one_clear_line(case, args, document, mentions):
    result = run(args, document)
    assert result.returncode == 2, (case, result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith("swarm-plan: invalid input: ") and mentions in lines[0]


def test_unknown_algorithm_is_a_usage_error():
    result = run(["place", "--algo", "magic"], CLUSTERED)
    assert result.returncode == 2 and "invalid choice" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.swarm
def test_the_installed_command_reads_stdin_and_exits_with_the_status():
    placed = subprocess.run(
        COMMAND + ["place", "--algo", "cg-bp"],
        input=json.dumps(CLUSTERED),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert placed.returncode == 0 and json.loads(placed.stdout) == ok(["place", "--algo", "cg-bp"], CLUSTERED)
    refused = subprocess.run(
        COMMAND + ["place", "--algo", "cg-bp"], input="{", capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and refused.stderr.startswith("swarm-plan: invalid input: ")
