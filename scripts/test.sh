#!/usr/bin/env bash
# Set up, then run the whole test suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Triton kernels run interpreted on the CPU; on a CUDA machine export TRITON_INTERPRET=0.
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
# Test processes and server workers compute side by side on few cores: let idle OpenMP
# threads sleep instead of spinning against each other.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
exec .venv/bin/python -m pytest tests "$@"
