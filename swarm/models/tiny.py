"""Build tiny random-weight checkpoints of every served family, with a real tokenizer, entirely offline.

Tests and the demo need a model without downloads. The checkpoint is what `save_pretrained` writes
(config, safetensors shards with an index when sharded, generation config) and the tokenizer is a
byte-level BPE trained here with the `tokenizers` library, so `AutoModelForCausalLM` and
`AutoTokenizer` load the directory exactly as they would a real model.

    swarm-make-tiny-model models/tiny-llama --family llama --layers 6 --hidden 64 --heads 4 --kv-heads 2
    swarm-make-tiny-model models/tiny-falcon-7b --family falcon --variant multi-query
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    DeepseekV2Config,
    DeepseekV3Config,
    FalconConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from llm_swarm.swarm.dtypes import parse_dtype
from llm_swarm.swarm.errors import SwarmUserError

# families whose tiny configs take LLaMA's arguments (Qwen2 adds q/k/v biases, Qwen3 q/k norms: both
# inside their own layers)
LLAMA_LIKE: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
    "mixtral": MixtralConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "gemma2": Gemma2Config,
    "gemma3_text": Gemma3TextConfig,
    "gpt_oss": GptOssConfig,
}
# what a family's tiny config sets beyond LLaMA's arguments: Mistral's default sliding window (4096)
# would cap sessions; a tiny Mixtral or Qwen3-MoE gets 4 experts, 2 per token
FAMILY_EXTRAS: dict[str, dict] = {
    "mistral": {"sliding_window": None},
    "mixtral": {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 96,
        "norm_topk_prob": True,
    },
    # Gemma ties its LM head to the embeddings; a tiny GPT-OSS gets 4 experts, 2 per token, and the
    # positions its YaRN rotary scaling is made for
    "gemma2": {"tie_word_embeddings": True},
    "gemma3_text": {"tie_word_embeddings": True},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 131072},
}
# families whose layers alternate between sliding and full attention: a tiny model alternates from
# its first block with a window this short, so tests pass it within a few tokens
ALTERNATING_WINDOWS = ("gemma2", "gemma3_text", "gpt_oss")
TINY_WINDOW = 8
# DeepSeek's latent attention and routed experts at a tiny width: a compressed latent of 32 and a
# rotary key of 8 per position (what spans cache), 8 routed experts in 4 groups of which 2 are
# searched, 2 experts per token beside one shared expert; block 0 is dense (`first_k_dense_replace`)
DEEPSEEK: dict[str, dict] = {
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
}
DEEPSEEK_VERSIONS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "deepseek_v3": (DeepseekV3Config, {"q_lora_rank": 48}),  # V3 compresses its queries too
    "deepseek_v2": (DeepseekV2Config, {"q_lora_rank": None, "topk_method": "group_limited_greedy"}),
}

# Falcon's architectures: one model_type whose config flags choose the block (comments: the models)
FALCON_VARIANTS: dict[str, dict] = {
    # Falcon-40B/180B: grouped KV heads, rotary, attention and MLP in parallel from two LayerNorms
    "new-decoder": {"new_decoder_architecture": True, "parallel_attn": True, "alibi": False},
    # Falcon-11B: the same from one LayerNorm
    "new-decoder-one-ln": {
        "new_decoder_architecture": True,
        "num_ln_in_parallel_attn": 1,
        "parallel_attn": True,
        "alibi": False,
    },
    # Falcon-7B: one KV head (multi-query), rotary, attention and MLP in parallel from one LayerNorm
    "multi-query": {
        "new_decoder_architecture": False,
        "multi_query": True,
        "parallel_attn": True,
        "alibi": False,
    },
    # Falcon-RW-1B/7B: ALiBi, multi-head attention, attention then MLP, linear layers with biases
    "alibi": {
        "new_decoder_architecture": False,
        "multi_query": False,
        "parallel_attn": False,
        "alibi": True,
        "bias": True,
    },
}
FAMILIES = (
    "llama",
    "bloom",
    "qwen2",
    "qwen3",
    "mistral",
    "mixtral",
    "qwen3_moe",
    "gemma2",
    "gemma3_text",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
    "falcon",
)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

# A small corpus so the BPE learns real merges; its content only shapes which strings tokenize short.
_CORPUS = """
A swarm of volunteer servers runs a large language model together. Each server holds a few
consecutive transformer blocks and an attention cache for every session it serves. Clients keep
the embeddings and the language model head, send hidden states from server to server, and sample
the next token. The scheduler places blocks so that enough requests fit in memory at once, and
routes each request along the chain of servers with the shortest expected completion time.
When a server fails, the client replays what it sent to that server to a replacement, and the
generation continues as if nothing had happened. The quick brown fox jumps over the lazy dog.
Once upon a time there was a little model that wanted to speak. It learned numbers: one two three
four five six seven eight nine ten. It learned places: Paris, London, Tokyo, Nairobi, Lima.
"""


@dataclass(frozen=True)
class TinyModelSpec:
    family: str = "llama"  # one of FAMILIES
    num_layers: int = 6
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int | None = None  # None = multi-head attention (Falcon's new decoder: heads / 2)
    vocab_size: int = 512
    intermediate_size: int | None = None  # MLP width; default 2x hidden (Falcon: 4x, as its configs)
    seed: int = 0
    # Random weights from the usual 0.02 init give near-uniform logits whose top two candidates can
    # differ by less than float32 rounding; a wider init keeps greedy decoding well separated.
    initializer_range: float = 0.1
    dtype: str = "float32"  # the dtype the weights are stored in (config.dtype says so)
    variant: str | None = None  # Falcon's architecture, one of FALCON_VARIANTS (default "new-decoder")

    def config(self) -> PretrainedConfig:
        if self.num_layers < 1 or self.hidden_size % self.num_heads:
            raise SwarmUserError("need >= 1 layer and a hidden size divisible by the number of heads")
        if self.family == "falcon":
            return self.falcon_config()
        if self.variant is not None:
            raise SwarmUserError(f"--variant chooses among Falcon's architectures, not {self.family}'s")
        if self.family == "bloom":
            if self.num_kv_heads not in (None, self.num_heads):
                raise SwarmUserError("BLOOM has no grouped-query attention: leave --kv-heads unset")
            return BloomConfig(
                vocab_size=self.vocab_size,
                hidden_size=self.hidden_size,
                n_layer=self.num_layers,
                n_head=self.num_heads,
                initializer_range=self.initializer_range,
                pad_token_id=PAD_ID,
                bos_token_id=BOS_ID,
                eos_token_id=EOS_ID,
            )
        if self.family in DEEPSEEK_VERSIONS:
            config_class, version = DEEPSEEK_VERSIONS[self.family]
            if self.num_kv_heads not in (None, self.num_heads):
                raise SwarmUserError(
                    "DeepSeek's latent attention has no grouped KV heads: leave --kv-heads unset"
                )
            return config_class(
                vocab_size=self.vocab_size,
                hidden_size=self.hidden_size,
                intermediate_size=self.intermediate_size or 2 * self.hidden_size,
                num_hidden_layers=self.num_layers,
                num_attention_heads=self.num_heads,
                num_key_value_heads=self.num_heads,
                max_position_embeddings=2048,
                initializer_range=self.initializer_range,
                tie_word_embeddings=False,
                pad_token_id=PAD_ID,
                bos_token_id=BOS_ID,
                eos_token_id=EOS_ID,
                **DEEPSEEK,
                **version,
            )
        if self.family in LLAMA_LIKE:
            kv_heads = self.num_kv_heads or self.num_heads
            if self.num_heads % kv_heads:
                raise SwarmUserError("--heads must be a multiple of --kv-heads")
            arguments = {
                "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size or 2 * self.hidden_size,
                "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_heads,
                "num_key_value_heads": kv_heads,
                # Qwen3's and Gemma's defaults are 128 and 256 whatever the width
                "head_dim": self.hidden_size // self.num_heads,
                "max_position_embeddings": 2048,
                "initializer_range": self.initializer_range,
                "tie_word_embeddings": False,
                "pad_token_id": PAD_ID,
                "bos_token_id": BOS_ID,
                "eos_token_id": EOS_ID,
                **FAMILY_EXTRAS.get(self.family, {}),
            }
            if self.family in ALTERNATING_WINDOWS:
                kinds = ("sliding_attention", "full_attention")
                arguments["layer_types"] = [kinds[index % 2] for index in range(self.num_layers)]
                arguments["sliding_window"] = TINY_WINDOW
            return LLAMA_LIKE[self.family](**arguments)
        raise SwarmUserError(f"unknown family {self.family!r}; choose one of {', '.join(FAMILIES)}")

    def falcon_config(self) -> FalconConfig:
        variant = self.variant or "new-decoder"
        if variant not in FALCON_VARIANTS:
            raise SwarmUserError(
                f"unknown Falcon variant {variant!r}; choose one of {', '.join(FALCON_VARIANTS)}"
            )
        flags = FALCON_VARIANTS[variant]
        if flags["new_decoder_architecture"]:  # grouped KV heads by default, as Falcon-40B has
            kv_heads = self.num_kv_heads or max(1, self.num_heads // 2)
            if self.num_heads % kv_heads:
                raise SwarmUserError("--heads must be a multiple of --kv-heads")
        else:  # multi-query: one KV head; otherwise one per query head
            kv_heads = 1 if flags["multi_query"] else self.num_heads
            if self.num_kv_heads not in (None, kv_heads):
                raise SwarmUserError(
                    f"Falcon's {variant} variant fixes its KV heads ({kv_heads}): leave --kv-heads unset"
                )
        return FalconConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_kv_heads=kv_heads,
            ffn_hidden_size=self.intermediate_size or 4 * self.hidden_size,
            initializer_range=self.initializer_range,
            pad_token_id=PAD_ID,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            **flags,
        )


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the built-in corpus (deterministic, no downloads)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.split("\n"), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_input_names=["input_ids", "attention_mask"],  # decoder-only: no token_type_ids
    )


def build_tiny_model(
    out_dir: str | Path, spec: TinyModelSpec, max_shard_size: str | int | None = None
) -> Path:
    """Write a deterministic random-weight checkpoint and tokenizer to `out_dir`.

    `max_shard_size` (e.g. "20KB") splits the weights into several safetensors shards with an index.
    """
    out_dir = Path(out_dir)
    config = spec.config()
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing correction starts at 0
            buffer.normal_(0.0, 0.5)
    if spec.dtype != "float32":  # initialised in float32 (same weights for every dtype), stored smaller
        model = model.to(parse_dtype(spec.dtype))
    save_kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **save_kwargs)
    tokenizer = train_tokenizer(spec.vocab_size)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        fromfile_prefix_chars="@",  # arguments from a file: swarm-... @args.txt
        prog="swarm-make-tiny-model",
        description="Build a tiny random-weight checkpoint of a served family with a trained tokenizer.",
        epilog="example: swarm-make-tiny-model models/tiny-llama --family llama --layers 6 --kv-heads 2\n"
        "LLaMA-2-7B shape: swarm-make-tiny-model models/llama7b-shape --layers 32 --hidden 4096 "
        "--heads 32 --intermediate 11008 --vocab 32000 --dtype float16 --init-range 0.02 "
        "--max-shard-size 2GB",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out_dir", help="directory to write the checkpoint to")
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument(
        "--kv-heads", type=int, default=None, help="grouped-query attention heads (Falcon default: heads / 2)"
    )
    parser.add_argument(
        "--intermediate", type=int, default=None, help="MLP width (default 2x hidden; Falcon: 4x)"
    )
    parser.add_argument(
        "--variant", choices=sorted(FALCON_VARIANTS), default=None, help="Falcon's architecture (new-decoder)"
    )
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--init-range", type=float, default=0.1, help="weight init std (0.02 for real-size shapes in fp16)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default=None, help='split weights into shards, e.g. "50KB"')
    args = parser.parse_args(argv)
    spec = TinyModelSpec(
        family=args.family,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        vocab_size=args.vocab,
        intermediate_size=args.intermediate,
        seed=args.seed,
        initializer_range=args.init_range,
        dtype=args.dtype,
        variant=args.variant,
    )
    try:
        path = build_tiny_model(args.out_dir, spec, args.max_shard_size)
    except SwarmUserError as error:
        print(f"swarm-make-tiny-model: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote a {spec.num_layers}-block {spec.family} model to {path}")


if __name__ == "__main__":
    main()
