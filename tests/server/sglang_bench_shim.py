"""Run SGLang's benchmark client (`python -m sglang.bench_serving ...`) without SGLang's
server extras: `sglang` is installed with `--no-deps`, and its package `__init__` imports
the whole server (torch, triton, orjson, pybase64, flashinfer, ...). This runner registers
`sglang` as a bare namespace over the installed folder, so only the benchmark's own modules
load, and provides the one constant the benchmark takes from the server's disaggregation
package (`FAKE_BOOTSTRAP_HOST`, used only by --fake-prefill). Where Hugging Face `datasets`
is not installed (it is big: pyarrow, pandas), a stub stands in: the benchmark imports it at
module level for its MMMU and LongBench datasets only, which these runs never use.

    python tests/server/sglang_bench_shim.py --backend sglang --base-url ... [bench args]
"""

from __future__ import annotations

import importlib.util
import sys
import types


def install() -> None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed (pip install --no-deps sglang)")
    for name, path in (("sglang", list(spec.submodule_search_locations)),
                       ("sglang.srt", [p + "/srt" for p in spec.submodule_search_locations]),
                       ("sglang.srt.disaggregation", []),
                       ("sglang.srt.utils", [p + "/srt/utils"
                                             for p in spec.submodule_search_locations])):
        module = types.ModuleType(name)
        module.__path__ = path  # a package whose __init__ is skipped
        sys.modules[name] = module
    utils = types.ModuleType("sglang.srt.disaggregation.utils")
    utils.FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's value; unused without --fake-prefill
    sys.modules["sglang.srt.disaggregation.utils"] = utils
    if importlib.util.find_spec("datasets") is None:
        stub = types.ModuleType("datasets")

        def load_dataset(*args: object, **kwargs: object) -> None:
            raise ImportError("Hugging Face `datasets` is not installed")

        stub.load_dataset = load_dataset  # type: ignore[attr-defined]
        sys.modules["datasets"] = stub


if __name__ == "__main__":
    install()
    from sglang.benchmark.serving import cli_main

    cli_main()
