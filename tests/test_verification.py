"""Verified outputs: a server returning wrong hidden states is caught and banned.

The liars are real servers started through `tests/lying_server.py` (a test-only wrapper): one adds
noise of half the output's norm, one returns NaN; both announce themselves as the fastest servers of
their blocks, so routing picks them first.
"""

from __future__ import annotations

import time

import pytest
import torch

from harness.local_swarm import LocalSwarm, prometheus_sample
from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
from llm_swarm.client.connection import SwarmUnavailable, run_sync
from llm_swarm.client.verification import TOLERANCE, UNKNOWN_TOLERANCE, agree, tolerance
from llm_swarm.swarm.dht_keys import default_prefix
from tests.conftest import NUM_BLOCKS

PROMPT = torch.tensor([[5, 17, 99, 200]])
REPORTS = "swarm_server_wrong_output_reports_total"
HONEST_DELAY = ("--compute-delay", "0.02")  # honest servers announce themselves much slower than the liars


@pytest.fixture(scope="module")
def lying_swarm(llama_dir, tmp_path_factory):
    swarm = LocalSwarm(tmp_path_factory.mktemp("verify"))
    try:
        swarm.start_dht()
        metrics = ("--metrics-port", "0")
        swarm.start_server("liar", llama_dir, "0:3", "1GB", *metrics, module=("tests.lying_server", "noise"))
        swarm.start_server("nan", llama_dir, "3:6", "1GB", *metrics, module=("tests.lying_server", "nan"))
        for name, blocks in (("h1", "0:3"), ("h2", "0:3"), ("b1", "3:6"), ("b2", "3:6")):
            swarm.start_server(name, llama_dir, blocks, "1GB", *HONEST_DELAY)
        names = ["liar", "nan", "h1", "h2", "b1", "b2"]
        online = swarm.wait_online(default_prefix(str(llama_dir)), NUM_BLOCKS, names)
        assert online["liar"].tau < online["h1"].tau and online["nan"].tau < online["b1"].tau
        yield swarm, servers_named(swarm, llama_dir)
    finally:
        assert not swarm.close()


@pytest.mark.swarm
def test_a_server_answering_malformed_frames_is_failed_over_and_the_output_is_exact(
    llama_dir, tmp_path, local_reference
):
    """A server that announces step frames and answers every step with a frame cut short: the client
    refuses each answer as malformed and fails over to the honest server, exactly."""
    swarm = LocalSwarm(tmp_path)
    client = None
    try:
        swarm.start_dht()
        swarm.start_server("cut", llama_dir, f"0:{NUM_BLOCKS}", "1GB", module=("tests.lying_server", "frame"))
        swarm.start_server("honest", llama_dir, f"0:{NUM_BLOCKS}", "1GB", *HONEST_DELAY)
        online = swarm.wait_online(default_prefix(str(llama_dir)), NUM_BLOCKS, ["cut", "honest"])
        assert online["cut"].tau < online["honest"].tau  # routes pick the garbler first
        # a failed server is avoided long enough to see, after the generation, whom the client blamed
        options = ClientOptions(ban_base=600.0)
        client = AutoDistributedModelForCausalLM.from_pretrained(
            llama_dir, swarm.initial_peers, options=options
        )
        run_sync(client.backend.connection.roster.finish_first_read())
        expected = local_reference(llama_dir)[0].generate(PROMPT, max_new_tokens=8, do_sample=False)
        assert torch.equal(client.generate(PROMPT, max_new_tokens=8, do_sample=False), expected)
        cut = servers_named(swarm, llama_dir)["cut"]
        assert client.backend.connection.bans.is_banned(cut)
    finally:
        if client is not None:
            client.shutdown()
        assert not swarm.close()


def test_tolerance_follows_the_kinds_measured_disagreement():
    """Calibrated on an H100 (BENCHMARKS.md, "Replica verification on a GPU"): nf4 differs from float32
    by up to 0.89 at hidden 512, more than a liar's 0.5: such pairs go unverified, while two servers
    of the same quantization check each other like 16-bit servers."""
    assert tolerance(["float32"]) == TOLERANCE["float32"]
    assert tolerance(["float32", "float16"]) == TOLERANCE["float16"]
    assert tolerance(["int8", "float16"]) == TOLERANCE["int8"] < 0.5
    assert tolerance(["nf4", "nf4"]) == tolerance(["int8"]) == TOLERANCE["bfloat16"]
    assert tolerance(["nf4", "float16"]) is None and tolerance(["nf4", "int8"]) is None
    assert tolerance(["", "float32"]) == UNKNOWN_TOLERANCE
    noise = torch.randn(4, 1, 64)
    assert not agree(noise, noise + 0.5 * noise.norm() / 8 * torch.randn(4, 1, 64), tolerance(["int8"]))


@pytest.fixture(scope="module")
def reference(llama_dir, local_reference):
    return local_reference(llama_dir)[0]


