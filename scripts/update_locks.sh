#!/usr/bin/env bash
# Re-resolve the two lock files from setup.cfg's ranges, each in a fresh temporary environment:
#   requirements.lock                 the newest versions the ranges admit (transformers 5)
#   requirements-transformers4.lock   the same with transformers pinned to its lower bound, 4.57.6
# Run the test suite on both (scripts/test.sh, scripts/test.sh --compat) before committing them.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
torch_pin="$(grep '^torch==' requirements.lock)"

lock() {  # lock OUTPUT HEADER [EXTRA PINS...]
  local output="$1" header="$2"
  shift 2
  local scratch
  scratch="$(mktemp -d "${TMPDIR:-/tmp}/llm-swarm-lock.XXXXXX")"
  trap 'rm -rf "$scratch"' RETURN
  "$python" -m venv "$scratch/venv"
  "$scratch/venv/bin/python" -m pip install --quiet "$torch_pin"
  "$scratch/venv/bin/python" -m pip install --quiet -e ".[test]" "$@"
  {
    printf '%s\n' "$header"
    # the project itself is not locked; local build tags (torch's +cpu) are left to the installing host
    "$scratch/venv/bin/python" -m pip freeze --exclude-editable | grep -v '^llm-swarm' | sed 's/+[A-Za-z0-9.]*$//'
  } > "$output"
  echo "wrote $output ($(grep -c '==' "$output") packages)"
}

lock requirements.lock "# The exact set of packages the test suite ran on (the default leg: transformers 5).
# scripts/demo.sh and scripts/test.sh install from it; setup.cfg holds the ranges a user's own
# environment may take. Regenerate with scripts/update_locks.sh."
lock requirements-transformers4.lock "# The exact set of packages the compatibility leg ran on (transformers 4.57, the lower bound).
# scripts/test.sh --compat runs the tests on it. Regenerate with scripts/update_locks.sh." \
  "transformers==4.57.6"
