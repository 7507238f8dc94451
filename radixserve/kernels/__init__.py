"""Triton attention kernels over the paged KV cache (installed as `radixserve.kernels`),
run on CUDA or under `TRITON_INTERPRET=1`. Their plain torch versions, the CPU path and
the kernels' ground truth, are `radixserve/worker/attention/paged_torch.py`.
"""

if __name__ == "kernels":
    # Imported by the top-level name, which is the Hugging Face `kernels` package's
    # (transformers >= 5.25 depends on it and imports it): that happens when the checkout's
    # root is on sys.path (`python -m ...` or `python -c` run from it). Hand over to the
    # installed package, found on sys.path without the checkout, as if it had been found
    # first; the import system returns what is in sys.modules at the end.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    # Without that package installed this module stays what it was (transformers imports
    # it only to read its missing version).
    # Every radixserve checkout on sys.path is passed over, not only this one: with two
    # (bench/run.py --baseline puts an earlier commit's beside this one) each would hand over
    # to the other, round and round.
    def _checkout(path: str) -> bool:
        root = os.path.abspath(path or os.curdir)
        return (os.path.isfile(os.path.join(root, "pyproject.toml"))
                and os.path.isdir(os.path.join(root, "radixserve")))

    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if not _checkout(p)])
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
