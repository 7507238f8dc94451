"""`Engine`: the scheduler and the worker in one process, driven directly (no sockets).

One loop thread runs the steps; `generate` queues its requests and waits for them, so
callers in many threads share one continuous batch. The lock guards the scheduler's
bookkeeping and is released while the worker computes, so new requests join the queue
meanwhile.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from radixserve.config import EngineConfig
from radixserve.model.loader import load_tokenizer, resolve_model
from radixserve.scheduler.scheduler import Scheduler
from radixserve.tokenizer.output import RequestState
from radixserve.tokenizer.requests import build_requests, eos_token_ids, new_state
from radixserve.worker.worker import Worker

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: str | None = None, **config: Any) -> None:
        if model is not None:
            config["model"] = model
        self.config = EngineConfig.from_kwargs(**config)
        self.model_dir = resolve_model(self.config.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.worker = Worker(self.config, self.model_dir)
        self.info = self.worker.info()
        self.scheduler = Scheduler(self.config, self.info, decode=self._decode,
                                   eos_token_ids=eos_token_ids(self.tokenizer, self.model_dir))
        self._lock = threading.Condition()
        self._states: dict[str, RequestState] = {}
        self._closed = False
        self._loop = threading.Thread(target=self._run, name="radixserve-engine", daemon=True)
        self._loop.start()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # -- generate ---------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0, return_text_in_logprobs: bool = False,
                 rid: str | list[str] | None = None) -> dict | list[dict]:
        """Generate for one prompt (returns a dict) or a batch (returns a list of dicts,
        `n` per prompt for `n` > 1). Every request is validated before any runs; a bad one
        raises ValueError/TypeError naming the field and its index in the batch."""
        requests, single = build_requests(
            self.tokenizer, self.info, self.config, prompt=prompt,
            sampling_params=sampling_params, input_ids=input_ids, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num, rid=rid)
        rids: list[str] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is shut down")
            try:
                for req in requests:
                    for sub in self.scheduler.add_request(req):
                        self._states[sub] = new_state(req, sub, return_text_in_logprobs)
                        rids.append(sub)
                self._lock.notify_all()
                self._lock.wait_for(lambda: all(self._states[r].finished for r in rids)
                                    or self._closed)
            finally:  # also on an error or an interrupt: nothing of this call stays queued
                states = [self._states.pop(r) for r in rids]
                for state in states:
                    if not state.finished:
                        self.scheduler.abort(state.rid)
                self._lock.notify_all()
        if not all(s.finished for s in states):
            raise RuntimeError("the engine was shut down before the requests finished")
        results = [s.result(self.tokenizer) for s in states]
        return results[0] if single and len(results) == 1 else results

    def _run(self) -> None:
        """The engine loop: schedule, forward (lock released), fold results in, wake callers."""
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self.scheduler.has_work or self._closed)
                if self._closed:
                    return
                batch, updates = self.scheduler.schedule()
                if batch is None and not updates and self.scheduler.waiting:
                    # Cannot happen by construction; never spin or leave callers waiting.
                    log.error("requests could not be scheduled; aborting them")
                    for req in list(self.scheduler.waiting):
                        self.scheduler.abort(req.rid)
            if batch is not None:
                try:
                    result = self.worker.forward(batch.forward)
                except Exception as e:  # one bad step must not take the engine down
                    log.exception("forward step failed")
                    with self._lock:
                        updates += self.scheduler.fail_batch(batch, f"internal error: {e!r}")
                else:
                    with self._lock:
                        updates += self.scheduler.process_result(batch, result)
            with self._lock:
                for update in updates:
                    state = self._states.get(update.rid)
                    if state is not None:
                        state.apply(update)
                self._lock.notify_all()

    # -- control ----------------------------------------------------------------------
    def abort(self, rid: str) -> None:
        with self._lock:
            self.scheduler.abort(rid)

    def flush_cache(self) -> bool:
        with self._lock:
            return self.scheduler.flush_cache()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self.scheduler.stats(), "kv_pool_bytes": self.info.kv_pool_bytes,
                    "page_size": self.info.page_size, "device": self.info.device,
                    "dtype": self.info.dtype}

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
        self.worker = None  # type: ignore[assignment]

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
