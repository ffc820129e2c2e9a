"""What a large swarm costs a client: the same 3-hop chain served by more and more
replicas, then read among 1,000 announced server records.

    .venv/bin/python -m benchmarks.serving.scale [--replicas 1,8,10,14] [--records 1000] [--clients 3]
                                            [--tokens 16] [--client-cpus 0-3] [--write]

One swarm on loopback, grown in place: a DHT, a scheduler, and `3 x replicas` real server processes
(each its own peer, a tiny 24-block LLaMA split 0:8, 8:16, 16:24, `--no-legacy-records`, the default
10 s announce period, 30 s while idle; the scheduler with its default roster cadence). At each size
it measures, for `--clients` new clients one after another:
the time from `from_pretrained` to the first token and the CPU the whole host spent meanwhile,
the time per later token (the next 16 tokens, then 32 more), and a warm routing
decision (`SwarmConnection.route` with its round trips cached); plus what every idle server spends
(CPU over 30 s, its daemons included), the scheduler's last roster refresh (its
`swarm_roster_refresh_seconds` metric) and the largest DHT value readers fetch. Then stand-in
records (`harness.standin_records`: correctly signed records of peers that do not serve, announcing
the real servers' speeds) bring the swarm to `--records` servers and the same is measured again.

Limits of the emulation: every process shares this machine's cores, so per-token times include
the other servers' idle cost, and a client's start includes the servers' side of its join; stand-ins
never answer, so they cost clients what dead records cost. `--client-cpus` (on a host with cores to
spare) keeps each client (its process, DHT process and p2p daemon) on those cores and every other
process on the rest, as if the servers were other machines; the client's own CPU until its first
token is printed either way.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import tempfile
import time
import urllib.request
from functools import partial
from pathlib import Path

import psutil
import torch
from hivemind.utils.serializer import MSGPackSerializer
from tqdm import tqdm

from benchmarks.markdown import write_section
from harness.local_swarm import LocalSwarm, cpu_seconds_by_group
from harness.standin_records import new_keys, publish_standins, standin_info, start_standin_dht
from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
from llm_swarm.client.connection import run_sync
from llm_swarm.swarm.dht_keys import default_prefix, roster_keys
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model
from llm_swarm.swarm.route_request import SessionShape

LAYERS = 24
SPANS = ((0, 8), (8, 16), (16, 24))
PROMPT = torch.tensor([[5, 17, 99, 200, 31, 7]])
SIGNATURE_BYTES = 256 + 16  # RSA-2048 signature and its marker, stripped before values reach readers


def idle_cpu_percent(swarm: LocalSwarm, names: list[str], seconds: float = 30.0) -> float:
    """Mean share of one core each named (idle) server spends, daemons included, over one idle
    announcement period (30 s: every idle server announces once in it)."""
    pgids = [swarm.processes[name].pid for name in names]  # each server leads its own group
    before = cpu_seconds_by_group()
    time.sleep(seconds)
    after = cpu_seconds_by_group()
    return 100 * statistics.mean(after.get(g, 0.0) - before.get(g, 0.0) for g in pgids) / seconds


async def _value_sizes(_dht, node, keys: list[str]) -> dict[str, tuple[int, int]]:
    """{key: (bytes, entries)} of the dictionary values under `keys`, signatures included."""
    found = await node.get_many(keys, sufficient_expiration_time=float("inf"))
    sizes = {}
    for key, entry in found.items():
        if entry is None or not hasattr(entry.value, "items"):
            continue
        items = list(entry.value.items())
        size = sum(
            len(MSGPackSerializer.dumps(subkey)) + len(MSGPackSerializer.dumps(item.value)) + SIGNATURE_BYTES
            for subkey, item in items
        )
        sizes[key] = (size, len(items))
    return sizes


def value_stats(swarm: LocalSwarm, prefix: str) -> tuple[int, int]:
    """(bytes of the largest value readers fetch, bytes per server record) over the roster keys."""
    sizes = swarm.observer.run_coroutine(partial(_value_sizes, keys=roster_keys(prefix)))
    total, entries = sum(s for s, _ in sizes.values()), sum(n for _, n in sizes.values())
    return max((s for s, _ in sizes.values()), default=0), total // max(entries, 1)


def scheduler_refresh(swarm: LocalSwarm) -> tuple[float, float]:
    url = re.search(r"status page at (http://[\d.]+:\d+)/", swarm.log("scheduler")).group(1)
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    parts = dict(re.findall(r'swarm_roster_refresh_seconds\{part="(\w+)"\} ([\d.e+-]+)', text))
    return float(parts.get("read", "nan")), float(parts.get("review", "nan"))


def host_busy_seconds() -> float:
    """CPU time this whole host has spent busy so far, all cores (neither idle nor waiting for I/O)."""
    times = psutil.cpu_times()._asdict()  # Linux counts guest time in user and nice as well
    return sum(times.get(name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))


def parse_cpus(text: str) -> set[int]:
    """ "0-3,6" -> {0, 1, 2, 3, 6}: cores this process may use, leaving at least one for the swarm."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise SystemExit(f"--client-cpus: {text!r} is not a list of cores like 0-3,6") from None
    available = os.sched_getaffinity(0)
    if not cpus or not cpus < available:
        raise SystemExit(
            f"--client-cpus {text}: must be some, not all, of this process's cores {sorted(available)}"
        )
    return cpus


