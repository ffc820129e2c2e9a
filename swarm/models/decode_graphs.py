"""CUDA graphs of single-token decode steps over a span: one replay instead of a launch per kernel.

A decode step of one token through a span of Hugging Face blocks launches a few dozen small kernels
per block; on a GPU it is bound by the host issuing them (BENCHMARKS.md: 0.97 ms per 7B-shaped fp16
block against 0.14 ms to read its weights). A CUDA graph records the launches once and replays them
with one call.

A graph replays fixed addresses, so everything that changes between steps lives in static buffers
that the graph reads: the new tokens' hidden states, each session's position (a device tensor), and
for padded batches the padding mask. Inside the graph each session writes its new key and value at
its position with `index_copy_`, and attends over the first `width` positions of its own
preallocated cache with a mask built from its position (`StaticSessions`; `swarm_sdpa` runs the
attention). `width` is the smallest power of two holding every member's position (at least
`MIN_WIDTH`, at most the cache's `max_length`), so a session's attention reads at most twice its
keys and a session is recaptured only each time its length doubles.

A graph belongs to its sessions' caches (keyed by their serial numbers, the order of the batch and
`width`): it is captured the second time the same key comes (a one-off batch is not worth a
capture), kept in a bounded LRU, and dropped when one of its sessions ends (`forget`). Every graph
of a span shares one memory pool: replays run one at a time on the engine's thread, and outputs are
copied out before the next replay. Capture runs the step once eagerly first (the warm-up that
cuBLAS and the allocator need before capture); that run's output is the step's answer.

Eager stays the reference and the fallback: families whose blocks cannot be captured (a data-
dependent mixture-of-experts route, BLOOM's ALiBi path; `ModelFamily.decode_graphs`), LoRA adapters,
steps of several tokens, and any capture that fails run as before. With `capture=False` the same
static computation runs eagerly, which is how the CPU tests check it against eager steps.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llm_swarm.swarm.models.cache import SpanCache
from llm_swarm.swarm.models.inplace_attention import StaticSession, StaticSessions

logger = logging.getLogger(__name__)

MIN_WIDTH = 64  # narrowest attention window captured: shorter sessions share one graph per session
# most new tokens per session a captured step takes: decode steps (1) and speculative decoding's
# verification of a draft (a few); longer steps are prefills, each of a length seen once: eager
MAX_TOKENS = 16
MAX_GRAPHS = 32  # graphs kept per span (LRU); each holds a few MB of activations in the shared pool
MAX_SEEN = 1024  # keys remembered while waiting for their second occurrence
CAPTURE_AFTER = 2  # a key is captured the time it comes this often
# captures a session may cause over its life (each window doubling, each draft length, each batch it
# joins): past this it runs eagerly, so one client cannot evict everyone's graphs or make the server
# capture at every step
MAX_CAPTURES_PER_SESSION = 12


# one session's step: (hidden [batch_i, tokens, hidden], cache, position, padding mask or None)
Step = tuple[torch.Tensor, SpanCache, int, torch.Tensor | None]


def window_width(longest: int, max_length: int) -> int:
    """Positions a graph attends over for a batch whose longest member needs `longest` of them."""
    width = MIN_WIDTH
    while width < longest:
        width *= 2
    return min(width, max_length)


@dataclass
class _Member:
    cache: SpanCache
    rows: slice
    masked: bool
    width: int  # this member's attention window (never past its cache's max_length)


class _Graph:
    """Static inputs, the captured graph (None when run eagerly) and its output buffer."""

    def __init__(self, span, members: list[_Member], num_rows: int, num_tokens: int):
        device = span.device
        self.members = members
        self.hidden = torch.zeros(num_rows, num_tokens, span.hidden_size, dtype=span.dtype, device=device)
        self.offsets = torch.arange(num_tokens, device=device)  # the new tokens' places after a position
        self.positions = torch.zeros(len(members), dtype=torch.long, device=device)
        widest = max(member.width for member in members)
        self.columns = torch.arange(widest, device=device)
        self.padding = [
            torch.ones(member.rows.stop - member.rows.start, member.width, dtype=torch.bool, device=device)
            if member.masked
            else None
            for member in members
        ]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None

    def load(self, steps: Sequence[Step]) -> None:
        """Copy this step's changing inputs into the static buffers."""
        hiddens = [hidden for hidden, *_ in steps]
        source = hiddens[0] if len(hiddens) == 1 else torch.cat([h.to(self.hidden.device) for h in hiddens])
        self.hidden.copy_(source)
        self.positions.copy_(torch.tensor([position for _, _, position, _ in steps]))
        end = self.hidden.shape[1]
        for buffer, (_, _, position, mask) in zip(self.padding, steps, strict=True):
            if buffer is not None:
                buffer[:, : position + end].copy_(mask[:, : position + end].bool())


