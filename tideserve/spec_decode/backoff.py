"""The back-off of a request whose proposals keep failing: plain Python over the request's counters, so the
scheduler (which applies it after each verification round) stays free of torch."""

from __future__ import annotations

from tideserve.request import Request

MAX_BACKOFF = 16  # decode steps without proposals after repeated rounds that accepted nothing


def observe_round(request: Request, num_proposed: int, num_accepted: int) -> None:
    """The back-off: a round that accepted nothing skips the next ``spec_backoff`` steps' proposals and
    doubles it; a round that accepted any resets it."""
    if num_accepted == 0:
        request.spec_skip_steps = request.spec_backoff
        request.spec_backoff = min(2 * request.spec_backoff, MAX_BACKOFF)
    else:
        request.spec_backoff = 1
