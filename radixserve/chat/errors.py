"""The chat layer's one failure: a request it cannot serve as asked."""

from __future__ import annotations


class ChatError(Exception):
    """A chat request refused, in the terms an OpenAI-shaped answer needs: `status` (400 for
    a bad request, 503 when the template pool is full, 500 for a server-side mismatch),
    OpenAI's error `type`, the offending request field (`param`) and an optional `code`.
    The HTTP layer turns it into its error response unchanged."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = code
