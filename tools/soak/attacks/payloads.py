"""The attacks on what one request may ask of the server: huge counts (n, best_of,
top_logprobs, beam width, batches), frames and bodies nested thousands deep, a caller's chat
template, a backtracking stop pattern and bursts of slow grammars (issue 25, classes 1-4)."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import msgspec
import zmq

from tools.soak.attacks.base import REFUSAL_CODES, Attacker, http_outcome, rpc_outcome
from tools.soak.outcome import Outcome, failed, refused, served
from radixserve.messages import Envelope, ErrorReply, RpcReply

HUGE = 1_000_000_000
DEEP = (1000, 4000)
"""Nesting depth of the deep frames and bodies (a frame of 1-4 KB)."""
GRAMMAR_BURST = 4
SLOW_SCHEMA_PROPERTIES = 10
"""Properties of a slow JSON schema, each a string `[a-z]{3,2000}`: some 1.5 s of xgrammar
compile each on an idle core of the reference machine (a burst compiled one after another
on the scheduler's loop stalls it for all that time)."""
SLOW_REGEX_REPEAT = 5000
"""`[a-z ]{1,5000}`: some 0.6 s of compile on an idle core."""
CATASTROPHIC = "(a|aa)+b"
"""Backtracks exponentially in Python's `re` over a run of `a`s with no `b`."""
HEAVY_TEMPLATE = ("{% for i in range(3000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"
                  "<|im_start|>user\n{{ messages[0]['content'] }}<|im_end|>\n"
                  "<|im_start|>assistant\n")
"""A caller's chat template: three million loop steps of Jinja, then a plain prompt."""


def nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


# -- 1. work sized by the caller ----------------------------------------------------------
def huge_count(a: Attacker) -> list[tuple[str, Outcome]]:
    t = a.tenant()
    http, rpc = a.http[t], a.rpc[t]
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1}
    which = a.rng.randrange(9)
    if which == 0:
        return [("counts.n.generate", http_outcome(http.post("/generate", json={
            "text": "hi", "sampling_params": {"n": HUGE, "max_new_tokens": 1}})))]
    if which == 1:
        return [("counts.n.completions", http_outcome(http.post("/v1/completions", json={
            "model": "default", "prompt": "hi", "n": HUGE, "max_tokens": 1})))]
    if which == 2:
        return [("counts.n.chat", http_outcome(http.post("/v1/chat/completions",
                                                         json={**chat, "n": HUGE})))]
    if which == 3:
        return [("counts.n.rpc", rpc_outcome(lambda: rpc.generate(
            "hi", {"n": HUGE, "max_new_tokens": 1}, timeout=a.timeout)))]
    if which == 4:
        return [("counts.best_of.completions", http_outcome(http.post(
            "/v1/completions", json={"model": "default", "prompt": "hi", "best_of": HUGE,
                                     "max_tokens": 1})))]
    if which == 5:
        return [("counts.top_logprobs.generate", http_outcome(http.post("/generate", json={
            "text": "hi", "return_logprob": True, "top_logprobs_num": HUGE,
            "sampling_params": {"max_new_tokens": 1}})))]
    if which == 6:
        return [("counts.top_logprobs.rpc", rpc_outcome(lambda: rpc.generate(
            "hi", {"max_new_tokens": 1}, return_logprob=True, top_logprobs_num=HUGE,
            timeout=a.timeout)))]
    if which == 7:
        return [("counts.top_logprobs.chat", http_outcome(http.post(
            "/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": HUGE})))]
    return [("counts.beam_width.generate", http_outcome(http.post("/generate", json={
        "text": "hi", "sampling_params": {"beam_width": HUGE, "max_new_tokens": 1}})))]


