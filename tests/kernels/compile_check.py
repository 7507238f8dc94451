"""Compile every Triton kernel launch for a Hopper GPU (sm_90) on a machine without one.

The CPU tests run the kernels under `TRITON_INTERPRET=1`, which accepts code the real
compiler rejects (dot shapes, loop-carried types, ...). This script calls the kernels'
Python wrappers on CPU tensors with the launch intercepted, then compiles each captured
launch (same constexprs, num_warps, num_stages) ahead of time to a cubin with triton's
bundled ptxas, and reports shared memory, registers and spills.

    python tests/kernels/compile_check.py [--quick] [--fp32] [--arch 90]

Exit status 1 if any launch fails to compile. Needs no GPU; must run without
`TRITON_INTERPRET` set.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

captured: list[tuple[JITFunction, tuple[Any, ...], dict[str, Any]]] = []


def _capture(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
    captured.append((self, args, kwargs))


def _compile(fn: JITFunction, args: tuple[Any, ...], kwargs: dict[str, Any],
             target: GPUTarget) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Compile as `JITFunction.run` would on a real device of `target` (same argument
    specialisation: 16-byte alignment and divisibility hints), minus the launch. Uses
    triton's private binder API (checked against triton 3.9)."""
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                          specialization, options)
    src = ASTSource(fn, signature, constexprs, attrs)
    kernel = triton.compile(src, target=target, options=options.__dict__)
    consts = {fn.arg_names[k[0]]: v for k, v in constexprs.items()}
    return kernel, consts, {"num_warps": options.num_warps, "num_stages": options.num_stages}


def _launches(quick: bool, fp32: bool) -> None:
    from radixserve.kernels.cascade_attention import (cascade_level_attention,
                                                      merge_attention_states_)
    from radixserve.kernels.decode_attention import paged_decode_attention
    from radixserve.kernels.extend_attention import extend_attention
    from radixserve.kernels.store_kv import store_kv

    dtypes = [torch.bfloat16, torch.float32] if fp32 else [torch.bfloat16]
    dims = [64, 128] if quick else [64, 80, 128]
    for dtype in dtypes:
        for d in dims:
            for hkv, group, page in ([(3, 3, 16), (8, 4, 1)] if quick else
                                     [(3, 3, 16), (8, 4, 1), (8, 8, 64), (4, 1, 16)]):
                cache = torch.zeros(4, page, hkv, d, dtype=dtype)
                tables = torch.zeros(2, 4, dtype=torch.int32)
                lens = torch.ones(2, dtype=torch.int32)
                kv = torch.zeros(2, hkv, d, dtype=dtype)
                store_kv(cache, cache, torch.zeros(2, dtype=torch.int64), kv, kv)
                q = torch.zeros(2, hkv * group, d, dtype=dtype)
                for splits in (1, 4):
                    paged_decode_attention(q, cache, cache, tables, lens, 0.1,
                                           max_kv_len=4096, num_splits=splits)
                    paged_decode_attention(q, cache, cache, tables, lens, 0.1, max_kv_len=4096,
                                           num_splits=splits, return_lse=True)
                    paged_decode_attention(q, cache, cache, tables, lens, 0.1, max_kv_len=4096,
                                           num_splits=splits, contiguous=True)  # virtual
                for max_q in ([8, 512] if quick else [8, 40, 512]):
                    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
                    extend_attention(q, cache, cache, tables, starts, lens, 0.1, max_q_len=max_q)
                    extend_attention(q, cache, cache, tables, starts[:2], lens, 0.1,
                                     max_q_len=max_q, q_lens=lens)
                    extend_attention(q, cache, cache, tables, starts[:2], lens, 0.1,
                                     max_q_len=max_q, q_lens=lens, return_lse=True)
                    extend_attention(q, cache, cache, tables, starts, lens, 0.1,
                                     max_q_len=max_q, window=4096)  # sliding window
                    extend_attention(q, cache, cache, tables, starts[:2], lens, 0.1,
                                     max_q_len=max_q, q_lens=lens, contiguous=True)
                # Tree attention: a level of runs of 2 (small row tile) and 64 rows (the
                # largest), one pass and split; then the merge of its states.
                blocks = torch.zeros(512, dtype=torch.long)
                for run_rows in (2, 64):
                    rows = torch.zeros(run_rows, dtype=torch.long)
                    for splits in (1, 4):
                        o, lse = cascade_level_attention(q, cache, cache, rows, [0, run_rows],
                                                         blocks, [0, 512], 0.1, num_splits=splits)
                        cascade_level_attention(q, cache, cache, rows, [0, run_rows], blocks,
                                                [0, 512], 0.1, num_splits=splits, contiguous=True)
                merge_attention_states_(o.clone(), lse.clone(), rows, o, lse)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few variants only")
    parser.add_argument("--fp32", action="store_true",
                        help="also fp32 inputs (slow to compile: exact fp32 dots run on FMAs)")
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: this compiles for the GPU")
    original = JITFunction.run
    JITFunction.run = _capture  # type: ignore[method-assign]
    try:
        _launches(args.quick, args.fp32)
    finally:
        JITFunction.run = original  # type: ignore[method-assign]
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(args.arch).path
    except Exception:  # noqa: BLE001 - usage numbers are optional
        ptxas = ""
    target = GPUTarget("cuda", args.arch, 32)
    failures, seen = 0, set()
    for fn, call_args, kwargs in captured:
        try:
            kernel, const, options = _compile(fn, call_args, kwargs, target)
        except Exception as exc:  # noqa: BLE001 - report every failure, then fail
            failures += 1
            print(f"FAIL {fn.fn.__name__} {kwargs}\n  {type(exc).__name__}: {str(exc)[:600]}")
            continue
        label = (f"{fn.fn.__name__} {', '.join(f'{k}={v}' for k, v in const.items())} "
                 f"warps={options['num_warps']} stages={options['num_stages']}")
        if label in seen:
            continue
        seen.add(label)
        usage = ""
        if ptxas and os.path.exists(ptxas):
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                f.write(kernel.asm["ptx"])
                f.flush()
                res = subprocess.run([ptxas, f"--gpu-name=sm_{args.arch}a", "-v", f.name,
                                      "-o", os.devnull], capture_output=True, text=True)
            regs = re.search(r"Used (\d+) registers", res.stderr)
            spills = re.search(r"(\d+) bytes spill stores", res.stderr)
            usage = (f" regs={regs.group(1) if regs else '?'}"
                     f" spill={spills.group(1) if spills else '?'}B")
        print(f"ok   {label} smem={kernel.metadata.shared}B{usage}")
    print(f"{len(seen)} distinct launches compiled for sm_{args.arch}, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
