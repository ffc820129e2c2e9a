#!/usr/bin/env bash
# The main job: build a tiny LLaMA model locally, start a real swarm on loopback (a DHT peer and
# three servers holding blocks 0:2, 2:4 and 4:6), generate text through it, and shut it all down.
# The text streams as it is generated; then swarm-generate prints the chain of servers the session
# used, the speed, and `--check`'s verdict: the same generation with plain transformers on the same
# checkpoint must give the same token ids, else the demo exits with status 1.
# Everything started here is stopped on exit, on Ctrl-C and on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv ""

MODEL_DIR=models/tiny-llama
PROMPT="${PROMPT:-Once upon a time}"
if [ ! -f "$MODEL_DIR/config.json" ]; then
  .venv/bin/swarm-make-tiny-model "$MODEL_DIR" --family llama --layers 6 --hidden 64 --heads 4 --kv-heads 2
fi

RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/llm-swarm-demo.XXXXXX")
PIDS=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- "-$pid" 2>/dev/null || true  # each process leads its own group: take its children too
  done
  rm -rf "$RUN_DIR"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

export OMP_NUM_THREADS=1
setsid .venv/bin/swarm-dht --maddr-file "$RUN_DIR/dht.maddrs" > "$RUN_DIR/dht.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 300); do [ -s "$RUN_DIR/dht.maddrs" ] && break; sleep 0.1; done
[ -s "$RUN_DIR/dht.maddrs" ] || { cat "$RUN_DIR/dht.log"; echo "the DHT did not start" >&2; exit 1; }
PEER=$(head -1 "$RUN_DIR/dht.maddrs")
echo "DHT at $PEER"

for blocks in 0:2 2:4 4:6; do
  setsid .venv/bin/swarm-server "$MODEL_DIR" --initial-peers "$PEER" --blocks "$blocks" --memory 256MB \
    --public-name "server-$blocks" --announce-period 5 > "$RUN_DIR/server-$blocks.log" 2>&1 &
  PIDS+=($!)
done
for blocks in 0:2 2:4 4:6; do
  for _ in $(seq 600); do grep -q "online: serving" "$RUN_DIR/server-$blocks.log" && break; sleep 0.1; done
  grep -q "online: serving" "$RUN_DIR/server-$blocks.log" || {
    cat "$RUN_DIR/server-$blocks.log"; echo "server $blocks did not come online" >&2; exit 1; }
  echo "server for blocks $blocks is online"
done

.venv/bin/swarm-generate "$MODEL_DIR" --initial-peers "$PEER" --prompt "$PROMPT" --max-new-tokens 24 --check
