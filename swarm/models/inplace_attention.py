"""Attention of a batched decode step that reads each session's preallocated cache in place.

A batched decode step (`TransformerSpan.forward_batch`) runs the blocks' matrix products once for
every session's new token, but each session has its own cache, of its own length. Rather than
gathering every session's keys and values into one padded copy per block (what vLLM's paged
kernels avoid on GPUs), the batched cache view (`BatchedStepCache.update`) writes each session's new
key and value into that session's cache and hands attention `SessionKeyValues`: per session, its
rows of the batch and views of its cache up to its position. Attention then runs once per session
on those views, exactly the computation of that session's unbatched step (same shapes, same mask,
same kernel), and the outputs are concatenated for the batched output projection.

- LLaMA calls attention through `transformers`' attention interface: `swarm_sdpa` (registered here)
  is `sdpa_attention_forward` for ordinary tensors and the per-session loop for `SessionKeyValues`;
  `register_session_attention` does the same for another kernel (Gemma 2's soft-capped eager
  attention, GPT-OSS's attention with sinks).
- BLOOM computes attention inline, so its attention modules get `bloom_attention_forward`, which
  delegates to the library's own forward unless the cache is a batched view.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MethodType

import torch
from torch.nn import functional
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.bloom.modeling_bloom import BloomAttention, dropout_add

ATTENTION_NAME = "swarm_sdpa"


@dataclass(frozen=True)
class SessionView:
    """One session inside a batched step: its rows of the batch and its cache up to its position."""

    rows: slice
    keys: torch.Tensor  # [rows, kv_heads, position + 1, head_dim], a view of the session's cache
    values: torch.Tensor
    first_column: int  # where its keys start in the batch's right-aligned mask / ALiBi columns
    masked: bool  # the session has padding: its slice of the batch's attention mask applies
    # the session's own mask over `keys` (`[rows, 1, 1, keys]`, additive), instead of its slice of the
    # batch's: a sliding-window block's ring past its end holds its keys out of position order
    own_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class SessionKeyValues:
    """What `BatchedStepCache.update` returns for keys and for values alike (see the module docstring)."""

    sessions: tuple[SessionView, ...]


@dataclass(frozen=True)
class StaticSession:
    """One session inside a captured decode step (`swarm.models.decode_graphs`): its rows, the first
    `width` positions of its cache, and the mask of those it may see (`[rows, 1, 1, width]`, bool)."""

    rows: slice
    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class StaticSessions:
    """What `StaticDecodeView.update` returns for keys and for values alike."""

    sessions: tuple[StaticSession, ...]


def session_attention(kernel: Callable) -> Callable:
    """`kernel` (an attention function of transformers' interface), run per session when the keys are
    a batched step's `SessionKeyValues` or a captured step's `StaticSessions`."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        if isinstance(key, StaticSessions):
            outputs = [
                kernel(module, query[s.rows], s.keys, s.values, s.mask, **kwargs)[0] for s in key.sessions
            ]
            return torch.cat(outputs), None
        if not isinstance(key, SessionKeyValues):
            return kernel(module, query, key, value, attention_mask, **kwargs)
        outputs = []
        for session in key.sessions:
            mask = session.own_mask
            if mask is None and session.masked and attention_mask is not None:
                mask = attention_mask[session.rows, :, :, session.first_column :]
            output, _ = kernel(module, query[session.rows], session.keys, session.values, mask, **kwargs)
            outputs.append(output)
        return torch.cat(outputs), None

    return attention


def register_session_attention(name: str, kernel: Callable) -> str:
    """Register `kernel`, run per session in batched steps, as attention implementation `name`."""
    AttentionInterface.register(name, session_attention(kernel))
    return name


# what transformers picks for most families on load; a family whose model computes attention its
# own way (soft-capped logits, attention sinks) registers that model's eager kernel instead
swarm_sdpa = session_attention(sdpa_attention_forward)
AttentionInterface.register(ATTENTION_NAME, swarm_sdpa)


def bloom_attention_forward(
    self: BloomAttention,
    hidden_states: torch.Tensor,
    residual: torch.Tensor,
    alibi: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layer_past=None,
    head_mask: torch.Tensor | None = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    cache_position: torch.LongTensor | None = None,
    **_unused: object,
):
    """BLOOM's attention; for a batched decode step, per session over views of its own cache (the
    same operations as `BloomAttention.forward` on that session alone)."""
    if getattr(layer_past, "batched_view", False) is not True or head_mask is not None or output_attentions:
        return BloomAttention.forward(
            self,
            hidden_states,
            residual,
            alibi,
            attention_mask,
            layer_past=layer_past,
            head_mask=head_mask,
            use_cache=use_cache,
            output_attentions=output_attentions,
            cache_position=cache_position,
        )
    rows = hidden_states.shape[0]
    query, key, value = self._reshape(self.query_key_value(hidden_states))  # [rows, heads, 1, head_dim]
    kv = layer_past.update(key, value, self.layer_idx, {"cache_position": cache_position})[0]
    heads, head_dim = self.num_heads, self.head_dim
    alibi = alibi.view(rows, heads, 1, -1)
    contexts = []
    for session in kv.sessions:
        count = session.keys.shape[0]
        length = session.keys.shape[2]
        session_query = query[session.rows].reshape(count * heads, 1, head_dim)
        session_keys = session.keys.reshape(count * heads, length, head_dim).transpose(-1, -2)
        session_alibi = alibi[session.rows, :, :, session.first_column :].reshape(count * heads, 1, length)
        scores = session_alibi.baddbmm(
            batch1=session_query, batch2=session_keys, beta=self.beta, alpha=self.inv_norm_factor
        )
        weights = scores.view(count, heads, 1, length)
        if session.masked and attention_mask is not None:
            weights = weights + attention_mask[session.rows, :, :, session.first_column :]
        probs = functional.softmax(weights, dim=-1, dtype=torch.float32).to(session_query.dtype)
        probs = self.attention_dropout(probs)
        context = torch.bmm(
            probs.view(count * heads, 1, length), session.values.reshape(count * heads, length, head_dim)
        )
        contexts.append(self._merge_heads(context))
    context = torch.cat(contexts)
    if self.pretraining_tp > 1 and self.slow_but_exact:
        slices = self.hidden_size / self.pretraining_tp
        output = torch.zeros_like(context)
        for index in range(self.pretraining_tp):
            output = output + functional.linear(
                context[:, :, int(index * slices) : int((index + 1) * slices)],
                self.dense.weight[:, int(index * slices) : int((index + 1) * slices)],
            )
    else:
        output = self.dense(context)
    return dropout_add(output, residual, self.hidden_dropout, self.training), None


def use_inplace_bloom_attention(attention: BloomAttention) -> None:
    """Make one BLOOM attention module read batched decode steps' caches in place."""
    attention.forward = MethodType(bloom_attention_forward, attention)
