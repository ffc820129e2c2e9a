#!/usr/bin/env bash
# The main job: build a tiny LLaMA model locally and generate text through a chain of block spans.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv ""
MODEL_DIR=models/tiny-llama
if [ ! -f "$MODEL_DIR/config.json" ]; then
  .venv/bin/swarm-make-tiny-model "$MODEL_DIR" --family llama --layers 6 --hidden 64 --heads 4 --kv-heads 2
fi
.venv/bin/swarm-generate "$MODEL_DIR" --local-spans 0:2,2:4,4:6 --prompt "Once upon a time" --max-new-tokens 24
