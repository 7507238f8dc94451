"""Requests the server must refuse as `invalid_request`, sent on every path."""

from __future__ import annotations

import random
from typing import Any

from tools.soak.state import Soak

INVALID_PARAMS: list[dict[str, Any]] = [
    {"max_new_tokens": 8, "temperature": -1.0},
    {"max_new_tokens": 8, "top_p": 2.0},
    {"max_new_tokens": -5},
    {"max_new_tokens": 8, "no_such_parameter": 1},
    {"max_new_tokens": 8, "n": 0},
    {"max_new_tokens": 8, "stop": ["x" * 5000]},
]


def invalid_rpc_call(soak: Soak, rng: random.Random) -> dict[str, Any]:
    """Arguments of a generate call the server must refuse as invalid_request."""
    case = soak.case(rng)
    choice = rng.randrange(5)
    if choice == 0:
        return {"input_ids": case.ids, "sampling_params": rng.choice(INVALID_PARAMS)}
    if choice == 1:  # longer than the whole KV pool
        return {"input_ids": [100] * (soak.pool_tokens + 1),
                "sampling_params": {"max_new_tokens": 1}}
    if choice == 2:
        return {"input_ids": case.ids[:8] + [soak.vocab_size + 7], "sampling_params": {}}
    if choice == 3:
        return {"input_ids": [], "sampling_params": {}}
    return {"prompt": "word " * (soak.args.max_prompt_chars // 5 + 10),
            "sampling_params": {"max_new_tokens": 1}}
