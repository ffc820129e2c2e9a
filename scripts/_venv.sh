# Sourced by demo.sh and test.sh: make sure .venv exists and has llm-swarm installed.
# Installing is skipped when setup.cfg/pyproject.toml have not changed since the last install.

ensure_venv() {
  local extras="$1"
  local python="${PYTHON:-python3}"
  if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "llm-swarm needs Python >= 3.11 (found $("$python" --version 2>&1)); set PYTHON=python3.11" >&2
    exit 1
  fi
  if [ ! -x .venv/bin/python ]; then
    echo "creating .venv"
    "$python" -m venv .venv
  fi
  local stamp
  stamp=".venv/.installed-$(cat setup.cfg pyproject.toml | sha256sum | cut -c1-16)-${extras:-base}"
  if [ ! -f "$stamp" ]; then
    echo "installing llm-swarm into .venv (first run only)"
    # torch first, pinned, so that no other requirement pulls in a different (multi-GB CUDA) build
    .venv/bin/python -m pip install --quiet torch==2.13.0
    .venv/bin/python -m pip install --quiet -e ".${extras:+[$extras]}"
    rm -f .venv/.installed-*
    touch "$stamp"
  fi
}
