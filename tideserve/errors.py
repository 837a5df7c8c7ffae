"""Errors a user can cause that carry the request field they are about.

Most user errors are plain ``ValueError``s whose message starts with the parameter ("top_p must be
..."), from which the server reads the field to report. Where the wording is fixed by another API (vLLM's
"Got priority 3 but Priority scheduling is not enabled."), the field travels with the exception instead.
"""

from __future__ import annotations


class InvalidParameterError(ValueError):
    """A ``ValueError`` naming the request field it concerns (the server's 400 reports it as ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class EngineSleepingError(RuntimeError):
    """The engine is asleep (sleep mode): it serves no request until it is woken (HTTP 503)."""


class EngineBusyError(RuntimeError):
    """An operation that needs an idle engine (going to sleep) met requests in flight (HTTP 409)."""
