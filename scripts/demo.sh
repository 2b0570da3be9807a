#!/usr/bin/env bash
# Set up .venv and run the demo training step on the default device (flags go to the demo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m jax_cake_gdn.demo "$@"
