"""The draft-model method's proposals, made on the worker right after the target's step.

The draft's KV sits in the same pool as the target's, in the layer slots after the target's, under the same
block tables (spec_decode/draft.py). After the target has sampled and verified a step:

1. One draft pass over the rows the step keeps: every scheduled row of a request still prefilling, and for a
   request that got tokens, its rows up to the last accepted one plus its new token (the rows of rejected
   proposals are left out: their positions now belong to the new token and what follows it). This writes
   the draft's KV wherever the target's was written for tokens the request keeps, so draft KV below
   ``num_computed_tokens`` is always the draft's KV of the request's own tokens, as the target's is; and the
   new token's row gives the first proposal. A decode's rows run as single-token rows, as the target runs a
   verification (each row's key is stored before any row attends): the decode kernels, not a prefill's.
2. For each request with lookahead (``SchedulerOutput.num_lookahead_tokens``), single-token draft steps, each
   fed the previous proposal at the next position, until it has that many proposals. These write draft KV
   up to lookahead - 1 positions past its new token: slots the scheduler allocated for this step only and
   takes back after it (``Scheduler.update_from_output``). The next step's pass 1 writes those positions again
   for whatever tokens the request keeps there, so no KV past ``num_computed_tokens`` is trusted across steps.

The draft proposes its argmax: a point mass, so the target's "keep while equal" verification
(spec_decode/verify.py) is exact rejection sampling for sampled requests too, and greedy output is the
target's own whatever the draft proposes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tideserve.core.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from tideserve.worker.model_runner import ModelRunner, SampledToken


def propose_with_draft(runner: ModelRunner, out: SchedulerOutput,
                       sampled: dict[str, list[SampledToken]]) -> dict[str, list[int]]:
    """The draft's proposals after this step's tokens, per request with lookahead (see the module docstring);
    the runner's states have this step's tokens appended and computed counts advanced already."""
    lookahead = out.num_lookahead_tokens
    pieces: list[tuple[str, int, int]] = []
    drafting: list[str] = []
    for rid, count in out.num_scheduled_tokens.items():
        state = runner.requests[rid]
        start = state.num_computed_tokens - count
        end = start + count
        if rid in sampled:  # its kept rows, and its new token when it drafts from it
            end = len(state.token_ids)
            if lookahead.get(rid, 0) > 0:
                drafting.append(rid)
            else:
                end -= 1
        if rid in out.spec_token_ids or count == 1:  # a decode: one row per token, as the target ran them
            pieces.extend((rid, pos, 1) for pos in range(start, end))
        elif end > start:
            pieces.append((rid, start, end - start))
    pieces.sort(key=lambda piece: piece[2] > 1)  # single-token rows first, as the attention layout wants
    num_decodes = sum(1 for piece in pieces if piece[2] == 1)
    hidden = _catch_up(runner, pieces, num_decodes)
    if not drafting:
        return {}
    last_row, offset = {}, 0
    for rid, _, count in pieces:
        offset += count
        last_row[rid] = offset - 1
    rows = torch.tensor([last_row[rid] for rid in drafting], dtype=torch.long, device=runner.device)
    drafts = {rid: [token] for rid, token in zip(drafting, _argmax(runner, hidden[rows]))}
    appended: list[str] = []
    try:
        for step in range(1, max(lookahead[rid] for rid in drafting)):
            active = [rid for rid in drafting if lookahead[rid] > step]
            for rid in active:
                runner.requests[rid].token_ids.append(drafts[rid][-1])
                appended.append(rid)
            rows_in = [(rid, len(runner.requests[rid].token_ids) - 1, 1) for rid in active]
            hidden = runner._forward(rows_in, len(rows_in), draft=True)
            for rid, token in zip(active, _argmax(runner, hidden)):
                drafts[rid].append(token)
    finally:
        for rid in appended:
            runner.requests[rid].token_ids.pop()
    return drafts


def _catch_up(runner: ModelRunner, pieces: list[tuple[str, int, int]], num_decodes: int) -> torch.Tensor:
    """The draft's pass over ``pieces``, cut into slabs where the platform bounds a pass's tokens."""
    slab = runner.platform.forward_slab_tokens
    total = sum(count for _, _, count in pieces)
    if num_decodes == len(pieces) or slab is None or total <= slab:
        return runner._forward(pieces, num_decodes, draft=True)
    decodes = {rid for rid, _, count in pieces if count == 1}
    return torch.cat([runner._forward(part, sum(1 for rid, _, _ in part if rid in decodes), draft=True)
                      for part in runner._slabs(pieces, slab)])


def _argmax(runner: ModelRunner, hidden: torch.Tensor) -> list[int]:
    return runner.draft_model.compute_logits(hidden).argmax(dim=-1).tolist()
