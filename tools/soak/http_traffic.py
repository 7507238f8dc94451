"""HTTP traffic: SGLang-native `/generate` and OpenAI `/v1/chat/completions`, plain and
streamed, with aborts, clients that close the connection early and invalid requests."""

from __future__ import annotations

import json
import random
import time
import uuid
from typing import Any, Callable, Iterator

import httpx

from tools.soak.cases import Case
from tools.soak.invalid import invalid_rpc_call
from tools.soak.state import Soak


# -- HTTP threads --------------------------------------------------------------------------
def http_thread(soak: Soak, seed: int, key: str) -> None:
    rng = random.Random(seed)
    actions: list[tuple[Callable[[Soak, httpx.Client, random.Random], None], float]] = [
        (http_generate, 3), (http_generate_stream, 3), (http_chat, 2), (http_chat_stream, 2),
        (http_sampled, 2), (http_abort, 1), (http_disconnect_stream, 1),
        (http_disconnect_plain, 0.7), (http_invalid, 1)]
    fns, weights = zip(*actions)
    timeout = httpx.Timeout(soak.args.call_timeout, connect=10.0)
    with httpx.Client(base_url=soak.http_url, timeout=timeout,
                      headers={"Authorization": f"Bearer {key}"}) as http:
        while soak.running():
            time.sleep(soak.backoff_s())
            fn = rng.choices(fns, weights)[0]
            soak.begin()
            kind = f"http.{fn.__name__.removeprefix('http_')}"
            try:
                fn(soak, http, rng)
            except httpx.TimeoutException as e:
                soak.fail(kind, "no_answer", repr(e))
            except httpx.TransportError as e:
                soak.fail(kind, f"http_transport:{type(e).__name__}", repr(e))
            except Exception as e:
                soak.client_bug(kind, e)


def _http_error(soak: Soak, kind: str, status: int, body: Any) -> None:
    """An error answer: its reason is the server's code (worker_died, not_ready, ...) when
    it names one, with the status."""
    err = body.get("error", {}) if isinstance(body, dict) else {}
    code = err.get("code") if isinstance(err, dict) else None
    reason = code if isinstance(code, str) else f"http_{status}"
    message = err.get("message", "") if isinstance(err, dict) else str(body)
    soak.fail(kind, reason, f"{status}: {message}")


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return {"error": {"message": r.text[:200]}}


def _sse(lines: Iterator[str]) -> Iterator[Any]:
    """The JSON payloads of a server-sent event stream; the string "[DONE]" at its end."""
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            yield data if data == "[DONE]" else json.loads(data)


def _generate_body(case: Case, rng: random.Random, stream: bool, **extra: Any) -> dict:
    prompt = {"text": case.text} if rng.random() < 0.3 else {"input_ids": case.ids}
    return {**prompt, "sampling_params": case.params, "stream": stream, **extra}


