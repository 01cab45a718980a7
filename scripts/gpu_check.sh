#!/usr/bin/env bash
# The GPU acceptance check in one command (docs/performance.md#gpu-acceptance-check):
#   make gpu-wheels                       # CPU, once: the wheels and fixtures it carries
#   bash scripts/gpu_check.sh --dry-run   # CPU: list the parts and check gpu-wheels/
#   bash scripts/gpu_check.sh             # GPU machine: $OUT/gpu_check/summary.{json,md}
# Options: --wheels DIR (default gpu-wheels), --out DIR, --work DIR; PYTHON=... picks the
# interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
exec "$PYTHON" scripts/gpu_check.py run "$@"