def huge_batch(a: Attacker) -> list[tuple[str, Outcome]]:
    """A batch far past any sane size: one whose last prompt is invalid (refused however
    big a batch may be), or one all valid (refused by a bound on the batch)."""
    t = a.tenant()
    which = a.rng.randrange(3)
    if which == 0:
        prompts = ["hi"] * 20_000 + ["word " * (a.soak.args.max_prompt_chars // 5 + 10)]
        return [("counts.batch_invalid_last.generate", http_outcome(a.http[t].post(
            "/generate", json={"text": prompts, "sampling_params": {"max_new_tokens": 1}})))]
    ids = [[1]] * 100_000
    if which == 1:
        ids = ids + [[a.soak.vocab_size + 7]]
        kind = "counts.batch_invalid_last.rpc"
    else:
        kind = "counts.batch_100k.rpc"
    return [(kind, rpc_outcome(lambda: a.rpc[t].generate(
        input_ids=ids, sampling_params={"max_new_tokens": 1}, timeout=a.timeout)))]

# -- 2. deep nesting ----------------------------------------------------------------------
def deep_rpc(a: Attacker) -> list[tuple[str, Outcome]]:
    """A generate frame whose sampling_params.stop nests arrays thousands deep, as raw
    msgpack on a DEALER socket of our own (after its envelope, with a tenant's key)."""
    marker = "\x00deep\x00"
    frame = msgspec.msgpack.encode({
        "type": "generate", "call_id": 7, "input_ids": [1, 2, 3],
        "sampling_params": {"stop": marker}, "api_key": a.keys[a.tenant()]})
    frame = frame.replace(msgspec.msgpack.encode(marker),
                          b"\x91" * a.rng.randint(*DEEP) + b"\x01")
    sock = a.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(a.soak.rpc_address)
    try:
        sock.send_multipart([msgspec.msgpack.encode(Envelope(7, a.keys[a.tenant()])), frame])
        if not sock.poll(int(a.timeout * 1000)):
            return [("nesting.rpc", failed("no_answer", f"no reply in {a.timeout:g} s"))]
        reply = msgspec.msgpack.Decoder(RpcReply).decode(sock.recv())
    except msgspec.DecodeError as e:
        return [("nesting.rpc", failed("undecodable_reply", repr(e)))]
    finally:
        sock.close(linger=0)
    if isinstance(reply, ErrorReply):
        return [("nesting.rpc", refused(reply.code) if reply.code in REFUSAL_CODES
                 else failed(reply.code, reply.message))]
    return [("nesting.rpc", failed("attack_accepted", repr(reply)[:200]))]


def deep_http(a: Attacker) -> list[tuple[str, Outcome]]:
    deep = nested(a.rng.randint(*DEEP))
    if a.rng.random() < 0.5:
        kind, path = "nesting.http.generate", "/generate"
        body = '{"text": "hi", "sampling_params": {"stop": %s}}' % deep
    else:
        kind, path = "nesting.http.chat", "/v1/chat/completions"
        body = ('{"model": "default", "messages": [{"role": "user", "content": "hi"}], '
                '"max_tokens": 1, "chat_template_kwargs": {"x": %s}}' % deep)
    return [(kind, http_outcome(a.http[a.tenant()].post(
        path, content=body.encode(), headers={"content-type": "application/json"})))]

# -- 3. a caller's code ---------------------------------------------------------------------
def template(a: Attacker) -> list[tuple[str, Outcome]]:
    """A caller's template must be refused; a template variable may be served."""
    body = {"model": "default", "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 4, "temperature": 0}
    http = a.http[a.tenant()]
    if a.rng.random() < 0.6:
        return [("template.caller_template", http_outcome(http.post(
            "/v1/chat/completions",
            json={**body, "chat_template_kwargs": {"chat_template": HEAVY_TEMPLATE}})))]
    return [("template.variable", http_outcome(http.post(
        "/v1/chat/completions", json={**body, "chat_template_kwargs": {
            "enable_thinking": False, "soak_variable": "x"}}),
        serve=lambda r: served()))]

# -- 4. matching work in the shared loops -----------------------------------------------------
def stop_regex(a: Attacker) -> list[tuple[str, Outcome]]:
    """`(a|aa)+b` over an output of `a`s (the token forced by logit_bias): a linear-time
    or bounded matcher serves it (or refuses the pattern); `re` stops every request."""
    params = {"max_new_tokens": 48, "ignore_eos": True, "temperature": 0,
              "stop_regex": CATASTROPHIC, "logit_bias": {str(a.a_token): 100}}
    t = a.tenant()
    prompt = "Write the letter a many times: aaaaaaaa"
    if a.rng.random() < 0.5:
        return [("regex.stop_regex.rpc", rpc_outcome(
            lambda: a.rpc[t].generate(prompt, params, timeout=a.timeout),
            serve=lambda r: served()))]
    return [("regex.stop_regex.generate", http_outcome(a.http[t].post(
        "/generate", json={"text": prompt, "sampling_params": params}),
        serve=lambda r: served()))]


def slow_grammar(i: int) -> dict[str, str]:
    """A slow constraint, new each time (no grammar cache hit): a JSON schema of long string
    patterns, or (every other one) a regex of large repetition counts."""
    tag = uuid.uuid4().hex[:8]
    if i % 2:
        return {"regex": f"{tag}[a-z ]{{1,{SLOW_REGEX_REPEAT}}}"}
    return {"json_schema": json.dumps({"type": "object", "properties": {
        f"{tag}_{k}": {"type": "string", "pattern": "[a-z]{3,2000}"}
        for k in range(SLOW_SCHEMA_PROPERTIES)}})}


def grammar_burst(a: Attacker) -> list[tuple[str, Outcome]]:
    """Several slow grammars at once: each compiles (served), or is refused (too slow,
    overloaded); none may stall the loop past the timeout or get a worker killed."""
    t = a.tenant()
    codes = REFUSAL_CODES | {"overloaded"}

    def one(i: int) -> Outcome:
        return rpc_outcome(lambda: a.rpc[t].generate(
            "hi", {**slow_grammar(i), "max_new_tokens": 4},
            timeout=a.timeout), codes, serve=lambda r: served())

    with ThreadPoolExecutor(GRAMMAR_BURST) as pool:
        return [("regex.grammar_burst", o) for o in pool.map(one, range(GRAMMAR_BURST))]
