#!/usr/bin/env bash
# Create .venv and install geosched into it. torch is pinned to the CPU build
# first (torch==2.13.0), so pip never pulls a multi-GB CUDA build; on a GPU
# machine install the CUDA torch you want into .venv before running this.
# Usage: bash scripts/install.sh [extras]   e.g. bash scripts/install.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-plots}"
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[${extras}]"
echo "geosched installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