class DecodeGraphs:
    """Captured single-token decode steps of one span; see the module docstring."""

    _serials = itertools.count()

    def __init__(self, span, capture: bool = True, max_graphs: int = MAX_GRAPHS):
        # weak: the span holds us (`span.decode_graphs`), and a cycle would keep a dropped span's
        # blocks on the GPU until the garbage collector ran
        self._span = weakref.ref(span)
        self.capture = capture
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: OrderedDict[tuple, int] = OrderedDict()
        self._failed: set[tuple] = set()  # shapes whose capture failed: eager from then on
        self._captures_of: dict[int, int] = {}  # cache serial -> captures its session caused
        self._lock = threading.Lock()  # `forget` comes from the server's RPC threads
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0
        self.captures = 0
        self.capture_failures = 0

    @property
    def span(self):
        span = self._span()
        if span is None:
            raise RuntimeError("the span of these decode graphs is gone")
        return span

    @staticmethod
    def supported(span) -> bool:
        """Whether this span's decode steps can run from a graph (else: eager, always). bitsandbytes'
        int8 layers pick outlier columns on the host at every step: never capturable (H100 run)."""
        family_ok = bool(getattr(span.family, "decode_graphs", False))
        # a captured step's masks see a session's whole prefix: no sliding window
        family_ok = family_ok and not any(span.windows)
        return family_ok and span.adapters is None and span.quant != "int8"

    def run(self, steps: Sequence[Step]) -> list[torch.Tensor] | None:
        """Outputs of these steps of the same few tokens each (one output per step, as
        `TransformerSpan.forward_batch` returns them), or None when they should run eagerly (not
        captured yet, or not capturable). Each member's `begin_step` must already pass; its `end_step`
        is called here."""
        if not steps or self.span.adapters is not None:
            return None
        if len({hidden.shape[1] for hidden, *_ in steps}) != 1 or not 1 <= steps[0][0].shape[1] <= MAX_TOKENS:
            return None
        ranges = {(cache.block_offset, cache.num_blocks) for _, cache, _, _ in steps}
        if len(ranges) != 1 or len({id(cache) for _, cache, _, _ in steps}) != len(steps):
            return None
        order = sorted(range(len(steps)), key=lambda index: steps[index][1].serial)
        ordered = [steps[index] for index in order]
        key = self._key(ordered)
        with self._lock:
            graph = self._graphs.get(key)
            if graph is not None:
                self._graphs.move_to_end(key)
                output = self._replay(graph, ordered)
            elif not self._worth_capturing(key):
                return None
            else:
                output = self._build(key, ordered)
                if output is None:
                    return None
        for _, cache, _, _ in ordered:
            cache.end_step()
        pieces = list(output.split([cache.batch_size for _, cache, _, _ in ordered]))
        results: list[torch.Tensor] = [pieces[0]] * len(steps)
        for piece, index in zip(pieces, order, strict=True):
            results[index] = piece
        return results

    def forget(self, cache: SpanCache) -> None:
        """The session of `cache` ended: drop the graphs that address its tensors."""
        with self._lock:
            for key in [key for key in self._graphs if cache.serial in key[1]]:
                del self._graphs[key]
            for key in [key for key in self._seen if cache.serial in key[1]]:
                del self._seen[key]
            self._captures_of.pop(cache.serial, None)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    # --- internals -----------------------------------------------------------------------------
    def _key(self, steps: Sequence[Step]) -> tuple:
        tokens = steps[0][0].shape[1]
        longest = max(position for _, _, position, _ in steps) + tokens
        shape = tuple(
            (cache.batch_size, mask is not None, window_width(longest, cache.max_length))
            for _, cache, _, mask in steps
        )
        return (tokens, *shape), tuple(cache.serial for _, cache, _, _ in steps)

    def _worth_capturing(self, key: tuple) -> bool:
        if key[0] in self._failed:
            return False
        if any(self._captures_of.get(serial, 0) >= MAX_CAPTURES_PER_SESSION for serial in key[1]):
            return False
        count = self._seen.pop(key, 0) + 1
        if count >= CAPTURE_AFTER or not self.capture:
            return True
        self._seen[key] = count
        while len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)
        return False

    def _build(self, key: tuple, steps: Sequence[Step]) -> torch.Tensor | None:
        members, row = [], 0
        for (_, cache, _, mask), (_, _, width) in zip(steps, key[0][1:], strict=True):
            members.append(_Member(cache, slice(row, row + cache.batch_size), mask is not None, width))
            row += cache.batch_size
        graph = _Graph(self.span, members, row, key[0][0])
        graph.load(steps)
        if not self.capture:
            self._keep(key, graph)
            return self._compute(graph)
        try:
            output = self._capture(graph)
        except Exception as error:  # e.g. a kernel that synchronizes with the host: eager it is
            self.capture_failures += 1
            self._failed.add(key[0])
            logger.warning("decode step not captured as a CUDA graph (%s); running it eagerly", error)
            return None
        self.captures += 1
        self._keep(key, graph)
        return output

    def _keep(self, key: tuple, graph: _Graph) -> None:
        for serial in key[1]:
            self._captures_of[serial] = self._captures_of.get(serial, 0) + 1
        self._graphs[key] = graph
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)

    def _capture(self, graph: _Graph) -> torch.Tensor:
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):  # warm-up: this step's real answer
            answer = self._compute(graph).clone()
        current.wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph, pool=self._pool, capture_error_mode="thread_local"):
            graph.output = self._compute(graph)
        graph.graph = cuda_graph
        return answer

    def _replay(self, graph: _Graph, steps: Sequence[Step]) -> torch.Tensor:
        graph.load(steps)
        if graph.graph is None:
            return self._compute(graph)
        graph.graph.replay()
        self.replays += 1
        return graph.output.clone()  # the next replay (of any graph in the pool) reuses this memory

    @torch.inference_mode()
    def _compute(self, graph: _Graph) -> torch.Tensor:
        """The step as the graph records it: static buffers in, hidden states out."""
        span = self.span
        sessions, position_ids = [], []
        tokens = graph.offsets.shape[0]
        for index, (member, padding) in enumerate(zip(graph.members, graph.padding, strict=True)):
            places = graph.positions[index] + graph.offsets  # [tokens]: absolute positions
            visible = graph.columns[None, : member.width] <= places[:, None]  # [tokens, width], causal
            rows = member.rows.stop - member.rows.start
            if padding is None:
                mask = visible[None, None].expand(rows, 1, tokens, -1)
                position_ids.append(places[None].expand(rows, tokens))
            else:  # transformers' rule: real tokens count from 0; keys that are padding stay hidden
                mask = (visible[None] & padding[:, None, :])[:, None]
                counted = padding.long().cumsum(-1) - 1
                position_ids.append(counted.gather(1, places[None].expand(rows, tokens)))
            sessions.append((member, mask))
        hidden = graph.hidden
        inputs = span.family.static_decode_inputs(span.config, span.helpers, hidden, torch.cat(position_ids))
        view = StaticDecodeView(graph, sessions)
        for local in range(view.block_offset, view.block_offset + view.num_blocks):
            hidden = span.family.run_block(span.blocks[local], hidden, view, inputs)
        return hidden


class StaticDecodeView:
    """The cache protocol inside a captured step: each member writes its new key and value at its
    position tensor and attends over the first `width` positions of its own cache, masked."""

    def __init__(self, graph: _Graph, sessions: list[tuple[_Member, torch.Tensor]]):
        first = graph.members[0].cache
        self.block_offset, self.num_blocks = first.block_offset, first.num_blocks
        self.graph, self.sessions = graph, sessions

    def update(self, key_states, value_states, layer_idx: int, *_args, **_kwargs):
        layer = layer_idx - self.block_offset
        views = []
        for index, (member, mask) in enumerate(self.sessions):
            keys, values = member.cache.keys[layer], member.cache.values[layer]
            places = self.graph.positions[index] + self.graph.offsets
            keys.index_copy_(2, places, key_states[member.rows])
            values.index_copy_(2, places, value_states[member.rows])
            views.append(
                StaticSession(member.rows, keys[:, :, : member.width], values[:, :, : member.width], mask)
            )
        sessions = StaticSessions(tuple(views))
        return sessions, sessions

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are tensors here; nothing in the blocks asks
