"""`Engine`: the scheduler and the worker in one process, driven directly (no sockets).

Callers in several threads share one continuous batch: each `generate` call queues its
requests and then takes turns running steps, and every step advances all running
requests, whoever asked for them.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import uuid
from pathlib import Path
from typing import Any

import msgspec

from radixserve.config import EngineConfig
from radixserve.messages import SamplingParams, TokenizedRequest
from radixserve.model.loader import load_tokenizer, resolve_model
from radixserve.scheduler.scheduler import Scheduler
from radixserve.scheduler.validate import validate_request
from radixserve.tokenizer.output import RequestState
from radixserve.worker.worker import Worker

log = logging.getLogger(__name__)


def parse_sampling_params(raw: Any, where: str = "sampling_params") -> SamplingParams:
    """A dict of sampling settings to SamplingParams; errors name the offending field."""
    if raw is None:
        return SamplingParams()
    if isinstance(raw, SamplingParams):
        return raw
    if not isinstance(raw, dict):
        raise TypeError(f"{where} must be a dict, got {type(raw).__name__}")
    try:
        return msgspec.convert(raw, SamplingParams)
    except msgspec.ValidationError as e:
        msg = str(e).replace("`$.", f"`{where}.").replace(" - at `$`", "")
        raise ValueError(f"invalid {where}: {msg}") from None


def eos_token_ids(tokenizer: Any, model_dir: Path) -> list[int]:
    """EOS ids from the tokenizer and generation_config.json (what transformers stops on)."""
    ids = set() if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    return sorted(ids)


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
        self._lock = threading.Lock()
        self._states: dict[str, RequestState] = {}
        self._ids = itertools.count()

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
        requests, single = self._build(prompt, sampling_params, input_ids, return_logprob,
                                       logprob_start_len, top_logprobs_num, rid)
        rids: list[str] = []
        with self._lock:
            for req in requests:
                sp = req.sampling
                for sub in self.scheduler.add_request(req):
                    self._states[sub] = RequestState(
                        rid=sub, stop=sp.stop_strings(), input_ids=req.input_ids,
                        skip_special_tokens=sp.skip_special_tokens, no_stop_trim=sp.no_stop_trim,
                        return_logprob=req.return_logprob, logprob_start_len=req.logprob_start_len,
                        return_text_in_logprobs=return_text_in_logprobs)
                    rids.append(sub)
        try:
            self._run_until(rids)
        finally:
            with self._lock:
                states = [self._states.pop(r) for r in rids]
        results = [s.result(self.tokenizer) for s in states]
        return results[0] if single and len(results) == 1 else results

    def _build(self, prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
               top_logprobs_num, rid) -> tuple[list[TokenizedRequest], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else prompt
            if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
                raise TypeError("prompt must be a string or a list of strings")
            token_lists = [self.tokenizer.encode(p) for p in prompts]
        else:
            single = bool(input_ids) and all(isinstance(t, int) for t in input_ids)
            token_lists = [input_ids] if single else input_ids
            if not isinstance(token_lists, list) or not all(
                    isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                  for t in ids) for ids in token_lists):
                raise TypeError("input_ids must be a list of ints or a list of lists of ints")
        n = len(token_lists)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        rids = rid if isinstance(rid, list) else [rid] * n
        if len(params) != n or len(rids) != n:
            raise ValueError(f"sampling_params and rid lists must have one entry per prompt ({n})")
        for name, value, kind in (("return_logprob", return_logprob, bool),
                                  ("logprob_start_len", logprob_start_len, int),
                                  ("top_logprobs_num", top_logprobs_num, int)):
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise TypeError(f"{name} must be {kind.__name__}, got {type(value).__name__}")
        requests = []
        for i, (ids, sp, r) in enumerate(zip(token_lists, params, rids)):
            where = "sampling_params" if single else f"sampling_params[{i}]"
            req = TokenizedRequest(
                rid=r or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}", input_ids=ids,
                sampling=parse_sampling_params(sp, where), return_logprob=return_logprob,
                logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num)
            try:
                validate_request(req, self.info, self.config)
            except ValueError as e:
                raise ValueError(str(e) if single else f"prompt {i}: {e}") from None
            requests.append(req)
        return requests, single

    def _run_until(self, rids: list[str]) -> None:
        while True:
            with self._lock:
                if all(self._states[r].finished for r in rids):
                    return
                if not self._step():
                    raise RuntimeError("scheduler went idle with requests unfinished")

    def _step(self) -> bool:
        """Run one scheduler step (and forward); False if there was nothing to do."""
        batch, updates = self.scheduler.schedule()
        if batch is not None:
            try:
                result = self.worker.forward(batch.forward)
            except Exception as e:  # one bad step must not take the engine down
                log.exception("forward step failed")
                updates += self.scheduler.fail_batch(batch, f"internal error: {e!r}")
            else:
                updates += self.scheduler.process_result(batch, result)
        for update in updates:
            state = self._states.get(update.rid)
            if state is not None:
                state.apply(update)
        return batch is not None or bool(updates)

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
        with self._lock:
            self.worker = None  # type: ignore[assignment]

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