def pin_process(cpus: set[int]) -> None:
    """Every thread of this process onto `cpus` (Linux sets affinity per thread); what it forks or
    starts from now on inherits them."""
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(thread), cpus)


@contextlib.contextmanager
def pinned(cpus: set[int] | None):
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    pin_process(cpus)
    try:
        yield
    finally:
        pin_process(before)


def own_cpu_seconds() -> dict[int, float]:
    """CPU time so far of this process and each of its descendants, by pid (the swarm's processes,
    started in sessions of their own, are not counted)."""
    me = psutil.Process()
    seconds = {}
    for process in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(process.pid) == os.getsid(0):
                times = process.cpu_times()
                seconds[process.pid] = times.user + times.system
    return seconds


def client_cpu_since(before: dict[int, float]) -> float:
    """What this process spent since `before`, plus all that the processes it started since then
    spent (a new client's DHT process and p2p daemon): the bench's other helpers are left out."""
    now = own_cpu_seconds()
    me = os.getpid()
    return (now[me] - before[me]) + sum(cpu for pid, cpu in now.items() if pid not in before)


def measure_clients(
    model_dir: Path, swarm: LocalSwarm, clients: int, tokens: int, client_cpus: set[int] | None = None
) -> dict:
    starts, joins, per_token, steady, busy, own, decisions, pinged = [], [], [], [], [], [], [], []
    shape = SessionShape(batch_size=1, max_length=64, l_in=PROMPT.shape[1], l_out=tokens)
    for _ in range(clients):
        with pinned(client_cpus):
            own_before, busy_before = own_cpu_seconds(), host_busy_seconds()
            started = time.perf_counter()
            model = AutoDistributedModelForCausalLM.from_pretrained(
                model_dir, swarm.initial_peers, options=ClientOptions(use_scheduler=False)
            )
            joins.append(time.perf_counter() - started)
            try:
                with model.inference_session(max_length=PROMPT.shape[1] + 1 + 3 * tokens):
                    model.generate(PROMPT, max_new_tokens=1, do_sample=False)
                    starts.append(time.perf_counter() - started)
                    busy.append(host_busy_seconds() - busy_before)
                    own.append(client_cpu_since(own_before))
                    began = time.perf_counter()
                    model.generate(None, max_new_tokens=tokens, do_sample=False)
                    per_token.append((time.perf_counter() - began) / tokens)
                    began = time.perf_counter()  # later tokens: once the start-up's background work ended
                    model.generate(None, max_new_tokens=2 * tokens, do_sample=False)
                    steady.append((time.perf_counter() - began) / (2 * tokens))
                connection = model.backend.connection
                for _ in range(5):
                    began = time.perf_counter()
                    run_sync(connection.chains.route(0, LAYERS, shape))
                    decisions.append(time.perf_counter() - began)
                pinged.append(len(connection.probes.measured()))
            finally:
                model.shutdown()
    return {
        "first_token_s": statistics.median(starts),
        "from_pretrained_s": statistics.median(joins),
        "per_token_s": statistics.median(per_token),
        "steady_token_s": statistics.median(steady),
        "start_busy_s": statistics.median(busy),
        "client_cpu_s": statistics.median(own),
        "route_s": statistics.median(decisions),
        "pinged": max(pinged),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="1,8,10", help="replicas per span, growing")
    parser.add_argument("--records", type=int, default=1000, help="announced servers in the last row")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument(
        "--client-cpus",
        help="cores for the clients (e.g. 0-3); every other process runs on the rest",
    )
    parser.add_argument("--write", action="store_true", help="write the BENCHMARKS.md section")
    args = parser.parse_args()
    replicas = sorted(int(r) for r in args.replicas.split(","))
    client_cpus = parse_cpus(args.client_cpus) if args.client_cpus else None
    if client_cpus is not None:  # the swarm's processes inherit this (each client switches to its own)
        pin_process(os.sched_getaffinity(0) - client_cpus)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        model_dir = build_tiny_model(
            scratch / "tiny-llama-24", TinyModelSpec(family="llama", num_layers=LAYERS)
        )
        prefix = default_prefix(str(model_dir))
        (scratch / "swarm").mkdir()
        swarm = LocalSwarm(scratch / "swarm")
        forger = None
        try:
            swarm.start_dht()
            # the scheduler's own roster cadence (LocalSwarm's is quicker, for tests)
            cadence = ["--roster-read-period", "2", "--full-pass", "4"]
            swarm.start_scheduler("scheduler", model_dir, "--http-port", "0", *cadence)
            names: list[str] = []
            for count in replicas:
                new = [f"s{span}-{r}" for r in range(len(names) // 3, count) for span in range(3)]
                for name in tqdm(new, desc=f"starting servers for {count} replicas"):
                    span = SPANS[int(name[1])]
                    swarm.start_server(
                        name, model_dir, f"{span[0]}:{span[1]}", "128MB",
                        "--announce-period", "10", "--no-legacy-records",
                    )  # fmt: skip
                names += new
                swarm.wait_online(prefix, LAYERS, names, timeout=600)
                time.sleep(12)  # one announce period, and a scheduler refresh, with everyone online
                row = {"servers": len(names), "records": len(names), "replicas": count}
                row["idle_cpu_pct"] = idle_cpu_percent(swarm, names)
                row.update(measure_clients(model_dir, swarm, args.clients, args.tokens, client_cpus))
                row["refresh_read_s"], row["refresh_review_s"] = scheduler_refresh(swarm)
                row["largest_value"], row["record_bytes"] = value_stats(swarm, prefix)
                print(row, flush=True)
                rows.append(row)
            real = list(swarm.servers(prefix, LAYERS).values())
            taus = sorted(info.tau for info in real)
            extra = max(args.records - len(names), 0)
            keys = new_keys(extra, progress=True)
            records = [
                (key, standin_info(*SPANS[i % 3], taus[(i * 7) % len(taus)])) for i, key in enumerate(keys)
            ]
            forger = start_standin_dht(swarm.initial_peers, keys)
            stored = publish_standins(forger, prefix, records)
            print(f"{extra} stand-in records announced ({stored} stores)", flush=True)
            time.sleep(5)
            row = {"servers": len(names), "records": len(names) + extra, "replicas": replicas[-1]}
            row.update(measure_clients(model_dir, swarm, args.clients, args.tokens, client_cpus))
            time.sleep(3)
            row["idle_cpu_pct"] = float("nan")
            row["refresh_read_s"], row["refresh_review_s"] = scheduler_refresh(swarm)
            row["largest_value"], row["record_bytes"] = value_stats(swarm, prefix)
            print(row, flush=True)
            rows.append(row)
        finally:
            if forger is not None:
                forger.shutdown()
            swarm.close()
    report(rows, args.replicas, args.records, args.clients, args.tokens, args.client_cpus, args.write)


def report(
    rows: list[dict],
    replicas: str,
    records: int,
    clients: int,
    tokens: int,
    client_cpus: str | None,
    write: bool,
) -> None:
    """Print the table (and write the BENCHMARKS.md section) of the rows `main` measured."""
    lines = [
        "| servers (real) | records | first token after from_pretrained (of which from_pretrained) "
        f"| host CPU busy until the first token | per token (next {tokens}; then {2 * tokens} more) "
        "| routing decision "
        "| servers pinged | idle server CPU | scheduler refresh (read + review) | largest DHT value "
        "(one-key roster before) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        legacy = row["records"] * row["record_bytes"]  # the old layout's one roster key lists everyone
        idle = "-" if row["idle_cpu_pct"] != row["idle_cpu_pct"] else f"{row['idle_cpu_pct']:.2f}% of a core"
        lines.append(
            f"| {row['servers']} | {row['records']} | {row['first_token_s']:.2f} s "
            f"({row['from_pretrained_s']:.2f} s) | {row['start_busy_s']:.2f} core-s | "
            f"{row['per_token_s'] * 1e3:.1f} ms; {row['steady_token_s'] * 1e3:.1f} ms | "
            f"{row['route_s'] * 1e3:.1f} ms | {row['pinged']} | {idle} | "
            f"{row['refresh_read_s'] * 1e3:.0f} + {row['refresh_review_s'] * 1e3:.0f} ms | "
            f"{row['largest_value'] / 1e3:.1f} KB ({legacy / 1e3:.0f} KB) |"
        )
    base = rows[0]
    eight = next((row for row in rows if row["replicas"] == 8 and row["records"] == row["servers"]), None)
    ratios = ""
    if eight is not None:
        ratios = (
            f"\n8x the replicas of the same chain ({eight['servers']} servers vs {base['servers']}), "
            f"measured in one run: first token {eight['first_token_s'] / base['first_token_s']:.2f}x, "
            f"per token {eight['per_token_s'] / base['per_token_s']:.2f}x (target: at most 1.3x each); "
            f"later tokens {eight['steady_token_s'] / base['steady_token_s']:.2f}x; host CPU busy until "
            f"the first token {eight['start_busy_s'] / base['start_busy_s']:.2f}x; the client's own CPU "
            f"until then {eight['client_cpu_s'] / base['client_cpu_s']:.2f}x "
            f"({base['client_cpu_s']:.2f} vs {eight['client_cpu_s']:.2f} core-s).\n"
        )
    table = "\n".join(lines)
    print(table + ratios)
    if write:
        header = "## Scale: hundreds of servers, one client"
        pinning = f" --client-cpus {client_cpus}" if client_cpus else ""
        command = (
            f"python -m benchmarks.serving.scale --replicas {replicas} --records {records}{pinning} --write"
        )
        cores = f"{os.cpu_count()}-core host" + (
            f", clients on cores {client_cpus} and everything else on the others" if client_cpus else ""
        )
        placement = (
            "Here the clients had their own cores and the swarm the others, as if on other machines. "
            if client_cpus
            else (
                "Here the whole swarm shares the client's cores, so the start is CPU-bound: the host's "
                "busy CPU until the first token, divided by its cores, is close to the time to the first "
                "token; spread over real machines, the servers' share of that work would not delay the "
                "client. "
            )
        )
        body = (
            f"{header}\n\nCommand: `{command}` ({cores}, every server a real process on "
            "loopback, each its own peer; a 24-block tiny LLaMA in spans 0:8, 8:16, 16:24). Each row: the "
            f"median of {clients} new clients; the last row adds stand-in records (signed records "
            "of peers that do not serve, announcing the real servers' speeds) up to "
            f"{records} announced servers.\n\n{table}\n{ratios}\n"
            "A new client reads the roster and pings its shortlist while `from_pretrained` loads its "
            "modules; its first read ends once live servers (those that answered its DHT node or that "
            "its daemon connected to) hold every block 4 times over, or every block and 0.1 s passed, "
            "and the rest of the read lands in the background. Routing pings a shortlist (4 servers per "
            "block, measured ones first, then live ones; widened 4x after 1 s without a chain), readers "
            "fetch the 16 roster shards and the legacy roster instead of one value per block, and the "
            "largest value is a shard's; the number in brackets is what the one-key roster of the old "
            "layout would hold for the same swarm. Stand-ins have no daemon, so a ping of one is a "
            "failed libp2p lookup (~1.5 s here): the last row is a swarm where 97% of the records are "
            "dead. What still grows with the swarm is the client's join: its p2p daemon connects to "
            "every peer of a swarm this small within about 0.3 s of starting (the refresh of libp2p's "
            "Kademlia table, without any read of ours: the next section measures it alone), and its "
            "first read's 17 keys have more distinct holders (about 40 DHT lookups to 24 peers before the "
            "first token at 24 servers, 20 to 4 peers at 3); every connection and lookup costs CPU on "
            "both sides (a reader caches nothing at other nodes, which took 10-13 more stores). "
            f"{placement}The column 'host CPU busy until the first token' is all the CPU the host spent "
            "(client, servers, daemons) from `from_pretrained` to the first token. 'The client's own "
            "CPU' counts its process, DHT process and p2p daemon only. "
            f"'Per token' is the {tokens} tokens after the first (they overlap the "
            f"end of the join), then the {2 * tokens} after those. The routing decision "
            "is `SwarmConnection.route` on a "
            "warm client, re-reading the roster once its 1 s freshness ran out (the chain choice itself "
            "takes under 1 ms). Idle server CPU, over 30 s (one idle announcement period), includes the "
            "server's libp2p daemon and DHT process and grows with the swarm's DHT traffic: idle "
            "servers announce every 30 s and the scheduler reads the roster every 2 s.\n"
        )
        write_section(header, body)


if __name__ == "__main__":
    main()
