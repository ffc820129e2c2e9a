"""Falcon's attention, caching one key and value per KV head and reading batched steps in place.

`transformers`' `FalconAttention` broadcasts the new decoder architecture's grouped keys and values
to every query head *before* caching them (Falcon-40B: 128 heads share 8 KV heads, so its cache
would hold 16 copies of each key). A server's cache is preallocated per session and charged to its
memory budget, so `falcon_attention_forward` caches each KV head once and repeats it for its
queries only inside attention: the same values reach the same SDPA call, so outputs are unchanged.

It is also what lets a batched decode step (`TransformerSpan.forward_batch`) read every session's
cache in place, as `swarm.models.inplace_attention` does for LLaMA and BLOOM: for a batched view
the keys are `SessionKeyValues`, and attention runs once per session on views of its own cache.

The computation follows `FalconAttention.forward`'s SDPA path (what `from_pretrained` selects):
fused QKV split per architecture, rotary embeddings unless the model uses ALiBi, and one
`scaled_dot_product_attention` whose mask carries the ALiBi biases (`FalconFamily.step_inputs`
folds them in, as `FalconModel` does), then the dense output projection.
"""

from __future__ import annotations

from types import MethodType

import torch
from torch.nn import functional
from transformers.models.falcon.modeling_falcon import FalconAttention, apply_rotary_pos_emb

from llm_swarm.swarm.models.inplace_attention import SessionKeyValues


def split_fused_qkv(
    attention: FalconAttention, fused: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries `[batch, heads, new, head_dim]` and keys, values `[batch, kv_heads, new, head_dim]`.

    The fused projection's layout depends on the architecture: the new decoder architecture
    interleaves per KV group its queries then one key and one value; multi-query appends one key and
    one value after every query head; plain multi-head attention interleaves (q, k, v) per head.
    """
    batch, new, _ = fused.shape
    heads, head_dim = attention.num_heads, attention.head_dim
    if attention.new_decoder_architecture:
        groups = attention.num_kv_heads
        qkv = fused.view(batch, new, groups, heads // groups + 2, head_dim)
        query = qkv[:, :, :, :-2].reshape(batch, new, heads, head_dim)
        key, value = qkv[:, :, :, -2], qkv[:, :, :, -1]
    elif attention.multi_query:
        qkv = fused.view(batch, new, heads + 2, head_dim)
        query, key, value = qkv[:, :, :-2], qkv[:, :, -2:-1], qkv[:, :, -1:]
    else:
        qkv = fused.view(batch, new, heads, 3, head_dim)
        query, key, value = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def attend(
    attention: FalconAttention,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """SDPA over cached keys and values as `FalconAttention` calls it; `[batch, new, hidden]` out."""
    if attention.new_decoder_architecture and keys.shape[1] != attention.num_heads:
        # transformers hands SDPA every query head its group's key: the same values, repeated here
        repeats = attention.num_heads // keys.shape[1]
        keys, values = keys.repeat_interleave(repeats, dim=1), values.repeat_interleave(repeats, dim=1)
    # (multi-query: one key head, broadcast by SDPA against every query head, as in transformers)
    if mask is not None:
        mask = mask[:, :, :, : keys.shape[-2]]
        if query.device.type == "cuda":  # what transformers does for SDPA's kernels with a custom mask
            query, keys, values = query.contiguous(), keys.contiguous(), values.contiguous()
    batch, heads, new, head_dim = query.shape
    output = functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, dropout_p=0.0, is_causal=mask is None and new > 1
    )
    return output.transpose(1, 2).reshape(batch, new, heads * head_dim)


def falcon_attention_forward(
    self: FalconAttention,
    hidden_states: torch.Tensor,
    alibi: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    layer_past=None,
    head_mask: torch.Tensor | None = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    cache_position: torch.Tensor | None = None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **_unused: object,
):
    """`FalconAttention.forward` (SDPA path) with one cached key/value per KV head; see the module
    docstring. `alibi` only selects ALiBi models' path: its biases arrive inside `attention_mask`."""
    if head_mask is not None or output_attentions:
        raise ValueError("served Falcon blocks support neither head masks nor returned attention weights")
    query, key, value = split_fused_qkv(self, self.query_key_value(hidden_states))
    if alibi is None:
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx, {"cache_position": cache_position})
    if isinstance(key, SessionKeyValues):  # a batched decode step: each session on its own cache
        contexts = []
        for session in key.sessions:
            mask = None
            # a session without padding decodes unmasked alone; ALiBi's biases apply to every session
            if attention_mask is not None and (session.masked or alibi is not None):
                mask = attention_mask[session.rows, :, :, session.first_column :]
            contexts.append(attend(self, query[session.rows], session.keys, session.values, mask))
        context = torch.cat(contexts)
    else:
        context = attend(self, query, key, value, attention_mask)
    return self.dense(context), None


def use_falcon_attention(attention: FalconAttention) -> None:
    """Make one Falcon attention module cache per KV head and read batched steps in place."""
    attention.forward = MethodType(falcon_attention_forward, attention)
