"""A client site's load generator: Poisson requests through the swarm, one thread per request.

    python -m netem.loadgen SPEC.json OUT.json

SPEC: `{"model_dir", "initial_peers", "policy", "time_scale", "requests": [{"id", "arrival", "l_in",
"l_out"}], "seed"}` (arrivals in seconds from the start); optional `"route_lengths": [l_in, l_out]`
makes every session tell routing those lengths instead of its own (how clients routed before they
sent real lengths). Before the clock starts it measures its
RTTs to every server and times three session opens on the idle swarm (`setup_probe_s`). Every
request opens an inference session sized `l_in + l_out`, feeds `l_in` random prompt tokens and
generates exactly `l_out` tokens greedily (`min_new_tokens` keeps EOS from ending it early), then
closes the session.

How a request waits for cache room depends on the policy, as in the systems compared:
- `cg-bp` (and anything else): the scheduler's WS-RR admission, however long it predicts;
- `petals`: PETALS' client. The scheduler (PETALS' router) admits at once; when no chain has room
  the session open fails, and the client retries after `min(2^(n-1), 60) s` (docs/reference.md 3.3), times the
  experiment's time scale.

OUT: per request `arrival`, `opened` (the chain's caches are reserved: first server work),
`first_token`, `finish` (monotonic seconds relative to the run's start), `retries`, `error`, and
with a scheduler `predicted_wait` (its WS-RR estimate when routing) and `measured_wait` (routing to
admission).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback

import numpy as np
import torch

from .spec_args import read_spec_args


class TokenTimes:
    """A `generate()` streamer that only records when each new token appeared."""

    def __init__(self):
        self.calls = 0
        self.times: list[float] = []

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > 1:  # the first call is the prompt
            self.times.append(time.monotonic())

    def end(self) -> None:
        pass


def run(spec: dict) -> dict:
    from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
    from llm_swarm.client.connection import SwarmUnavailable, run_sync

    policy = spec["policy"]
    fixed_lengths = spec.get("route_lengths")  # None: each request tells routing its own lengths
    scale = float(spec.get("time_scale", 1.0))
    requests = spec["requests"]
    l_in = max(r["l_in"] for r in requests)
    l_out = max(r["l_out"] for r in requests)
    options = ClientOptions(
        expected_l_in=l_in,
        rtt_ttl=600.0,  # one RTT measurement per server per run: no periodic ping bursts in the data
        # the server list (70 DHT keys, fetched across the emulated WAN) is re-read at most every 30 s,
        # and at once after a refusal; routes come from the scheduler, which reads the DHT itself
        refresh_period=30.0,
        request_timeout=120.0,
        wait_for_servers=60.0,
        # PETALS' client gives up on a full chain at once and backs off (below); WS-RR clients wait
        wait_for_room=0.0 if policy == "petals" else 24 * 3600.0,
        scheduler_timeout=30.0,
        scheduler_key=spec.get("scheduler_key"),
    )
    torch.set_num_threads(1)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        spec["model_dir"], initial_peers=spec["initial_peers"], options=options
    )
    vocab = model.config.vocab_size
    connection = model.backend.connection
    run_sync(connection.chains.candidates())  # measure the RTTs before the clock starts
    # set-up probe: what opening a session costs on an idle swarm (route, admission, one stream
    # open per hop), the simulator's per-session set-up constant (as Sun et al. calibrates its own)
    probes = []
    for _ in range(3):
        opened = time.monotonic()
        probe = model.open_session(max_length=l_in + l_out, prompt_tokens=l_in)
        probes.append(time.monotonic() - opened)
        probe.close()
    results: list[dict] = [{} for _ in requests]
    start = time.monotonic()

    def one(index: int, request: dict) -> None:
        record = results[index]
        record.update(
            id=request["id"], arrival=request["arrival"], l_in=request["l_in"], l_out=request["l_out"]
        )
        record["retries"] = 0
        delay = start + request["arrival"] - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        try:
            while True:
                try:
                    length = request["l_in"] + request["l_out"]
                    told = fixed_lengths or (request["l_in"], request["l_out"])
                    session = model.open_session(
                        length, prompt_tokens=min(told[0], length), expected_new_tokens=min(told[1], length)
                    )
                    break
                except SwarmUnavailable:
                    if policy != "petals":
                        raise
                    record["retries"] += 1
                    time.sleep(min(2.0 ** (record["retries"] - 1), 60.0) * scale)
            record["opened"] = time.monotonic() - start
            record["hops"] = [
                [s.hop.start, s.hop.end, s.hop.peer_id[-6:]] for s in getattr(session.blocks, "streams", [])
            ]
            generator = torch.Generator().manual_seed(int(spec.get("seed", 0)) * 100_003 + request["id"])
            prompt = torch.randint(4, vocab, (1, request["l_in"]), generator=generator)
            streamer = TokenTimes()
            try:
                output = model.generate(
                    prompt,
                    session=session,
                    max_new_tokens=request["l_out"],
                    min_new_tokens=request["l_out"],
                    do_sample=False,
                    streamer=streamer,
                    pad_token_id=0,
                )
            finally:
                session.close()
            record["first_token"] = streamer.times[0] - start
            record["finish"] = streamer.times[-1] - start
            record["tokens"] = int(output.shape[1] - request["l_in"])
            admission = getattr(session.blocks, "admission", None)
            if admission is not None:
                record["predicted_wait"] = admission.expected_wait
                if admission.admitted_at is not None:
                    record["measured_wait"] = admission.admitted_at - admission.routed_at
        except Exception as error:  # recorded per request; the run goes on
            record["error"] = f"{type(error).__name__}: {error}"
            record["traceback"] = traceback.format_exc()[-2000:]

    threads = [threading.Thread(target=one, args=(i, r), daemon=True) for i, r in enumerate(requests)]
    for thread in threads:
        thread.start()
    for index, thread in enumerate(threads):
        thread.join()
        print(
            json.dumps({"done": index, **{k: v for k, v in results[index].items() if k != "traceback"}}),
            flush=True,
        )
    summary = {
        "policy": policy,
        "requests": results,
        "refusals_no_cache_room": connection.bans.no_cache_room_refusals,
        "wall_s": time.monotonic() - start,
        "cpu_s": time.process_time(),
        "setup_probe_s": sorted(probes)[1],
    }
    model.shutdown()
    return summary


def main(argv: list[str] | None = None) -> int:
    parsed = read_spec_args(argv, 2, "usage: python -m netem.loadgen SPEC.json OUT.json")
    if parsed is None:
        return 2
    spec, (_, out_path) = parsed
    np.random.seed(int(spec.get("seed", 0)))
    summary = run(spec)
    with open(out_path, "w") as handle:
        json.dump(summary, handle, indent=1)
    failed = sum(1 for r in summary["requests"] if "error" in r)
    print(f"{len(summary['requests']) - failed} requests done, {failed} failed", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
