"""The error response every layer of the serving face raises (no I/O, nothing of the face imported).

It sits below ``wire`` and ``logprobs`` (both read request fields and refuse bad ones), so neither has to
import the other for it; ``wire`` re-exports both names, the path the routes use. The body is
llama-server's: ``{"error": {"code": <http status>, "message": str, "type": str}}`` (the types are listed
in ``calconsole.server.wire``).
"""

from __future__ import annotations

from typing import Any


class HTTPError(Exception):
    """An error response: ``status`` (HTTP), llama-server ``type``, message, extra body fields."""

    def __init__(self, status: int, type_: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.extra = extra
        self.audited = False  # maintenance routes: already in the audit log (else the route audits it)
        #: a refusal to audit (the action's name), written by the route wrapper off the event loop
        self.audit_action: str | None = None
        self.unauthenticated = False  # refused for a missing or wrong admin key: summarised per peer (refusals)

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.status, "message": self.message, "type": self.type, **self.extra}}


def bad_request(message: str) -> HTTPError:
    """A 400 ``invalid_request_error`` saying ``message`` (a field the request got wrong)."""
    return HTTPError(400, "invalid_request_error", message)
