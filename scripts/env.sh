# Sourced by the other scripts: where the Python virtualenv lives and how cargo finds libtorch.
# MOULT_VENV may point elsewhere (CI keeps it in the home directory to reuse it across clones).
MOULT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export MOULT_VENV="${MOULT_VENV:-$MOULT_ROOT/.venv}"
export MOULT_PYTHON="$MOULT_VENV/bin/python"
# `moult` itself: the release build that scripts/demo.sh makes (docs' commands call it by name).
export PATH="${CARGO_TARGET_DIR:-$MOULT_ROOT/target}/release:$MOULT_VENV/bin:$PATH"
# tch builds against the libtorch inside the PyPI torch wheel.
export LIBTORCH_USE_PYTORCH=1
export LIBTORCH_BYPASS_VERSION_CHECK="${LIBTORCH_BYPASS_VERSION_CHECK:-0}"
if [ -x "$MOULT_PYTHON" ]; then
  TORCH_LIB="$("$MOULT_PYTHON" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null || true)"
  [ -n "$TORCH_LIB" ] && export LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
