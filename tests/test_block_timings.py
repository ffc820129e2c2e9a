"""The block-timings cache that servers on one machine share (`server.throughput`)."""

from __future__ import annotations

import json
import logging
import threading

from llm_swarm.server.throughput import cached_block_timings
from llm_swarm.swarm.models import load_span


def test_servers_measuring_at_once_leave_one_whole_cache_and_the_next_start_reads_it(
    llama_dir, tmp_path, caplog
):
    """Servers started together all measure and write at once: none may read another's half-written
    file (which used to lose the cache with a warning), and what ends up there is used next time."""
    span, _ = load_span(llama_dir, 0, 2)
    path = tmp_path / "timings" / "block_timings.json"
    delays = [0.001 * index for index in range(8)]  # each its own entry, as different servers' would be
    start = threading.Barrier(len(delays))
    measured: dict[float, object] = {}

    def server_start(delay: float) -> None:
        start.wait()
        measured[delay] = cached_block_timings(span, compute_delay=delay, cache_path=path)

    with caplog.at_level(logging.WARNING, logger="llm_swarm.server.throughput"):
        threads = [threading.Thread(target=server_start, args=(delay,)) for delay in delays]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not caplog.records, [record.getMessage() for record in caplog.records]
    entries = json.loads(path.read_text())  # whole JSON, never torn
    assert entries and all(
        set(entry) == {"tau", "tau_prefill", "prefill_tokens"} for entry in entries.values()
    )
    assert [file.name for file in path.parent.iterdir()] == [path.name]  # no temporary file left
    # an entry that made it (concurrent writers may each keep only their own) is read back, not re-measured
    for delay, timings in measured.items():
        if any(key.endswith(f":{delay}") for key in entries):
            assert cached_block_timings(span, compute_delay=delay, cache_path=path) == timings


def test_a_damaged_cache_is_measured_afresh_and_replaced(llama_dir, tmp_path, caplog):
    span, _ = load_span(llama_dir, 0, 1)
    path = tmp_path / "block_timings.json"
    path.write_text('{"half a wri')
    with caplog.at_level(logging.WARNING, logger="llm_swarm.server.throughput"):
        timings = cached_block_timings(span, cache_path=path)
    assert not caplog.records
    assert cached_block_timings(span, cache_path=path) == timings
    assert len(json.loads(path.read_text())) == 1
