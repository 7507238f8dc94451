#!/usr/bin/env bash
# The GPU run in two steps, for a lent GPU machine that has no network and takes at most
# 64 MiB of files a call (../shared/gpu-notes.md):
#   bash scripts/gpu.sh pack   # here: .gpu/ = the default model's config and tokenizer (its
#                              # weights, 93 MB, do not fit) + wheels of what the machine lacks
#   bash scripts/gpu.sh run    # there (carry .gpu): installs the missing wheels, then
#                              # bench/gpu/run.py on random weights of the default model's shape
# Extra arguments of `run` go to bench/gpu/run.py (--budget-s, --sections, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_PY=${GPU_PY:-3.12}  # the GPU machine's python (gpu-notes.md)
# Import name = wheel name of what radixserve needs and a CUDA image may lack.
WHEELS="msgspec=msgspec zmq=pyzmq gguf=gguf re2=google-re2 xgrammar=xgrammar
sortedcontainers=sortedcontainers regex=regex jsonschema=jsonschema
referencing=referencing rpds=rpds-py jsonschema_specifications=jsonschema-specifications
prometheus_client=prometheus-client attrs=attrs tvm_ffi=apache-tvm-ffi pydantic=pydantic
pydantic_core=pydantic-core annotated_types=annotated-types typing_inspection=typing-inspection"

case "${1:-}" in
pack)
    rm -rf .gpu && mkdir -p .gpu/model .gpu/wheels
    model=$(.venv/bin/python -c "from radixserve.model.loader import resolve_model; print(resolve_model('smollm2-135m'))")
    for f in config.json generation_config.json tokenizer.json tokenizer_config.json \
             special_tokens_map.json chat_template.jinja; do
        [ -f "$model/$f" ] && cp "$model/$f" .gpu/model/
    done
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PY" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .gpu/wheels $(for w in $WHEELS; do echo "${w#*=}"; done)
    du -sh .gpu
    ;;
run)
    shift
    site=/tmp/radixserve-site
    missing=()
    for w in $WHEELS; do
        python3 -c "import ${w%%=*}" 2>/dev/null || missing+=("${w#*=}")
    done
    for name in "${missing[@]}"; do  # a wheel's file name spells its project with _
        python3 -m pip install -q --no-index --no-deps --target "$site" \
            .gpu/wheels/"${name//-/_}"-*.whl
    done
    python3 -c "import torch, triton, transformers, sys; print('python', sys.version.split()[0],
        'torch', torch.__version__, 'triton', triton.__version__, 'transformers',
        transformers.__version__, 'installed:', '${missing[*]:-}')"
    export PYTHONPATH="$site:$PWD" TRITON_INTERPRET=0
    exec python3 bench/gpu/run.py --model .gpu/model --out "${OUT:-.}" "$@"
    ;;
*)
    echo "usage: bash scripts/gpu.sh pack|run [bench/gpu/run.py arguments]" >&2
    exit 2
    ;;
esac
