#!/usr/bin/env bash
# Creates .venv (if missing) and installs hybridgnn with its test, ops, fast and distributed extras.
# torch's CPU build goes in first: asking pip for plain `torch` would pull GBs of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${HYBRIDGNN_VENV:-.venv}
TORCH_SPEC=${HYBRIDGNN_TORCH:-torch==2.13.0}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  # PyTorch's CPU index first (PyPI's Linux torch is the CUDA build); where that index cannot
  # be reached (a registry mirror only), fail fast and take the registry's torch.
  "$VENV/bin/pip" install -q --retries 0 --timeout 20 "$TORCH_SPEC" --index-url https://download.pytorch.org/whl/cpu \
    || "$VENV/bin/pip" install -q "$TORCH_SPEC"
fi
# Re-install only when pyproject.toml changed since the last install.
stamp="$VENV/.hybridgnn-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$VENV/bin/pip" install -q -e ".[test,ops,fast,distributed]"
  touch "$stamp"
fi
