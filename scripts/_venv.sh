# Sourced by demo.sh and test.sh: make sure a virtual environment exists with llm-swarm installed at
# the exact package versions of a lock file (setup.cfg holds the supported ranges; the lock, the set
# the tests ran on). Installing is skipped when setup.cfg, pyproject.toml and the lock are unchanged.
#
# ensure_venv EXTRAS [VENV_DIR] [LOCK_FILE]   (defaults: .venv, requirements.lock)

ensure_venv() {
  local extras="$1"
  local venv="${2:-.venv}"
  local lock="${3:-requirements.lock}"
  local python="${PYTHON:-python3}"
  if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "llm-swarm needs Python >= 3.11 (found $("$python" --version 2>&1)); set PYTHON=python3.11" >&2
    exit 1
  fi
  if [ ! -x "$venv/bin/python" ]; then
    echo "creating $venv"
    "$python" -m venv "$venv"
  fi
  local stamp
  stamp="$venv/.installed-$(cat setup.cfg pyproject.toml "$lock" | sha256sum | cut -c1-16)-${extras:-base}"
  if [ ! -f "$stamp" ]; then
    echo "installing llm-swarm into $venv from $lock (first run only)"
    # torch first, at the lock's version, so that no other requirement pulls in a different
    # (multi-GB CUDA) build
    "$venv/bin/python" -m pip install --quiet "$(grep '^torch==' "$lock")"
    "$venv/bin/python" -m pip install --quiet -c "$lock" -e ".${extras:+[$extras]}"
    rm -f "$venv"/.installed-*
    touch "$stamp"
  fi
}

# ensure_overlay DIR LOCK_FILE: the packages whose pinned versions differ between requirements.lock
# and LOCK_FILE, installed into DIR without their dependencies (LOCK_FILE pins those too, and they
# equal requirements.lock's). Put DIR first on PYTHONPATH to run .venv with LOCK_FILE's versions.
ensure_overlay() {
  local dir="$1"
  local lock="$2"
  local stamp
  stamp="$dir/.installed-$(cat requirements.lock "$lock" | sha256sum | cut -c1-16)"
  if [ ! -f "$stamp" ]; then
    local differing
    differing=$(comm -13 <(grep '==' requirements.lock | sort) <(grep '==' "$lock" | sort) | tr '\n' ' ')
    echo "installing into $dir from $lock: $differing"
    rm -rf "$dir"
    # shellcheck disable=SC2086  # one argument per package
    .venv/bin/python -m pip install --quiet --no-deps --target "$dir" $differing
    touch "$stamp"
  fi
}
