#!/usr/bin/env bash
# Installs what moult needs, idempotently (each step is skipped when already done):
#   - a Python virtualenv ($MOULT_VENV, default ./.venv) with torch (whose libtorch tch links
#     against) and transformers (the numerical reference of the tests), all from PyPI;
#   - Gloo's headers (Debian's libgloo-dev), which the trainer's multi-rank collectives compile
#     against (docs/distributed.md); installed with apt-get when run as root, otherwise a
#     one-rank trainer still builds and a multi-rank one says what is missing;
#   - the Rust build of the workspace.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MOULT_ROOT"

command -v cargo >/dev/null || { echo "cargo not found: install Rust with rustup first" >&2; exit 1; }
command -v python3 >/dev/null || { echo "python3 not found: install Python 3.11+ first" >&2; exit 1; }
# numpy, transformers and pillow as pinned in tests/python/requirements.txt need 3.11.
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "python3 is $(python3 -c 'import platform; print(platform.python_version())'): moult needs Python 3.11+ (the pinned numpy, transformers and pillow do); put a newer python3 first on PATH" >&2
  exit 1
}
if [ "${MOULT_SETUP_FOR:-}" = tests ]; then
  command -v openssl >/dev/null || { echo "openssl not found: the tests make their control plane's certificates with it (apt-get install openssl)" >&2; exit 1; }
fi

REQS="$MOULT_ROOT/tests/python/requirements.txt"
STAMP="$MOULT_VENV/.moult-requirements"
if [ -x "$MOULT_PYTHON" ] && [ -f "$STAMP" ] && cmp -s "$REQS" "$STAMP"; then
  echo "setup: Python virtualenv $MOULT_VENV is current"
else
  echo "setup: installing $MOULT_VENV (torch, transformers, safetensors, numpy; several GB on first run)"
  [ -x "$MOULT_PYTHON" ] || python3 -m venv "$MOULT_VENV"
  "$MOULT_PYTHON" -m pip install --quiet --disable-pip-version-check -r "$REQS"
  cp "$REQS" "$STAMP"
fi
# Re-read the environment now that torch exists (LD_LIBRARY_PATH to libtorch).
source "$MOULT_ROOT/scripts/env.sh"

if [ -f "${GLOO_INCLUDE_DIR:-/usr/include}/gloo/context.h" ]; then
  echo "setup: Gloo headers present"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "setup: installing libgloo-dev (the trainer's multi-rank collectives)"
  { apt-get install -y -qq libgloo-dev >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libgloo-dev >/dev/null 2>&1; }; } \
    && touch runtime/csrc/c10d_shim.cpp `# an earlier build without the headers: build.rs runs again` \
    || echo "setup: could not install libgloo-dev: trainers of more than one rank will refuse to start (docs/distributed.md)"
else
  echo "setup: no Gloo headers (apt-get install libgloo-dev): trainers of more than one rank will refuse to start (docs/distributed.md)"
fi
