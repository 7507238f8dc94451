"""Soak: the three-process server under mixed, hostile traffic for a bounded time, with its
worker killed every few minutes; every greedy answer checked against a reference.

Traffic, from several concurrent clients at once (loopback only):
- RPC `Client` threads and `AsyncClient` tasks: greedy and sampled generate calls, plain and
  streamed, with random aborts by rid mid-flight and streams abandoned mid-way;
- HTTP threads: SGLang-native `/generate` and OpenAI `/v1/chat/completions`, plain and
  streamed (server-sent events), with aborts (`/abort_request`) and clients that close the
  connection early (mid-stream, or before a plain answer);
- a chaos thread: malformed RPC frames on a raw ZeroMQ DEALER (garbage bytes, wrong field
  types, several parts, truncated frames, unknown call types), which must each be answered
  `malformed_frame` (bytes that are no msgpack call frame) or `invalid_request` (msgpack
  that fits no call, naming the field), and raw RPC clients that vanish mid-stream;
- invalid requests on every path (bad sampling parameters, unknown fields, a prompt longer
  than the KV pool, token ids outside the vocabulary, an empty prompt, a text prompt over
  `max_prompt_chars`, an unknown model), which must each be refused with a clear 4xx /
  `invalid_request`;
- a KV pool small enough that eviction and retraction happen all the time
  (`--max-total-tokens`), with the block invariant checked after every step
  (`debug_invariants`);
- a SIGKILL of the worker process every `--kill-every` seconds: calls in flight then fail
  with `worker_died` (and calls during the restart with `not_ready`), which is expected;
  the server must then serve again;
- an attacker thread (tools/soak/attacks/; issue 25), one attack every `--attack-every`
  seconds on average from the groups `--attacks` (counts, nesting, template, regex,
  tenants, small; all by default), each bounded by `--attack-timeout` seconds: huge `n` /
  `best_of` / `top_logprobs` / batches, frames and bodies nested thousands deep, a caller's
  chat template, a backtracking `stop_regex` and bursts of slow grammars, bob aborting or
  reusing alice's rid, bob calling the operator's calls, pinning past a quota or
  subscribing to the cache events, GET on /flush_cache and /start_profile, calls with no
  key. Each is refused as expected, served where the issue allows it, or an unexplained
  failure (a 5xx, no answer, a dropped connection, a server process restarted with no
  scheduled kill, alice's stream ended), which fails the run.

Tenants: the server has two tenant keys (`alice`, `bob`; the traffic's clients take turns)
and, where this commit's ServerConfig has `admin_api_key`, an operator key, which the idle
checks, flushes and the monitor use (else they use alice's key).

A sentinel thread watches the server's processes: if the front door exits, or their RSS
passes `--max-server-rss-mib` (an attack growing it; it is then killed, so that a shared
machine survives the run), the run stops and reports what it has, the dead server failing
the verdict.

Answers computed beforehand: a fixed set of greedy prompts (chat-formatted; several share a
long system prompt, so the radix cache and its eviction are exercised), whose outputs
transformers computes at start (fp32, one prompt at a time: `tests/hf_reference.py`). Each
case's length stops before the first step where the reference's top-2 logits are within
`TIE_GAP` (floating-point order may flip such a near-tie between batch shapes), so every
completed greedy answer must equal its reference exactly, on every path; an aborted one
must be a prefix of it. Sampled answers are only checked for well-formedness.

Every call has a timeout (`--call-timeout`); a call that gets no answer counts as a failure
`no_answer`. Failures `worker_died` / `not_ready` count as expected only inside a kill's
window (from the kill until the restarted server answers, plus a few seconds).

Figures (after a warm-up phase, so that the start figures are steady state; both measured
idle, after a cache flush, with only the control client connected): RSS and open file
descriptors of the server's process tree at start and end; KV blocks leaked (after the
final flush, `num_blocks - free_blocks`); requests sent, completed, failed by reason; wrong
answers; worker restarts survived; the scheduler's retractions and evictions over the run;
the attacks by kind: sent, refused as expected, served, failed in a kill's window,
unexplained. Pass: 0 wrong answers, 0 leaked blocks, RSS and fd growth < 5%, 0 unexpected
failures, 0 unexplained attack failures, every kill survived, the server alive at the end.

    python -m tools.soak --minutes 20                  # writes bench/results/soak.{json,md}
    python -m tools.soak --minutes 2 --kill-every 45 --warmup-seconds 20 --out /tmp/soak
    python -m tools.soak --minutes 2 --attacks tenants,small --attack-every 2 --out /tmp/soak

Not run by CI: it takes as long as it is told to.

Modules: `main` (the options, the server, the phases), `cases` (the greedy references),
`state` (`Soak`, `Phase`: what the threads record into), the traffic (`rpc_traffic`,
`http_traffic`, `chaos`, `invalid`), `killer`, `monitor`, `phases` (one phase's threads and
summary), `report` (the verdict and the markdown), `attacks/` (the attacker and the sentinel)
and `outcome` (what an attack got back).
"""
