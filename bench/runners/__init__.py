"""Runners: radixserve's Engine (cache on/off) and the transformers baselines.

See `base.py` for the interface (one small class per new runner, e.g. the RPC client).
"""

from bench.runners.base import GREEDY, Completion, Runner, RunResult

__all__ = ["GREEDY", "Completion", "Runner", "RunResult"]
