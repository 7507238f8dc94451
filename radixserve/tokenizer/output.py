"""Collect a request's updates and render the SGLang-shaped result dict."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from radixserve.messages import RequestUpdate, TopLogprobs


@dataclass
class RequestState:
    """What the front door knows of one request while it runs."""

    rid: str
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top: list[TopLogprobs | None] | None = None
    input_ids: list[int] = field(default_factory=list)
    logprob_start_len: int = -1
    last: RequestUpdate | None = None
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    def apply(self, update: RequestUpdate) -> None:
        now = time.perf_counter()
        if update.new_token_ids and self.first_token_at is None:
            self.first_token_at = now
        if update.finished:
            self.finished_at = now
        self.output_ids.extend(update.new_token_ids)
        self.output_logprobs.extend(update.output_logprobs)
        self.output_top.extend(update.output_top)
        if update.input_logprobs is not None:
            self.input_logprobs = update.input_logprobs
            self.input_top = update.input_top
        self.last = update

    def text(self, tokenizer: Any) -> str:
        text = tokenizer.decode(self.output_ids, skip_special_tokens=self.skip_special_tokens)
        reason = self.last.finish_reason if self.last else None
        matched = reason.get("matched") if reason else None
        if isinstance(matched, str) and not self.no_stop_trim:
            cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
        return text

    def result(self, tokenizer: Any) -> dict[str, Any]:
        last = self.last
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": last.finish_reason if last else None,
            "prompt_tokens": last.prompt_tokens if last else len(self.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": last.cached_tokens if last else 0,
            "e2e_latency": _since(self.created, self.finished_at),
            "ttft": _since(self.created, self.first_token_at),
        }
        if self.return_logprob:
            name = self._namer(tokenizer)
            meta["output_token_logprobs"] = [
                [lp, t, name(t)] for lp, t in zip(self.output_logprobs, self.output_ids)]
            meta["output_top_logprobs"] = [self._top(top, name) for top in self.output_top]
            if self.logprob_start_len >= 0:
                targets = self.input_ids[self.logprob_start_len:]
                meta["input_token_logprobs"] = [
                    [lp, t, name(t)] for lp, t in zip(self.input_logprobs or [], targets)]
                meta["input_top_logprobs"] = [self._top(top, name)
                                              for top in self.input_top or []]
        return {"text": self.text(tokenizer), "output_ids": list(self.output_ids),
                "meta_info": meta}

    def _namer(self, tokenizer: Any):
        if not self.return_text_in_logprobs:
            return lambda token_id: None
        return lambda token_id: tokenizer.decode([token_id])

    @staticmethod
    def _top(top: TopLogprobs | None, name) -> list[list[Any]] | None:
        if top is None:
            return None
        return [[lp, t, name(t)] for lp, t in zip(top.logprobs, top.token_ids)]


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else end - start
