"""The functions a program is written with, under SGLang's names and signatures."""

from __future__ import annotations

from typing import Any, Callable

from radixserve.lang.backends import Backend, RuntimeEndpoint, as_backend, get_default_backend
from radixserve.lang.choices import ChoicesSamplingMethod, token_length_normalized
from radixserve.lang.ir import Expr, ExprList, Gen, GenParams, RoleBegin, RoleEnd, Select, as_expr
from radixserve.lang.program import SglFunction


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None
             ) -> Any:
    """`@function` (or `@function()`): turn `def prog(s, ...)` into a runnable program."""
    if func is not None:
        return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)
    return lambda f: SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        n: int | None = None, stop: str | list[str] | None = None,
        temperature: float | None = None, dtype: Any = None, choices: list[str] | None = None,
        choices_method: ChoicesSamplingMethod | None = None, regex: str | None = None,
        **settings: Any) -> Expr:
    """Generate into variable `name`. Unset settings come from `run(...)`. `choices=` makes
    it a select; `regex=` / `dtype=` (int, float, bool, str) / `json_schema=` (a string)
    constrain the output in the runtime (masked sampling, see radixserve/scheduler/);
    `max_tokens` and `min_tokens` are the runtime's `max_new_tokens` and `min_new_tokens`.
    Every other `SamplingParams` field (top_p, min_p, seed, stop_regex, ...) and the
    logprob arguments are taken by name (`ir.SETTINGS`); an unknown one is refused."""
    if choices:
        return Select(name, list(choices), 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)
    if n not in (None, 1):
        raise NotImplementedError("gen(n > 1): fork the state instead")
    if dtype is not None and regex is not None:
        raise ValueError("gen: pass dtype or regex, not both")
    return Gen(name, GenParams.of(dtype, **{
        "max_new_tokens": max_tokens, "min_new_tokens": min_tokens, "stop": stop,
        "temperature": temperature, "regex": regex, **settings}))


def gen_int(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Expr:
    return gen(name, max_tokens, dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Expr:
    return gen(name, max_tokens, dtype=str, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> Expr:
    """Append the choice the model scores highest (see choices.py for the methods); the
    variable holds the choice, `get_meta_info(name)` the scores."""
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    return Select(name, list(choices), temperature, choices_method)


def _role(role: str, expr: Expr | str | None) -> Expr:
    if expr is None:
        return ExprList([RoleBegin(role), RoleEnd(role)])
    return ExprList([RoleBegin(role), as_expr(expr), RoleEnd(role)])


def system(expr: Expr | str | None = None) -> Expr:
    return _role("system", expr)


def user(expr: Expr | str | None = None) -> Expr:
    return _role("user", expr)


def assistant(expr: Expr | str | None = None) -> Expr:
    return _role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


def flush_cache(backend: Any = None) -> Any:
    chosen = backend if backend is not None else get_default_backend()
    return None if chosen is None else as_backend(chosen).flush_cache()


class Runtime:
    """SGLang's `sgl.Runtime(...)`: start a radixserve server (its options, plus SGLang's
    `model_path`) and expose it as `.endpoint`, a RuntimeEndpoint."""

    def __init__(self, model_path: str | None = None, **options: Any) -> None:
        from radixserve.server.runtime import Runtime as ServerRuntime

        self.server = ServerRuntime(model_path, **options)
        self.endpoint: Backend = RuntimeEndpoint(self.server.rpc_address)

    def shutdown(self) -> None:
        self.endpoint.shutdown()
        self.server.shutdown()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
