"""Prompt-tune a model through the swarm on a toy task: the example of docs/fine-tuning.md.

    .venv/bin/python -m examples.prompt_tuning                       # builds a tiny LLaMA, starts a swarm
    .venv/bin/python -m examples.prompt_tuning --model-dir models/tiny-llama --initial-peers /ip4/...

The task: after any short sequence of "words", answer one fixed token. The servers' weights stay
frozen; only the client's trainable prompts (`tuning_mode="deep_ptune"`: a prefix plus a prompt per
block) learn, with gradients coming back through the servers' backward RPC. Prints the loss of every
step and exits 1 if it did not fall. Without `--initial-peers` it starts (and stops) its own swarm
on loopback: a DHT peer and two servers holding blocks 0:3 and 3:6 of the model.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from harness.local_swarm import LocalSwarm
from llm_swarm import AutoDistributedModelForCausalLM
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.models.checkpoint import load_config
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model


def toy_batch(generator: torch.Generator, vocab: int, answer: int, batch: int = 8, length: int = 6):
    """Random words, then the answer; the loss counts only the answer."""
    words = torch.randint(10, vocab, (batch, length), generator=generator)
    input_ids = torch.cat([words, torch.full((batch, 1), answer)], dim=1)
    labels = torch.full_like(input_ids, -100)
    labels[:, -1] = answer
    return input_ids, labels


def train(model_dir: Path, initial_peers: list[str], steps: int, lr: float, seed: int) -> list[float]:
    torch.manual_seed(seed)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        model_dir, initial_peers, tuning_mode="deep_ptune", pre_seq_len=4
    )
    try:
        vocab = load_config(model_dir).vocab_size
        answer = vocab - 7
        optimizer = torch.optim.Adam(model.prompts.parameters(), lr=lr)
        generator = torch.Generator().manual_seed(seed)
        losses = []
        for step in range(1, steps + 1):
            input_ids, labels = toy_batch(generator, vocab, answer)
            loss = model(input_ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()  # through the servers' backward RPC, into the client's prompts
            optimizer.step()
            losses.append(loss.item())
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
        prompt = toy_batch(generator, vocab, answer, batch=1)[0][:, :-1]
        generated = model.generate(prompt, max_new_tokens=1, do_sample=False)[0, -1].item()
        print(f"after tuning, the model answers token {generated} (the task's answer: {answer})")
        return losses
    finally:
        model.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, help="a local checkpoint (default: build a tiny LLaMA)")
    parser.add_argument("--initial-peers", nargs="+", help="a running swarm's DHT (default: start one)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the loss must have something to fall from)")
    with tempfile.TemporaryDirectory(prefix="prompt-tuning-") as scratch:
        model_dir = args.model_dir or build_tiny_model(
            Path(scratch) / "tiny-llama", TinyModelSpec(family="llama", num_layers=6)
        )
        if args.initial_peers:
            losses = train(model_dir, args.initial_peers, args.steps, args.lr, args.seed)
        else:
            swarm = LocalSwarm(Path(scratch))
            try:
                swarm.start_dht()
                for name, blocks in (("first", "0:3"), ("second", "3:6")):
                    swarm.start_server(name, model_dir, blocks)
                num_blocks = load_config(model_dir).num_hidden_layers
                swarm.wait_online(default_prefix(str(model_dir)), num_blocks, ["first", "second"])
                losses = train(model_dir, swarm.initial_peers, args.steps, args.lr, args.seed)
            finally:
                swarm.close()
    head, tail = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    print(
        f"loss fell from {head:.4f} to {tail:.4f}" if tail < head else f"loss did not fall: {head} -> {tail}"
    )
    return 0 if tail < head else 1


if __name__ == "__main__":
    raise SystemExit(main())
