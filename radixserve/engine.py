"""`Engine`: the scheduler and the worker in one process, driven directly (no sockets).

One loop thread drives the same `EngineCore.step()` as the scheduler process, with the
worker called directly; `generate` queues its requests and waits for them, so callers in
many threads share one continuous batch. The lock guards the scheduler's bookkeeping and
is released while the worker computes, so new requests join the queue meanwhile.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
from contextlib import closing
from typing import Any, Generator, Iterator, Literal, cast


from radixserve.config import EngineConfig
from radixserve.disk_layout import pin, unpin
from radixserve.messages import (CacheInfoCall, Caller, Control, ControlOp, ControlReply,
                                 FlushCacheCall, LoadLoraCall, LorasCall, PinCall, ProfileCall,
                                 UnloadLoraCall, UnpinCall, beam_arguments)
from radixserve.model.loader import load_tokenizer, resolve_model
from radixserve.results.generate import sglang_result
from radixserve.scheduler.core import EngineCore
from radixserve.scheduler.scheduler import Scheduler
from radixserve.stop_strings import Decode
from radixserve.front_door.detokenizer import StreamedText
from radixserve.front_door.output import CallOutputs
from radixserve.tenants import (DEFAULT_TENANT, check_cache_salt, load_cache_secret,
                                namespace_of)
from radixserve.front_door.cache_calls import describe_cache, pin_ids, unpin_ids
from radixserve.front_door.requests import build_requests, eos_token_ids
from radixserve.worker.worker import Worker


class Engine:
    """The runtime in this process; its operations are `radixserve.api.Api`'s, as a
    `Client`'s to a server (without the transport's `timeout` and `api_key`)."""

    def __init__(self, model: str | None = None, **config: Any) -> None:
        if model is not None:
            config["model"] = model
        self.config = EngineConfig.from_kwargs(**config)
        self.model_dir = resolve_model(self.config.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        # The disk tier's directory is checked and opened once, first, so that a directory
        # other accounts can reach is refused before any work; the scheduler and worker
        # use that descriptor, never the path again (disk_layout.pin). The cache secret is
        # kept there, so that a warm restart keeps its salts' namespaces.
        self._disk = pin(self.config.kv_disk_dir) if self.config.kv_disk_dir else None
        try:
            self._cache_secret = load_cache_secret(None, self.config.kv_disk_dir)
            self.worker, self._ranks = self._start_worker()
            self.info = self.worker.info()
            decode = cast(Decode, self.tokenizer.decode)
            scheduler = Scheduler(self.config, self.info, decode=decode,
                                  eos_token_ids=eos_token_ids(self.tokenizer, self.model_dir),
                                  cache_secret=self._cache_secret)
        except BaseException:
            if self._disk is not None:
                unpin(self._disk)
            raise
        self._lock = threading.Condition()
        self.core = EngineCore(scheduler, self.worker, self.info, lock=self._lock)
        self._calls: dict[str, CallOutputs] = {}
        self._control_ids = itertools.count(1)
        self._control_replies: dict[int, ControlReply] = {}
        self._closed = False
        self._loop = threading.Thread(target=self._run, name="radixserve-engine", daemon=True)
        self._loop.start()

    def _start_worker(self) -> tuple[Worker, list[Any]]:
        """The worker here, and with `tp_size` > 1 the other ranks as child processes (this
        process is rank 0; they exit with it)."""
        if self.config.tp_size == 1:
            return Worker(self.config, self.model_dir), []
        if self.config.node_rank != 0:
            raise ValueError("an Engine is node 0 of its group; run other nodes' ranks with "
                             "`radixserve serve --node-rank K`")
        from radixserve.server.processes import placement, start_ranks
        from radixserve.worker.tensor_parallel import rendezvous

        self._private_dir = tempfile.TemporaryDirectory(prefix="radixserve-tp-")
        meet = rendezvous(self.config.dist_init_addr, self._private_dir.name)
        ranks = start_ranks(self.config, str(self.model_dir), meet,
                            None if self._disk is None else self._disk.fd)
        try:
            return Worker(self.config, self.model_dir, placement(self.config, 0), meet), ranks
        except BaseException:
            for rank in ranks:
                rank.kill()
            raise

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    def _namespace(self, cache_salt: str | None) -> str | None:
        return namespace_of(DEFAULT_TENANT, check_cache_salt(cache_salt), self._cache_secret)

    # -- generate ---------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0, return_text_in_logprobs: bool = False,
                 rid: str | list[str] | None = None,
                 cache_salt: str | None = None, *, stream: bool = False,
                 lora_name: str | list[str | None] | None = None
                 ) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (returns a dict) or a batch (returns a list of dicts,
        `n` per prompt for `n` > 1). Every request is validated before any runs; a bad one
        raises ValueError/TypeError naming the field and its index in the batch.
        `cache_salt`: only calls with the same salt share cached prefixes (and calls with
        none share only with each other). `lora_name`: the LoRA adapter to run under (the
        name it was loaded as), or one per prompt; None: the base model. With `stream=True`, an
        iterator of chunks `{"index", "text", "token_ids"}` (since that output's previous
        chunk) ending with `{"final": result}`, as `Client.generate` streams; closing it
        early aborts."""
        requests, single = build_requests(
            self.tokenizer, self.info, self.config, prompt=prompt,
            sampling_params=sampling_params, input_ids=input_ids, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num, rid=rid,
            namespace=self._namespace(cache_salt), lora_name=lora_name)
        call = CallOutputs.of(requests, single, return_text_in_logprobs)
        return self._stream_call(call) if stream else self._run_call(call)

    def beam_search(self, prompt: str | list[str] | None = None,
                    input_ids: list[int] | list[list[int]] | None = None, *,
                    beam_width: int = 4, max_new_tokens: int = 16, length_penalty: float = 1.0,
                    early_stopping: bool | str = False, ignore_eos: bool = False,
                    stop_token_ids: list[int] | None = None, skip_special_tokens: bool = True,
                    rid: str | list[str] | None = None,
                    cache_salt: str | None = None) -> list[dict] | list[list[dict]]:
        """Beam search as transformers' `generate(num_beams=beam_width, do_sample=False)`:
        per prompt, its `beam_width` best beams, best first, each with `text`, `output_ids`
        and `meta_info.beam_score` (the length-normalised score transformers reports as
        `sequences_scores`). A list of such lists for a batch of prompts."""
        requests, single = build_requests(
            self.tokenizer, self.info, self.config, prompt=prompt, input_ids=input_ids, rid=rid,
            namespace=self._namespace(cache_salt),
            **beam_arguments(beam_width, max_new_tokens, length_penalty, early_stopping,
                             ignore_eos, stop_token_ids, skip_special_tokens))
        return self._run_call(CallOutputs.of(requests, single))

    def _run_call(self, call: CallOutputs) -> Any:
        for _ in self._advance(call, each_step=False):
            pass
        return sglang_result(call.result(self.tokenizer))

    def _stream_call(self, call: CallOutputs) -> Iterator[dict]:
        """The chunks of `call` as its outputs advance (see `generate`), text decoded as
        the RPC front door streams it; beams come only in the final result."""
        streamed = StreamedText(self.tokenizer, call.requests)
        sent = [0] * len(call.states)
        with closing(self._advance(call, each_step=True)) as steps:
            for _ in steps:
                with self._lock:  # the loop thread extends the outputs
                    news = {i: (call.states[i].finished, call.states[i].output_ids[sent[i]:])
                            for i in streamed.live}
                for index, (finished, new) in news.items():
                    sent[index] += len(new)
                    text = streamed.chunk(index, new, call.states[index].text(self.tokenizer)
                                          if finished else None)
                    if text or new:
                        yield {"index": index, "text": text, "token_ids": new}
        yield {"final": sglang_result(call.result(self.tokenizer))}

    def _advance(self, call: CallOutputs, each_step: bool) -> Generator[None, None, None]:
        """Submit the call's requests, then yield (not holding the lock) once they are all
        done, or with `each_step` also whenever the loop advanced them. Leaving early, an
        error or an interrupt aborts what still runs: nothing of the call stays queued."""
        for req in call.requests:  # compile constraints here, not under the lock the loop needs
            constraint = req.sampling.constraint
            if constraint is not None:
                self.scheduler.grammars.compile(*constraint, namespace=req.namespace)
        submitted: list[str] = []

        def progress() -> int:
            return sum(len(s.output_ids) + s.finished for s in call.states)

        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the engine is shut down")
                for req in call.requests:
                    self.core.submit(req)
                    submitted.append(req.rid)
                    self._calls[req.rid] = call
                self._lock.notify_all()
            seen, done = -1, False
            while not done:
                with self._lock:
                    self._lock.wait_for(lambda: call.done or call.error is not None
                                        or self._closed or (each_step and progress() != seen))  # noqa: B023
                    seen, done = progress(), call.done
                if call.error is not None:
                    raise ValueError(call.error)
                if not done and self._closed:
                    raise RuntimeError("the engine was shut down before the requests finished")
                yield
        finally:
            with self._lock:
                for rid in submitted:
                    del self._calls[rid]
                    if not call.done:
                        self.core.abort(rid)
                self._lock.notify_all()

    def _run(self) -> None:
        """The engine loop: wait for work, run one core step, hand the updates to callers."""
        while True:
            with self._lock:
                # A constraint compiling in its thread is looked for now and then.
                self._lock.wait_for(lambda: self.core.has_work or self._closed,
                                    self.core.wait_limit(None))
                if self._closed:
                    return
            updates = self.core.step()  # takes the lock itself, not while the worker runs
            with self._lock:
                for msg in self.core.outbox:
                    if isinstance(msg, ControlReply):
                        self._control_replies[msg.call_id] = msg
                    elif (call := self._calls.get(msg.rid)) is not None:  # refused
                        call.error = msg.message
                self.core.outbox.clear()
                for update in updates:
                    call = self._calls.get(update.rid)
                    if call is not None:
                        call.apply(update)
                self._lock.notify_all()

    # -- control ----------------------------------------------------------------------
    def abort(self, rid: str) -> dict[str, str]:
        """Abort every output of the request `rid`: `{"aborted": rid}`, whether or not it
        was running (as a server answers)."""
        with self._lock:
            self.core.abort(rid)
            self._lock.notify_all()
        return {"aborted": rid}

    def flush_cache(self) -> bool:
        """Drop every cached prefix but the pinned ones; False (refused) while requests are
        queued or running. Answered once the worker's KV views are released, if any."""
        if self._closed:  # no loop to wait on, and the worker (its KV views) is gone
            with self._lock:
                return self.scheduler.flush_cache()
        return self._control(FlushCacheCall(0))["flushed"]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return self.core.stats()

    def model_info(self) -> dict[str, Any]:
        """The model and KV pool the engine runs, as a server's `model_info` has them
        (`WorkerInfo.model_info`; no cache events are published)."""
        return self.info.model_info(self.config.model)

    def health(self) -> dict[str, Any]:
        """`{"status", "pids"}`: `ok` until `shutdown`."""
        return {"status": "shut_down" if self._closed else "ok",
                "pids": {"engine": os.getpid()}}

    def pin_prefix(self, text: str | None = None, input_ids: list[int] | None = None, *,
                   ttl: float | None = None, cache_salt: str | None = None) -> dict:
        """Keep a prefix (its whole pages) cached, prefilling it first if it is not, until
        `unpin_prefix` or `ttl` seconds: `{"tokens", "expires_in", "tier",
        "pinned_tokens"}`. ValueError past `max_pinned_tokens` (and for a bad prompt)."""
        if ttl is not None and not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl!r}")
        namespace = self._namespace(cache_salt)
        ids = pin_ids(self.tokenizer, self.info, self.config, text=text, input_ids=input_ids,
                      namespace=namespace)
        return self._control(PinCall(call_id=0, input_ids=ids, ttl=ttl),
                             Caller(namespace=namespace))

    def unpin_prefix(self, text: str | None = None, input_ids: list[int] | None = None, *,
                     cache_salt: str | None = None) -> dict:
        """Drop the pin of exactly this prefix: `{"unpinned": bool, "tokens", ...}`."""
        ids = unpin_ids(self.tokenizer, text, input_ids)
        namespace = self._namespace(cache_salt)
        return self._control(UnpinCall(call_id=0, input_ids=ids), Caller(namespace=namespace))

    def unpin_all(self) -> dict:
        """Drop every pin, in every namespace: `{"unpinned", "pins", "tokens", ...}`."""
        return self._control(UnpinCall(call_id=0, all=True))

    def cache_info(self, top: int = 20) -> dict:
        """The radix tree summarised: see `Client.cache_info` (all namespaces)."""
        if not isinstance(top, int) or top < 0:
            raise ValueError(f"top must be an integer >= 0, got {top!r}")
        return describe_cache(self._control(CacheInfoCall(call_id=0, top=top)), self.tokenizer)

    def start_profile(self, output_dir: str | None = None) -> dict[str, Any]:
        """Start a torch.profiler trace of the worker's steps, to be written to
        `output_dir` (default: a folder in the temp dir) when stopped. ValueError if one is
        already running."""
        return self._profile("start", output_dir)

    def stop_profile(self) -> dict[str, Any]:
        """Stop the trace and write it; the answer names the file (`trace`)."""
        return self._profile("stop", None)

    def _profile(self, action: Literal["start", "stop"], output_dir: str | None) -> dict[str, Any]:
        return self._control(ProfileCall(0, action, output_dir))

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Load the PEFT LoRA adapter at `lora_path` as `lora_name` (LoadLoraCall: past
        `max_loaded_loras` an idle one is unloaded); ValueError naming what is wrong."""
        return self._control(LoadLoraCall(0, lora_name, lora_path))

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload an adapter no request uses; ValueError otherwise."""
        return self._control(UnloadLoraCall(0, lora_name))

    def list_lora_adapters(self) -> list[dict[str, Any]]:
        """The adapters loaded, least recently used first."""
        return self._control(LorasCall(0))["loras"]

    def _control(self, op: ControlOp, caller: Caller = Caller()) -> dict[str, Any]:
        """Send the control operation `op` (the Engine's caller: the operator's scope) and
        wait for its answer (now, or from the loop: a profile call between steps, a pin
        after its prefill); ValueError if it was refused."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is shut down")
            call_id = next(self._control_ids)
            reply = self.core.handle(Control(call_id, op, caller))
            if reply is None:
                self._lock.notify_all()
                self._lock.wait_for(lambda: call_id in self._control_replies or self._closed)
                reply = self._control_replies.pop(call_id, None)
        if reply is None:
            raise RuntimeError("the engine was shut down before the call was answered")
        if reply.error is not None:
            raise ValueError(reply.error)
        return reply.payload

    def check_invariants(self) -> None:
        """The KV-block invariant; with nothing running, nothing may be held privately."""
        with self._lock:
            self.scheduler.check_invariants()

    def shutdown(self) -> None:
        """Stop the loop (requests still waiting get a RuntimeError) and free the model."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._loop is not threading.current_thread():
            self._loop.join()
        in_step = True  # the other ranks are told to stop unless the group broke
        if self.worker is not None:
            self.core.close()
            self.worker.close()
            in_step = self.worker.tp.broken is None
        for rank in self._ranks:
            rank.join(10 if in_step else 0)
            rank.kill()
        self.worker = None  # type: ignore[assignment]
        if self._disk is not None:
            unpin(self._disk)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
