"""What one attack got back: refused, served (where the issue allows it) or failed, with the
reason; the soak's phases record these (`Phase.attacks`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Outcome:
    status: str
    """refused, served or failed."""
    reason: str = ""
    detail: str = ""


def refused(detail: str = "") -> Outcome:
    return Outcome("refused", detail=detail)


def served(detail: str = "") -> Outcome:
    return Outcome("served", detail=detail)


def failed(reason: str, detail: str = "") -> Outcome:
    return Outcome("failed", reason, detail[:300])

