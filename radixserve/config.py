"""The one home of radixserve's defaults: every option of the Engine and the server."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from radixserve.config_checks import QUANTIZATIONS, check_engine, check_server

__all__ = ["QUANTIZATIONS", "EngineConfig", "ServerConfig", "config_from_kwargs"]


DEFAULT_MODEL = "smollm2-135m"
PROMPT_CHARS_PER_TOKEN = 10
"""`max_prompt_chars` by default: this many characters per token of context. English runs
about 4 characters a token; whitespace-heavy or code text more; so an honest prompt that
fits the context passes and a megabyte of text is refused before the tokenizer sees it."""

def config_from_kwargs(cls: Any, kind: str, kwargs: dict[str, Any]) -> Any:
    """`cls(**kwargs)`, validated; a TypeError naming unknown options (and the known ones)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise TypeError(f"unknown {kind} option(s): {', '.join(unknown)}; "
                        f"known: {', '.join(sorted(names))}")
    config = cls(**kwargs)
    config.validate()
    return config


@dataclass
class EngineConfig:
    """Options shared by `Engine(**config)` and `radixserve serve --option`.

    A field name here is the keyword of the Engine and, with dashes, the server flag.
    """

    model: str = DEFAULT_MODEL
    """Model alias (`smollm2-135m`), a local Hugging Face directory, or a .gguf file."""
    page_size: int = 16
    """Tokens per KV block; the radix tree shares whole blocks only."""
    max_total_tokens: int | None = None
    """KV pool size in tokens; None sizes it from `kv_memory_fraction` (GPU) or 64k (CPU)."""
    kv_memory_fraction: float = 0.85
    """On CUDA, the share of free device memory given to the KV pool when not sized."""
    chunked_prefill_size: int = 512
    """Token budget of one forward step: running decodes first, then prefill chunks."""
    max_running_requests: int = 128
    """Most sequences decoding at once (each sample of `n` and each beam counts); more
    wait in the queue."""
    max_queued_requests: int = 4096
    """Requests waiting beyond this are refused as overloaded instead of queued."""
    max_queued_requests_per_tenant: int = 1024
    """One tenant's share of the queue: past it, refused as overloaded (docs/tenants.md)."""
    max_running_requests_per_tenant: int = 0
    """One tenant's running sequences at most; 0: an equal part among the busy tenants."""
    scheduler_stall_seconds: float = 10.0
    """A scheduler step (its own work and the worker's) that runs longer is reported:
    `slow_steps` in the stats counts it, and a server's health is `stalled` (503) while
    one runs."""
    tenant_prefill_tokens: int = 64
    """Prompt tokens one tenant's prefill may take in a step that decodes another tenant's
    sequences or while another's wait (docs/tenants.md): a flood of long prompts slows the
    others by at most that much prefill a step. Steps with no other tenant decoding or
    waiting use the whole `chunked_prefill_size`."""
    enable_prefix_cache: bool = True
    """Keep computed prefixes in the radix tree for later requests (off: every prompt is
    prefilled in full; for measuring what the cache saves)."""
    schedule_policy: Literal["lpm", "fcfs"] = "lpm"
    """Which waiting request is admitted first: `lpm`, the longest cached prefix (first
    come first served when the queue is long), or `fcfs`."""
    init_new_token_ratio: float = 0.7
    """Share of a running request's remaining `max_new_tokens` that admission reserves."""
    admission_max_new_tokens: int = 4096
    """Admission counts at most this many of a request's future tokens (as SGLang clips
    its estimate), so a request without a limit of its own, such as a chat completion
    without `max_tokens` (which may run to the end of the context), does not hold back
    every other admission. Retraction covers the rare request that outgrows its share."""
    min_new_token_ratio: float = 0.1
    """The least share of `max_new_tokens` admission reserves, after decay."""
    new_token_ratio_decay: float = 0.002
    """How much the reserved share drops per step without a retraction (a retraction
    puts it back to `init_new_token_ratio`)."""
    device: str = "auto"
    """`auto` (cuda if present, else cpu), `cpu`, `cuda`, `cuda:N`."""
    dtype: str = "auto"
    """`auto` (float32 on CPU, bfloat16 on CUDA), `float32`, `bfloat16`, `float16`."""
    quantization: Literal["none", "int8", "q4"] = "none"
    """Weight format of every projection (CPU only; the embedding stays dense): `none`;
    `int8` and `q4`, 8 or 4 bits with a scale and low per 32 inputs: `int8` quantized at
    load from any checkpoint, `q4` a GGUF's own Q4_0/Q4_1/Q4_K blocks as they are (the
    default model's Q4_1 among them), else quantized at load, and a GGUF's Q8_0 LM head as
    its own codes. Both run in fp32 through CPU kernels compiled once per machine (a C++
    compiler and ninja): the dequantized fp32 model up to rounding (`model/quantize.py`)."""
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    """`torch` (SDPA over gathered blocks; the CPU path), `triton` (paged kernels; CUDA, or
    the CPU under TRITON_INTERPRET=1) or `auto` (triton on CUDA, else torch)."""
    kv_layout: Literal["paged", "virtual"] = "paged"
    """`paged`: the pool's blocks gathered per step. `virtual` (vAttention): each running sequence a
    contiguous view onto its blocks, mapped on demand: with mmap on the CPU (`worker/virtual_kv.py`;
    whole memory pages per block, page_size 4 or more for the default model; admission keeps its
    mappings within `vm.max_map_count`), with the driver's VMM on CUDA (`worker/virtual_kv_cuda.py`;
    blocks padded to 2 MiB pages, the Triton kernels only, the `cuda` extra)."""
    virtual_page_layout: Literal["auto", "block", "layer"] = "auto"
    """On CUDA: a block's 2 MiB pages, its layers together or apart (`worker/virtual_pages.py`)."""
    virtual_max_map_count: int | None = None
    """The VMA limit the virtual layout budgets against; None: the kernel's
    (`/proc/sys/vm/max_map_count`). The budget is this less what the process maps and a
    margin; admission defers what would not fit. A lower one simulates a tighter kernel."""
    enable_cascade_attention: bool = True
    """Decode (and prefill chunks) over a prefix shared by several running sequences reads
    that prefix once per group, not once per sequence (tree attention; `worker/cascade.py`)."""
    cascade_max_levels: int = 3
    """Depth of the trie of shared block runs (e.g. system prompt, few-shot set, history)."""
    cascade_min_shared_tokens: int = 512
    """A shared run shorter than this is attended per sequence: not worth a separate pass
    (`bench/cascade_decode.py --preset gates` measures the break-even)."""
    cascade_min_group_size: int = 4
    """Sequences that must share a run for it to get its own pass."""
    cascade_cost_model: bool = True
    """Plan only where the costs measured at start-up say it pays, against a CUDA graph's
    replay where the step would replay one (`worker/cascade_cost.py`)."""
    disable_cuda_graph: bool = False
    """On CUDA, run every decode step eagerly instead of replaying a captured CUDA graph."""
    cuda_graph_max_bs: int = 128
    """Largest decode batch captured (1, 2, 4, 8, then every 8); a larger one runs eagerly."""
    disable_overlap_schedule: bool = False
    """On CUDA, wait for each step's result before preparing the next (scheduler/overlap.py;
    off on the CPU, whose cores would run both)."""
    speculative: Literal["off", "lookup", "tree"] = "off"
    """Speculative decoding without a draft model (`radixserve/speculative/`): each decode
    step proposes up to `speculative_num_draft_tokens` tokens that the model verifies in
    the same forward, so a step can emit several tokens. `lookup` drafts from the
    sequence's own context (prompt lookup); `tree` also from everything the radix tree
    holds in the request's namespace (earlier prompts and outputs). A request's
    `sampling_params.speculative` overrides it; beam search runs without."""
    speculative_num_draft_tokens: int = 4
    """Most tokens drafted for one sequence in one step (fewer as its acceptance falls)."""
    tp_size: int = 1
    """Tensor parallelism: the model's layers split over this many worker ranks (processes,
    over torch.distributed: gloo on the CPU, NCCL between GPUs), each holding its share of
    the heads, the MLP, the vocabulary and every KV block. The query heads and the MLP's
    intermediate size must divide by it, and the KV heads divide by it or it by them."""
    nnodes: int = 1
    """Hosts the `tp_size` ranks are spread over (`tp_size / nnodes` each); node 0 runs the
    server and the first ranks, the others `serve --node-rank K` with the same options."""
    node_rank: int = 0
    """This host's place among `nnodes`: 0 serves; another runs only its worker ranks."""
    dist_init_addr: str | None = None
    """`host:port` where the ranks meet (node 0's, reachable from every node); needed with
    `nnodes` > 1. None: a private file on this host (no port)."""
    tp_shared_memory: bool = True
    """With every rank on one host's CPU (x86), sum the layers' partials and gather the
    logits through shared memory (`worker/shm_collectives.py`) instead of gloo's TCP."""
    context_length: int | None = None
    """Override the model's maximum context length (never above what it was trained on)."""
    seed: int = 0
    """Seed for requests that sample without their own `seed`."""
    debug_invariants: bool = False
    """Check the KV-block invariant after every step (slow; tests turn it on)."""
    max_pinned_tokens: int | None = None
    """Most tokens that pinned prefixes (`pin_prefix`, `POST /cache/pin`) may hold in the
    KV pool at once; a pin past it is refused. None: half the pool; 0: no pinning."""
    kv_disk_dir: str | None = None
    """A directory for the disk tier: prefixes evicted from the KV pool go there instead of being
    dropped, and come back when asked for again; the tree's index is kept there too, so a restart on
    the same directory (and model) resumes warm. One server per directory. None: no disk tier."""
    kv_disk_size: int = 16 * 1024**3
    """Bytes the disk tier may hold (least recently used prefixes go first when full); the
    flag takes a count of bytes or a size such as `16G`, `512M`, `64k`."""
    kv_persist_interval: float = 60.0
    """Seconds between two saves of the tree's index to `kv_disk_dir` while serving (it is
    always saved on a clean shutdown, with every cached prefix written out first); 0: only
    on shutdown. A crash loses at most what changed since the last save."""
    kv_events: Literal["off", "radixserve", "llm-d"] = "off"
    """Publish the tree's changes as vLLM's KV events on `kv_events_port` (docs/fleets.md),
    block hashes being the tree's page hashes (`radixserve`) or llm-d's indexer's block
    keys (`llm-d`: SHA-256 over CBOR, chained from `kv_events_seed`)."""
    kv_events_seed: str = ""
    """With `kv_events=llm-d`: the indexer's `HashSeed` (vLLM's `PYTHONHASHSEED`)."""
    # -- limits: each is checked before any work, and its error names it ------------------
    max_prompt_chars: int | None = None
    """Longest text prompt, in characters, checked before tokenization (a chat's rendered
    conversation too); None: `PROMPT_CHARS_PER_TOKEN` times the context length."""
    max_call_chars: int | None = None
    """Most characters of text prompts in one generate call, all its prompts together,
    checked before any is tokenized (tokenizing costs ~1-2 ms per 1k characters); None:
    `PROMPT_CHARS_PER_TOKEN` times what the KV pool holds (no less than one longest prompt),
    so a call is never refused that the server could hold at once."""
    max_stop_strings: int = 64
    """Most entries in `stop` plus `stop_regex` of one request."""
    max_stop_chars: int = 1024
    """Longest single `stop` string or `stop_regex` pattern, in characters."""
    max_top_logprobs_num: int = 100
    """Largest `top_logprobs_num` (alternatives returned per position)."""
    max_logprob_entries: int = 1_000_000
    """Most logprobs one call may return: outputs x positions x (1 + top_logprobs_num)."""
    max_constraint_chars: int = 131072
    """Longest `regex`, `json_schema`, `ebnf` or `structural_tag`, in characters."""
    max_grammar_compile_seconds: float = 10.0
    """A constraint compiling longer is refused (then at once, in its cache namespace)."""
    grammar_compile_threads: int = 2
    """Threads that compile output constraints, off the scheduler's loop."""
    max_pending_grammar_compiles: int = 64
    """Constraints compiling or waiting for a compile thread at once; past it a request
    with a constraint not yet compiled is refused as overloaded."""
    max_grammar_compiles_per_tenant: int = 1
    """Compile threads one tenant may hold (one past its deadline too); then overloaded."""
    max_constraint_depth: int = 32
    """Deepest bracket nesting of an output constraint, checked before it compiles."""
    enable_lora: bool = False
    """Serve LoRA adapters (`radixserve/lora/`); on whenever `lora_paths` names any."""
    lora_paths: list[str] | dict[str, str] | None = None
    """PEFT LoRA adapters to load at start, each `NAME=PATH` (or a bare PATH, named after
    its directory, or SGLang's JSON `{"lora_name": NAME, "lora_path": PATH}`), or as a
    dict `{NAME: PATH}` (SGLang's Engine form); requests name them in `lora_name` (SGLang's
    /generate: `lora_path`), OpenAI's `model`."""
    max_lora_rank: int | None = None
    """Largest adapter rank served (slots are this wide); None: that of `lora_paths`' adapters
    (16 without any)."""
    lora_target_modules: list[str] | None = None
    """Projections adapters may adapt (q_proj ... down_proj, or all); None: those of
    `lora_paths`' adapters (all seven without any)."""
    max_loras_per_batch: int = 8
    """Adapters one step may run (device slots); a request of another waits for a slot."""
    max_loaded_loras: int = 32
    """Adapters held loaded; loading one more unloads the least recently used idle one."""

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        return config_from_kwargs(cls, "engine", kwargs)

    def pin_limit(self, pool_tokens: int) -> int:
        """`max_pinned_tokens`, or half of a pool of `pool_tokens` when it is None."""
        return pool_tokens // 2 if self.max_pinned_tokens is None else self.max_pinned_tokens

    def validate(self) -> None:
        """ValueError naming the first option out of its range (`config_checks.py`)."""
        check_engine(self)


