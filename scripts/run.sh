#!/usr/bin/env bash
# The main job: set up, then load the default model and serve a demo batch of requests
# that share a system prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m radixserve demo "$@"
