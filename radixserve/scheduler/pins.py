"""Pinned prefixes: prefixes that the tree keeps in memory until unpinned or expired.

A pin is named by its namespace and its page-aligned tokens; pinning the same prefix again
refreshes its expiry instead of adding a second hold. The tree holds each pin as a lock of
its own (`RadixCache.pin`), so eviction skips it without knowing what pins are; this table
knows what each one is for. Expiry is lazy: the scheduler calls `expire` before each step
and before every pin, unpin and cache view, so an expired pin holds nothing a step or a
caller could notice.

`max_pinned_tokens` bounds `RadixCache.pinned_tokens` (pins that share a prefix count its
tokens once): a pin past it is refused with an error naming the flag. A pin may also have
an `owner` (a tenant) with a `quota`: the owner's pins' tokens summed (nested ones each)
stay within it, and the owner's answers give only its own total.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from radixserve.cache.node import Namespace, RadixNode
from radixserve.cache.radix import RadixCache

PinKey = tuple[Namespace, tuple[int, ...]]


@dataclass
class Pin:
    node: RadixNode
    """Where the pinned prefix ends (its tree lock)."""
    tokens: int
    expires_at: float | None
    """time.monotonic() when it lapses; None: held until unpinned."""
    owner: str | None = None

    def describe(self, now: float) -> dict:
        return {"tokens": self.tokens,
                "expires_in": None if self.expires_at is None else max(0.0, self.expires_at - now)}


class PinnedPrefixes:
    def __init__(self, tree: RadixCache, max_pinned_tokens: int) -> None:
        self.tree, self.max_pinned_tokens = tree, max_pinned_tokens
        self.pins: dict[PinKey, Pin] = {}

    @staticmethod
    def key(tokens: list[int], page_size: int, namespace: Namespace) -> PinKey:
        """A pin's name: the namespace and the whole pages of `tokens` (what the tree can
        hold; a partial last page is never pinned)."""
        return namespace, tuple(tokens[:len(tokens) // page_size * page_size])

    def check_size(self, tokens: int, owner: str | None = None,
                   quota: int | None = None) -> None:
        """Refuse at once a prefix that alone is past the bound, or past its owner's quota
        with the owner's other pins, before any prefill. The exact bound (with the other
        pins, shared tokens counted once) is `pin`'s, after the prefill: a prefix refused
        then stays cached, unpinned, like any other."""
        if tokens > self.max_pinned_tokens:
            raise ValueError(f"a pin of {tokens} tokens is more than max_pinned_tokens="
                             f"{self.max_pinned_tokens} (--max-pinned-tokens)")
        if quota is not None and self.owned(owner) + tokens > quota:
            raise ValueError(
                f"a pin of {tokens} tokens would hold {self.owned(owner) + tokens} tokens in "
                f"this tenant's pins, more than its quota of {quota} "
                "(--max-pinned-tokens-per-tenant); unpin a prefix first")

    def owned(self, owner: str | None) -> int:
        """Tokens of `owner`'s pins (each pin's whole prefix; None: every pin, shared
        tokens counted once)."""
        if owner is None:
            return self.tree.pinned_tokens
        return sum(p.tokens for p in self.pins.values() if p.owner == owner)

    def pin(self, key: PinKey, ttl: float | None, owner: str | None = None,
            quota: int | None = None) -> dict:
        """Pin the prefix `key`, which must be cached whole now; ValueError if it is not,
        or if pinning it would hold more than `max_pinned_tokens`, or than `owner`'s
        `quota`. Pinned again, a prefix's expiry is refreshed (by its owner only)."""
        namespace, tokens = key
        expires_at = None if ttl is None else time.monotonic() + ttl
        old = self.pins.get(key)
        if old is not None:
            old.expires_at = expires_at
            return self._answer(old, owner)
        self.check_size(len(tokens), owner, quota)
        match = self.tree.match_prefix(tokens, namespace=namespace)
        if match.length < len(tokens):
            raise ValueError(f"only {match.length} of the prefix's {len(tokens)} tokens stayed "
                             "cached (the pool is too small for it): not pinned")
        added = self.tree.unpinned_tokens(match.node)
        if self.tree.pinned_tokens + added > self.max_pinned_tokens:
            raise ValueError(
                f"pinning {added} more tokens would hold {self.tree.pinned_tokens + added} "
                f"pinned tokens, more than max_pinned_tokens={self.max_pinned_tokens} "
                "(--max-pinned-tokens); unpin a prefix first")
        self.tree.pin(match.node)
        pin = self.pins[key] = Pin(match.node, len(tokens), expires_at, owner)
        return self._answer(pin, owner)

    def unpin(self, keys: list[PinKey], owner: str | None = None) -> dict:
        """Drop the pins of `keys` that exist: `{"unpinned": whether any did, "pins",
        "tokens": how many and what they held, "pinned_tokens": what `owner`'s pins (None:
        all pins) hold now}`."""
        dropped = [pin for pin in (self.pins.pop(k, None) for k in keys) if pin is not None]
        for pin in dropped:
            self.tree.unpin(pin.node)
        return {"unpinned": bool(dropped), "pins": len(dropped),
                "tokens": sum(p.tokens for p in dropped), "pinned_tokens": self.owned(owner)}

    def expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, p in self.pins.items()
                    if p.expires_at is not None and p.expires_at <= now]:
            self.tree.unpin(self.pins.pop(key).node)

    def _answer(self, pin: Pin, owner: str | None) -> dict:
        return {**pin.describe(time.monotonic()), "tier": "memory",
                "pinned_tokens": self.owned(owner)}