def http_generate(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    case = soak.case(rng)
    r = http.post("/generate", json=_generate_body(case, rng, False))
    body = _json(r)
    if r.status_code != 200:
        return _http_error(soak, "http.generate", r.status_code, body)
    soak.record_greedy("http.generate", case, body["output_ids"],
                       body["meta_info"]["finish_reason"])


def http_generate_stream(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    case = soak.case(rng)
    kind = "http.generate_stream"
    with http.stream("POST", "/generate", json=_generate_body(case, rng, True)) as r:
        if r.status_code != 200:
            r.read()
            return _http_error(soak, kind, r.status_code, _json(r))
        ids, final, error = _read_generate_stream(r.iter_lines(), None)
    if error is not None or final is None:
        return _http_error(soak, kind, 200, error or {"error": {"message": "no result"}})
    if ids and ids != final["output_ids"][:len(ids)]:
        return soak.fail(kind, "bad_answer", "chunks differ from the result")
    soak.record_greedy(kind, case, final["output_ids"], final["meta_info"]["finish_reason"])


def _chat_body(case: Case, stream: bool) -> dict:
    return {"model": "default", "messages": case.messages, "max_tokens": len(case.expected),
            "temperature": 0, "ignore_eos": True, "stream": stream}


def http_chat(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    case = soak.case(rng)
    r = http.post("/v1/chat/completions", json=_chat_body(case, False))
    body = _json(r)
    if r.status_code != 200:
        return _http_error(soak, "http.chat", r.status_code, body)
    usage = body["usage"]
    if usage["prompt_tokens"] != len(case.ids) or usage["completion_tokens"] != len(case.expected):
        return soak.record_greedy("http.chat", case, f"usage {usage}", "?")
    choice = body["choices"][0]
    soak.record_greedy("http.chat", case, choice["message"]["content"], choice["finish_reason"])


def http_chat_stream(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    case = soak.case(rng)
    kind = "http.chat_stream"
    text, finish, error, done = "", None, None, False
    with http.stream("POST", "/v1/chat/completions", json=_chat_body(case, True)) as r:
        if r.status_code != 200:
            r.read()
            return _http_error(soak, kind, r.status_code, _json(r))
        for event in _sse(r.iter_lines()):
            if event == "[DONE]":
                done = True
                break
            if "error" in event:
                error = event
                continue
            for choice in event["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    if error is not None:
        return _http_error(soak, kind, 200, error)
    if not done:
        return soak.fail(kind, "stream_cut", "the event stream ended without [DONE]")
    soak.record_greedy(kind, case, text, finish)


def http_sampled(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    params = soak.sampled_params(rng)
    r = http.post("/generate", json={"input_ids": soak.sampled_prompt(rng),
                                     "sampling_params": params})
    body = _json(r)
    if r.status_code != 200:
        return _http_error(soak, "http.sampled", r.status_code, body)
    soak.check_sampled("http.sampled", body, params)


def http_abort(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    """A streamed greedy /generate aborted with /abort_request after a chunk or few."""
    case = soak.case(rng)
    rid = f"soak-http-abort-{uuid.uuid4().hex}"
    kind = "http.abort"
    with http.stream("POST", "/generate", json=_generate_body(case, rng, True, rid=rid)) as r:
        if r.status_code != 200:
            r.read()
            return _http_error(soak, kind, r.status_code, _json(r))
        lines = r.iter_lines()
        ids, final, error = _read_generate_stream(lines, rng.randint(1, 4))
        soak.begin()
        a = http.post("/abort_request", json={"rid": rid}, timeout=30)
        if a.status_code == 200:
            soak.record("http.abort_call", "completed")
        else:
            _http_error(soak, "http.abort_call", a.status_code, _json(a))
        if final is None and error is None:
            ids, final, error = _read_generate_stream(lines, None, ids)
    if error is not None or final is None:
        return _http_error(soak, kind, 200, error or {"error": {"message": "no result"}})
    soak.record_greedy(kind, case, final["output_ids"], final["meta_info"]["finish_reason"],
                       aborted_ok=True)


def _read_generate_stream(lines: Iterator[str], stop_after: int | None,
                               ids: list[int] | None = None
                               ) -> tuple[list[int], dict | None, dict | None]:
    """A /generate event stream, from an iterator of its lines that may be resumed:
    (the last chunk's cumulative ids, the final result, an error event), stopping after
    `stop_after` chunks if given. A stream cut short is an error `stream_cut`."""
    ids = ids or []
    n = 0
    for event in _sse(lines):
        if event == "[DONE]":
            return ids, None, _cut("[DONE] without a result")
        if "error" in event:
            return ids, None, event
        if event["meta_info"].get("finish_reason") is not None:
            if "[DONE]" not in _sse(lines):  # the result is the last event before it
                return ids, None, _cut("no [DONE] after the result")
            return ids, event, None
        ids = event["output_ids"]
        n += 1
        if stop_after is not None and n >= stop_after:
            return ids, None, None
    return ids, None, _cut("the event stream ended without [DONE]")


def _cut(message: str) -> dict[str, Any]:
    return {"error": {"code": "stream_cut", "message": message}}


def http_disconnect_stream(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    """Read a chunk or few of a stream (greedy /generate or chat), then close the
    connection: the server must abort the request and free its blocks."""
    case = soak.case(rng)
    kind = "http.disconnect_stream"
    path, body = (("/generate", _generate_body(case, rng, True)) if rng.random() < 0.6
                  else ("/v1/chat/completions", _chat_body(case, True)))
    with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            r.read()
            return _http_error(soak, kind, r.status_code, _json(r))
        want = rng.randint(1, 3)
        for n, _ in enumerate(_sse(r.iter_lines())):
            if n + 1 >= want:
                break
        # Leaving the block unread closes the connection (httpx does not reuse it).
    soak.record(kind, "disconnected")


def http_disconnect_plain(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    """A plain /generate whose client gives up before the answer (a short read timeout
    closes the connection); if the answer comes first, it is checked."""
    case = soak.case(rng)
    kind = "http.disconnect_plain"
    try:
        r = http.post("/generate", json=_generate_body(case, rng, False),
                      timeout=httpx.Timeout(rng.uniform(0.2, 2.0), connect=10.0))
    except httpx.ReadTimeout:
        return soak.record(kind, "disconnected")
    body = _json(r)
    if r.status_code != 200:
        return _http_error(soak, kind, r.status_code, body)
    soak.record_greedy(kind, case, body["output_ids"], body["meta_info"]["finish_reason"])


def http_invalid(soak: Soak, http: httpx.Client, rng: random.Random) -> None:
    """A request the server must refuse with a 4xx naming the problem."""
    case = soak.case(rng)
    choice = rng.randrange(7)
    if choice <= 1:
        call = invalid_rpc_call(soak, rng)
        body: Any = {("text" if k == "prompt" else k): v for k, v in call.items()}
        path = "/generate"
    elif choice == 2:
        path, body = "/v1/chat/completions", {**_chat_body(case, rng.random() < 0.5),
                                              "temperature": -2}
    elif choice == 3:
        path, body = "/v1/chat/completions", {**_chat_body(case, False), "model": "no-such-model"}
    elif choice == 4:
        path, body = "/generate", {"input_ids": case.ids, "no_such_field": True}
    elif choice == 5:
        path, body = "/v1/chat/completions", {**_chat_body(case, False), "messages": []}
    else:
        path, body = "/generate", None  # not JSON at all
    if body is None:
        r = http.post(path, content=b"{not json", headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    if 400 <= r.status_code < 500:
        err = _json(r).get("error")
        if isinstance(err, dict) and err.get("message"):
            return soak.record("http.invalid", "refused")
        return soak.fail("http.invalid", "unclear_refusal", r.text[:200])
    if r.status_code == 200:
        return soak.fail("http.invalid", "invalid_accepted", f"{path} {str(body)[:200]}")
    _http_error(soak, "http.invalid", r.status_code, _json(r))
