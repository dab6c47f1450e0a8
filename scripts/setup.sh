#!/usr/bin/env bash
# Create .venv with a Python >= 3.12 interpreter and install glm-jax into it.
#   bash scripts/setup.sh          runtime dependencies, the HTTP server's (decode.py --serve) among them
#   bash scripts/setup.sh --dev    plus the test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."

extras="[serve]"
[[ "${1:-}" == "--dev" ]] && extras="[dev]"   # dev holds serve's packages too

is_312_plus() {
  "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null
}

find_python() {
  local candidates=()
  [[ -n "${GLM_JAX_PYTHON:-}" ]] && candidates+=("$GLM_JAX_PYTHON")
  for v in python3.14 python3.13 python3.12 python3; do
    command -v "$v" >/dev/null 2>&1 && candidates+=("$(command -v "$v")")
  done
  if command -v pyenv >/dev/null 2>&1; then
    local root; root="$(pyenv root)"
    for p in $(ls -d "$root"/versions/3.* 2>/dev/null | sort -rV); do
      [[ -x "$p/bin/python3" ]] && candidates+=("$p/bin/python3")
    done
  fi
  for c in "${candidates[@]}"; do
    if is_312_plus "$c"; then echo "$c"; return 0; fi
  done
  return 1
}

if [[ ! -x .venv/bin/python ]] || ! is_312_plus .venv/bin/python; then
  py="$(find_python)" || { echo "error: no Python >= 3.12 found; install one (e.g. 'pyenv install 3.12') or set GLM_JAX_PYTHON" >&2; exit 1; }
  echo "setup: creating .venv with $py ($("$py" --version))"
  rm -rf .venv
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e ".${extras}"
echo "setup: ready ($(.venv/bin/python --version))"