@dataclass
class ServerConfig(EngineConfig):
    """The server's options: the engine's plus the front door's."""

    rpc_host: str = "127.0.0.1"
    """Interface of the RPC front door; anything but loopback must be asked for."""
    rpc_port: int = 30001
    """TCP port of the RPC front door; 0 picks a free one."""
    cache_events_port: int = 0
    """TCP port (on `rpc_host`; 0: a free one) publishing the radix tree's changes and the
    load for a cache-aware router (`model_info()["cache_events_address"]`). Only the operator
    may subscribe (ZeroMQ PLAIN with an operator key; transport/cache_events.py): the page
    hashes name every tenant's cached prefixes. Open without any key (a single user)."""
    kv_events_port: int = 5557
    """With `kv_events`: their PUB socket's port (on `rpc_host`; 0: a free one). Subscribing
    takes what `cache_events_port` takes: the events carry every tenant's token ids."""
    kv_events_replay_port: int = 5558
    """With `kv_events`: the ROUTER socket answering a sequence number with the events
    since (from 0, or from before what is kept: the whole tree first), then an empty one."""
    kv_events_topic: str = ""
    """With `kv_events`: the topic frame of each message (llm-d's reads `kv@POD@MODEL`)."""
    max_frame_bytes: int = 16 * 1024 * 1024
    """Largest RPC frame (one call), enforced by ZeroMQ (`ZMQ_MAXMSGSIZE`): a larger one is
    never buffered and its connection dropped (the clients here refuse to send one)."""
    max_request_bytes: int = 16 * 1024 * 1024
    """Largest HTTP request body: 413 before it is read when Content-Length says so, else as
    soon as that many bytes have come in."""
    rpc_send_buffer_bytes: int | None = None
    """SO_SNDBUF of each RPC client's TCP connection; None: the kernel's (up to
    `net.ipv4.tcp_wmem`'s 4 MiB: ~50,000 stream chunks before `max_client_backlog` counts)."""
    max_client_backlog: int = 1024
    """RPC replies held for a slow-reading client beyond ZeroMQ's buffers; past it, its
    streams end with an error `slow_reader` (their KV blocks freed), its other calls are
    answered when it reads again."""
    http_stream_backlog: int = 4096
    """Chunks the HTTP server holds for one stream whose client reads slowly; past it, the
    stream ends with an error event `slow_reader` and its request is aborted."""
    http_max_connections: int | None = None
    """Open HTTP connections at most; past it a new one closes the oldest that waits (for
    its request's headers, or idle between requests), else is answered 503. None: the
    process's descriptor limit (`ulimit -n`) less `http_fd_reserve`; never more than that."""
    http_fd_reserve: int = 256
    """File descriptors HTTP connections never take: RPC clients, ZeroMQ's and the
    children's sockets, files (server/http/connections.py)."""
    http_header_timeout: float = 10.0
    """Seconds a request's line and headers may take to arrive (from the connection, or
    from its first byte after an earlier request); past it, 408 and the connection closes."""
    http_body_timeout: float = 60.0
    """Seconds a request's body may take to arrive after its headers; past it, the
    connection closes."""
    http_idle_timeout: float = 30.0
    """Seconds an HTTP connection may stay open between requests (keep-alive)."""
    chat_template_timeout: float = 10.0
    """Seconds a chat's conversation (and tools) may take to render through the chat
    template (off the HTTP event loop), from its turn in the queue; past it, 400."""
    chat_template_threads: int = 2
    """Threads that render chat templates for the HTTP server."""
    max_pending_chat_renders: int = 64
    """Chat templates rendering or waiting for a thread at once; past it a chat request is
    refused as overloaded (503)."""
    watchdog_timeout: float = 300.0
    """A worker step unfinished after this many seconds is a crash: calls in flight fail
    with `worker_hung`, the scheduler and worker are killed (SIGKILL) and restarted."""
    max_worker_restarts: int = 3
    """Times the scheduler and worker are restarted after a crash within
    `worker_restart_window`; one more crash in that window and the server exits."""
    worker_restart_window: float = 600.0
    """Seconds a crash counts toward `max_worker_restarts`: crashes further apart never add
    up, so only a crash loop ends the server; 0: every crash counts for the server's life."""
    host: str = "127.0.0.1"
    """Interface of the HTTP server (SGLang-native and OpenAI-compatible APIs, /metrics)."""
    port: int = 30000
    """TCP port of the HTTP server; 0 picks a free one."""
    api_key: str | list[str] | None = None
    """If set, every HTTP route but /health needs `Authorization: Bearer <key>` and every
    RPC call but health carries `api_key`. Each entry is `KEY` (the `default` tenant's
    key) or `KEY=TENANT`; the flag may be given several times. Each tenant's requests use
    their own namespace of the radix cache (radixserve/tenants.py, docs/tenants.md)."""
    api_keys_file: str | None = None
    """A file of API keys, one `key tenant` a line (`#` starts a comment; a line with a
    key alone is the default tenant's), in addition to `api_key`."""
    admin_api_key: str | None = None
    """The operator's key (SGLang's name): needed for flush_cache, profiling, cache snapshots, the
    cache-events socket and the full /get_server_info; accepted for every other call, as the default
    tenant. None: without API keys everyone is the operator; with keys that are all the default
    tenant's, those keys; with several tenants, nobody (docs/security.md)."""
    cache_secret_file: str | None = None
    """A file holding the secret that keys the cache namespaces and page hashes (at least
    16 characters, e.g. `openssl rand -hex 32`): a router and all its replicas must share
    it. None: one made at start, kept in `kv_disk_dir` (mode 0600) when that is set, so a
    warm restart keeps its namespaces, else in memory for this run only."""
    profile_dir: str | None = None
    """Where profiler traces go (`/start_profile`); a caller may name at most a
    subdirectory of it. None: a private temporary directory, made at the first profile."""
    max_pinned_tokens_per_tenant: int | None = None
    """Most tokens one tenant's pins may hold (its pins' whole prefixes summed); a tenant
    here is anyone but the operator. None: a fair share, `max_pinned_tokens` divided by
    the number of tenants. The operator's pins count only against `max_pinned_tokens`."""
    max_pin_ttl: float = 86400.0
    """Longest `ttl` of a tenant's pin (anyone's but the operator's), in seconds; a
    tenant's pin without a ttl lapses after this. The operator's pins are not bounded."""
    max_stored_responses: int = 1000
    """Responses (`/v1/responses` with `store`) kept per tenant; past it, the oldest go."""
    max_stored_response_bytes: int = 64 << 20
    """Bytes of stored responses (their conversations) kept per tenant; past it, the
    oldest go."""
    stored_response_ttl: float = 3600.0
    """Seconds a stored response may be read or continued (`previous_response_id`)."""
    served_model_name: str | None = None
    """The model name the OpenAI API lists and accepts (default: the `model` option as given;
    the model directory's name and path are accepted too)."""
    log_level: str = "info"
    """debug, info, warning or error."""

    def validate(self) -> None:
        """ValueError naming the first option out of its range (`config_checks.py`)."""
        check_engine(self)
        check_server(self)

    def engine_config(self) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        return EngineConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in names})
