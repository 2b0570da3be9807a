#!/usr/bin/env bash
# Set up .venv and run the test suite (GPU tests skip, with a reason, on a host without one).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests/ -q -rs "$@"
