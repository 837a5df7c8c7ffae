"""``POST /v1/embeddings``: OpenAI's embeddings API over the served model.

Each input is one engine request that is prefilled and pooled, never decoded (tideserve/pooling_params.py),
so embedding requests batch with completions under the same scheduler and KV pool. Inputs come as
OpenAI's four forms; the vectors go back as float lists or as base64 float32 bytes, which the openai SDK
asks for unless told otherwise.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tideserve.pooling_params import PoolingParams
from tideserve.serve.openai.errors import OpenAIError, bad_request
from tideserve.serve.openai.fields import EMBEDDING_FIELDS, refuse_unsupported
from tideserve.serve.openai.protocol import EmbeddingRequest
from tideserve.serve.openai.serving import (
    RequestInfo,
    ServerState,
    final_outputs,
    resolve_request_id,
    submit,
    truncate_prompt,
)
from tideserve.serve.openai.serving_chat import encode_messages

logger = logging.getLogger(__name__)
MAX_INPUTS = 2048  # OpenAI's limit on one request's array of inputs


def _split_inputs(value: str | list) -> list[str | list[int]]:
    """OpenAI's forms: a text, a list of texts, a list of token ids, or a list of token-id lists."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request("input must not be empty: give a text, a list of texts, token ids or a list of "
                          "token-id lists.", "input")
    if all(isinstance(x, int) for x in value):
        return [value]
    if len(value) > MAX_INPUTS:
        raise bad_request(f"input has {len(value)} entries; at most {MAX_INPUTS} are accepted in one request.",
                          "input")
    return list(value)


def _tokenize(state: ServerState, req: EmbeddingRequest) -> list[list[int]]:
    """Every input's token ids, checked against the context before any request is added."""
    if (req.input is None) == (req.messages is None):
        raise bad_request("Give exactly one of input and messages.", "input")
    if req.messages is not None:  # one conversation, rendered as the chat endpoint renders it
        explicit = req.add_special_tokens if "add_special_tokens" in req.model_fields_set else None
        return [truncate_prompt(state, req, encode_messages(state, req, explicit))]
    inputs = _split_inputs(req.input)
    single = inputs[0] is req.input  # a text or one list of token ids: no index in the messages
    token_lists = []
    for i, item in enumerate(inputs):
        where = "" if single else f"input[{i}]: "
        try:
            _, token_ids = state.engine.tokenize_prompt(item, req.add_special_tokens)
        except ValueError as exc:
            raise bad_request(where + str(exc).replace("prompt", "input", 1), "input") from exc
        token_lists.append(truncate_prompt(state, req, token_ids))
    return token_lists


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def create_embedding(state: ServerState, req: EmbeddingRequest, raw: Request, info: RequestInfo) -> Response:
    state.check_model(req.model)
    if req.ignored_fields():
        state.log_ignored(req.ignored_fields())
    refuse_unsupported(req, EMBEDDING_FIELDS)
    try:
        pooling = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
    except ValueError as exc:
        raise bad_request(str(exc), "dimensions") from exc
    request_id = resolve_request_id(raw, info, req)
    token_lists = await asyncio.to_thread(_tokenize, state, req)  # long inputs must not stall the event loop
    info.prompt_tokens = sum(len(t) for t in token_lists)
    names = {"prompt": "messages" if req.messages is not None else "input"}
    streams = await submit(state, [(None, ids) for ids in token_lists], pooling, request_id, req, names)

    finals = await final_outputs(state, raw, streams)
    if any(out.embedding is None for out in finals):  # finished, but aborted
        raise OpenAIError(503, "The request was aborted by the server before it finished.")
    data = [{"object": "embedding", "index": i, "embedding": _encode(out.embedding, req.encoding_format)}
            for i, out in enumerate(finals)]
    info.output_tokens = 0
    return JSONResponse({
        "id": f"embd-{request_id}", "object": "list", "created": int(time.time()), "model": state.model_name,
        "data": data, "usage": {"prompt_tokens": info.prompt_tokens, "total_tokens": info.prompt_tokens},
    })