@pytest.mark.swarm
def test_verifying_every_step_gives_exact_outputs_and_bans_the_liars(lying_swarm, llama_dir, reference):
    swarm, peers = lying_swarm
    client = AutoDistributedModelForCausalLM.from_pretrained(
        llama_dir, swarm.initial_peers, options=ClientOptions(verify_fraction=1.0)
    )
    try:
        connection = client.backend.connection
        run_sync(connection.roster.finish_first_read())  # routes may pick the liars from the first prompt on
        for prompt in (PROMPT, torch.tensor([[7, 8, 9]]), torch.tensor([[300, 2, 41, 41, 5]])):
            expected = reference.generate(prompt, max_new_tokens=12, do_sample=False)
            assert torch.equal(client.generate(prompt, max_new_tokens=12, do_sample=False), expected)
        # the noisy liar outvoted by two replicas; the NaN server blamed for its own output (never the
        # next server, which would have refused the NaN); both banned for long, the honest ones not
        assert set(connection.bans.caught) == {peers["liar"], peers["nan"]}
        assert connection.bans.is_banned(peers["liar"]) and connection.bans.is_banned(peers["nan"])
        assert not any(connection.bans.is_banned(peers[name]) for name in ("h1", "h2", "b1", "b2"))
        assert connection.verified_steps > 0
    finally:
        client.shutdown()
    # each liar's operator sees the clients' reports in its metrics (sent in the background)
    for name, reason in (("liar", "outvoted"), ("nan", "malformed")):
        deadline = time.monotonic() + 15
        while prometheus_sample(swarm.metrics(name), REPORTS, f'reason="{reason}"') < 1:
            assert time.monotonic() < deadline, swarm.log(name)[-2000:]
            time.sleep(0.2)
        assert "reports this server's output for blocks" in swarm.log(name)


@pytest.mark.swarm
def test_verifying_a_tenth_of_the_steps_catches_the_liar(lying_swarm, llama_dir):
    """Each step of the liar's hop is verified with probability 0.1: caught after 10 steps on average
    (geometric). Measured over several clients; the step of the catch is printed for the notes."""
    swarm, peers = lying_swarm
    caught_at = []
    for _ in range(4):
        client = AutoDistributedModelForCausalLM.from_pretrained(
            llama_dir, swarm.initial_peers, options=ClientOptions(verify_fraction=0.1)
        )
        # the session's one route must be able to pick the liar: not only the servers the client's
        # first read had found when every block had one (`fetch_servers_covering`)
        run_sync(client.backend.connection.roster.finish_first_read())
        try:
            with client.inference_session(max_length=PROMPT.shape[1] + 80) as session:
                prompt = PROMPT
                for _ in range(8):  # up to 80 steps, 10 at a time, until the liar is caught
                    client.generate(prompt, max_new_tokens=10, do_sample=False, session=session)
                    prompt = None
                    if session.blocks.caught_at_step is not None:
                        break
                caught_at.append(session.blocks.caught_at_step)
            assert peers["liar"] in client.backend.connection.bans.caught
        finally:
            client.shutdown()
    print(f"liar caught at steps {caught_at} with verify_fraction 0.1 (expected 10 on average)")
    assert all(step is not None and step <= 80 for step in caught_at), caught_at


@pytest.mark.swarm
def test_honest_float32_and_bfloat16_replicas_never_trip_the_check(llama_dir, tmp_path, reference):
    """...and when only two servers hold the blocks and they disagree, the step fails naming both;
    a third server that joined after the client's last read of the roster is found to decide."""
    swarm = LocalSwarm(tmp_path)
    try:
        swarm.start_dht()
        swarm.start_server("f32", llama_dir, f"0:{NUM_BLOCKS}")
        swarm.start_server("bf16", llama_dir, f"0:{NUM_BLOCKS}", "1GB", "--dtype", "bfloat16")
        swarm.wait_online(default_prefix(str(llama_dir)), NUM_BLOCKS, ["f32", "bf16"])
        client = AutoDistributedModelForCausalLM.from_pretrained(
            llama_dir, swarm.initial_peers, options=ClientOptions(verify_fraction=1.0)
        )
        try:
            for prompt in (PROMPT, torch.tensor([[7, 8, 9]])):
                client.generate(prompt, max_new_tokens=24, do_sample=False)
            connection = client.backend.connection
            assert connection.bans.caught == {} and connection.verified_steps >= 2 * 24
        finally:
            client.shutdown()

        swarm.stop("bf16")
        swarm.start_server("liar", llama_dir, f"0:{NUM_BLOCKS}", module=("tests.lying_server", "noise"))
        swarm.wait_online(default_prefix(str(llama_dir)), NUM_BLOCKS, ["f32", "liar"])
        # the roster is not read again on its own for 10 minutes: only the arbiter's search reads it
        options = ClientOptions(verify_fraction=1.0, refresh_period=600.0)
        client = AutoDistributedModelForCausalLM.from_pretrained(
            llama_dir, swarm.initial_peers, options=options
        )
        try:
            with pytest.raises(SwarmUnavailable, match="disagree on blocks 0:6") as failure:
                client.generate(PROMPT, max_new_tokens=4, do_sample=False)
            servers = swarm.servers(default_prefix(str(llama_dir)), NUM_BLOCKS)
            named = {servers[peer].public_name for peer in servers if peer in str(failure.value)}
            assert named == {"f32", "liar"}, failure.value

            swarm.start_server("late", llama_dir, f"0:{NUM_BLOCKS}")
            swarm.wait_online(default_prefix(str(llama_dir)), NUM_BLOCKS, ["f32", "liar", "late"])
            names = servers_named(swarm, llama_dir)
            assert names["late"] not in client.backend.connection.roster.known  # not seen yet
            expected = reference.generate(PROMPT, max_new_tokens=8, do_sample=False)
            assert torch.equal(client.generate(PROMPT, max_new_tokens=8, do_sample=False), expected)
            assert set(client.backend.connection.bans.caught) == {names["liar"]}
        finally:
            client.shutdown()
    finally:
        assert not swarm.close()


def servers_named(swarm: LocalSwarm, llama_dir) -> dict[str, str]:
    """Each server's public name -> its peer id, as announced."""
    servers = swarm.servers(default_prefix(str(llama_dir)), NUM_BLOCKS)
    return {info.public_name: peer for peer, info in servers.items()}
