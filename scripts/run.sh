#!/usr/bin/env bash
# The main job: set up, start the server (tokenizer, scheduler and worker processes) with
# the default model, send it a demo batch of requests that share a system prompt, and keep
# serving RPC on 127.0.0.1:30001 until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m radixserve serve --demo "$@"
