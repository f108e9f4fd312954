#!/usr/bin/env bash
# The static checks CI runs before the tests: lint and import order, formatting, types, import layers.
# Usage: bash scripts/check.sh   (after scripts/install.sh test)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
echo "== ruff check";        "$bin/ruff" check .
echo "== ruff format";       "$bin/ruff" format --check .
echo "== mypy";              "$bin/mypy"
echo "== import contracts";  "$bin/lint-imports"
