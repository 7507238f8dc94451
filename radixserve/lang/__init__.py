"""radixserve.lang: a frontend for multi-call LLM programs, in SGLang's vocabulary.

`import radixserve.lang as sgl` runs SGLang frontend programs (gen, select, roles, fork /
join, run / run_batch, streaming) against radixserve, in-process (`EngineBackend`) or over
RPC (`RuntimeEndpoint`). Shared prefixes (fork points, few-shot examples, select's prompt)
are committed once and then served from the runtime's radix cache.
"""

from radixserve.lang.api import (Runtime, assistant, assistant_begin, assistant_end, flush_cache,
                                 function, gen, gen_int, gen_string, select, system,
                                 system_begin, system_end, user, user_begin, user_end)
from radixserve.lang.backends import (Backend, EngineBackend, RuntimeEndpoint,
                                      get_default_backend, set_default_backend)
from radixserve.lang.choices import (ChoicesDecision, ChoicesSamplingMethod,
                                     greedy_token_selection, token_length_normalized,
                                     unconditional_likelihood_normalized)
from radixserve.lang.interpreter import ProgramError
from radixserve.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
from radixserve.lang.program import SglFunction
from radixserve.lang.state import ProgramState, ProgramStateGroup

__all__ = [
    "Backend", "ChoicesDecision", "ChoicesSamplingMethod", "EngineBackend", "ProgramError",
    "ProgramState", "ProgramStateGroup", "REGEX_BOOL", "REGEX_FLOAT", "REGEX_INT",
    "REGEX_STR", "Runtime", "RuntimeEndpoint", "SglFunction", "assistant", "assistant_begin",
    "assistant_end", "flush_cache", "function", "gen", "gen_int", "gen_string",
    "get_default_backend", "greedy_token_selection", "select", "set_default_backend",
    "system", "system_begin", "system_end", "token_length_normalized",
    "unconditional_likelihood_normalized", "user", "user_begin", "user_end",
]
