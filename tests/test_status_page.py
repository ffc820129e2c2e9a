"""Operating a swarm: the status page in a real browser, JSON status, Prometheus metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from transformers import AutoTokenizer

from harness.local_swarm import LocalSwarm, prometheus_sample
from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.scheduler_api import scheduler_pb2 as pb
from llm_swarm.swarm.scheduler_api import scheduler_pb2_grpc as pb_grpc
from tests.conftest import NUM_BLOCKS

pytestmark = pytest.mark.swarm  # every test here starts processes

RESULTS = Path(__file__).resolve().parent.parent / "results"
SERVERS = {"front": "0:4", "back": "3:6"}


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


metric = prometheus_sample


@pytest.fixture(scope="module")
def swarm(llama_dir, tmp_path_factory):
    swarm = LocalSwarm(tmp_path_factory.mktemp("status-swarm"))
    try:
        swarm.start_dht()
        address = swarm.start_scheduler("scheduler", llama_dir, "--period", "5")
        for name, blocks in SERVERS.items():
            swarm.start_server(name, llama_dir, blocks, "1GB", "--metrics-port", "0")
        url_file = start_health_page(swarm, llama_dir)
        swarm.wait_online(default_prefix(str(llama_dir)), NUM_BLOCKS, list(SERVERS))
        with grpc.insecure_channel(address) as channel:
            status = pb_grpc.SchedulerStub(channel).GetStatus(pb.StatusRequest(), timeout=10)
        yield swarm, status.status_url, read_address(url_file)
    finally:
        leaked = swarm.close()
        assert not leaked, f"process groups left running: {leaked}"


def start_health_page(swarm, model_dir) -> Path:
    """`swarm-health` for `model_dir`'s swarm on a free port; returns the file its URL appears in."""
    url_file = swarm.log_dir / "health.url"
    argv = [sys.executable, "-m", "llm_swarm.scheduler.service.health_cli"]
    argv += ["--initial-peers", *swarm.initial_peers, "--model-dir", str(model_dir), "--port", "0"]
    argv += ["--address-file", str(url_file)]
    swarm.start("health", argv)
    return url_file


def read_address(address_file: Path, timeout: float = 30.0) -> str:
    """What a command writes to its `--address-file`, once it has."""
    deadline = time.monotonic() + timeout
    while not address_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return address_file.read_text().strip()


def wait_for_servers(url: str, count: int) -> dict:
    deadline = time.monotonic() + 30
    while True:
        status = json.loads(fetch(url + "api/status"))
        if sum(1 for s in status["servers"] if s["state"] == "online") >= count:
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"the status at {url} never showed {count} servers online")
        time.sleep(0.5)


@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="needs Debian's chromium (scripts/test.sh installs it)"
)
@pytest.mark.parametrize("page", ["scheduler", "health"])
def test_browser_shows_every_server_span_on_the_coverage_map(swarm, page):
    _, scheduler_url, health_url = swarm
    url = scheduler_url if page == "scheduler" else health_url
    status = wait_for_servers(url, len(SERVERS))
    browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
    dom = subprocess.run(
        [*browser, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    drawn = {
        (peer, int(start), int(end))
        for peer, start, end in re.findall(
            r'data-peer="([^"]+)" data-start="(-?\d+)" data-end="(-?\d+)"', dom
        )
    }
    expected = {(s["peer_id"], s["start"], s["end"]) for s in status["servers"] if s["start"] >= 0}
    assert expected and drawn == expected
    counts = [int(count) for count in re.findall(r'data-block="\d+" data-count="(\d+)"', dom)]
    assert counts == status["coverage"] == [1, 1, 1, 2, 1, 1]
    RESULTS.mkdir(exist_ok=True)
    screenshot = RESULTS / f"status_page_{page}.png"
    subprocess.run(
        [*browser, "--hide-scrollbars", "--window-size=1100,700", f"--screenshot={screenshot}", url],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert screenshot.stat().st_size > 10_000


def test_any_page_parameter_gets_a_page(swarm):
    """`?page=` from a browser's address bar may be anything: junk, negative or huge numbers get a
    page (the first, or the last that exists), never an error."""
    _, scheduler_url, health_url = swarm
    for url in (scheduler_url, health_url):
        wait_for_servers(url, len(SERVERS))
        for query in ("?page=abc", "?page=-1", "?page=99999999999", "?page=3", "?page=0&page=1", "?page="):
            html = fetch(url + query)
            assert 'id="coverage-map"' in html and html.count('class="span"') == len(SERVERS), query


def test_metrics_move_after_a_generation(swarm, llama_dir):
    local_swarm, scheduler_url, _ = swarm
    before_scheduler = fetch(scheduler_url + "metrics")
    before_servers = [local_swarm.metrics(name) for name in SERVERS]
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    client = AutoDistributedModelForCausalLM.from_pretrained(
        llama_dir,
        initial_peers=local_swarm.initial_peers,
        options=ClientOptions(scheduler_key=local_swarm.scheduler_key),
    )
    try:
        ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
        client.generate(ids, max_new_tokens=8, do_sample=False)
    finally:
        client.shutdown()
    after_scheduler = fetch(scheduler_url + "metrics")
    assert (
        metric(after_scheduler, "swarm_sessions_ended_total")
        == metric(before_scheduler, "swarm_sessions_ended_total") + 1
    )
    for name in (
        "swarm_request_ttft_seconds_count",
        "swarm_request_tpot_seconds_count",
        "swarm_admission_wait_seconds_count",
    ):
        assert metric(after_scheduler, name) == metric(before_scheduler, name) + 1, name
    assert metric(after_scheduler, "swarm_routes_total", 'outcome="admitted"') >= 1
    deadline = time.monotonic() + 10
    while True:  # the session closes on the servers just after the client returns
        after_servers = [local_swarm.metrics(name) for name in SERVERS]
        if all(metric(text, "swarm_server_sessions_opened_total") >= 1 for text in after_servers):
            break
        assert time.monotonic() < deadline
        time.sleep(0.2)
    for before, after in zip(before_servers, after_servers, strict=True):
        assert (
            metric(after, "swarm_server_sessions_opened_total")
            == metric(before, "swarm_server_sessions_opened_total") + 1
        )
        steps_before = metric(before, "swarm_server_step_seconds_count", 'kind="decode"')
        assert metric(after, "swarm_server_step_seconds_count", 'kind="decode"') >= steps_before + 7
        assert metric(after, "swarm_server_bytes_received_total") > metric(
            before, "swarm_server_bytes_received_total"
        )
        assert metric(after, "swarm_server_cache_slots_free") > 0
