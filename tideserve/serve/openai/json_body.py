"""Reading a request body as JSON without letting hostile input crash the handler.

``json.loads`` recurses once per nesting level: 100k nested arrays raise RecursionError (a 500 before
this module), and a structure that nests just below the interpreter's limit would recurse again in
validation, templates and logging. So bodies that nest deeper than ``MAX_JSON_DEPTH`` are refused with
a 400, as are NaN/Infinity (not JSON, and poison for sampling parameters) and numbers out of range.
"""

from __future__ import annotations

import json
import math
from typing import Any

# serde_json's default recursion limit. A real OpenAI request nests about 6 levels (body, messages, a
# message, its content parts, an image_url); a tool's JSON schema may add a few dozen.
MAX_JSON_DEPTH = 128


class JSONBodyError(ValueError):
    """The body is not JSON the server accepts; the message says why."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONBodyError(f"The request body is not valid JSON: the number {text[:40]} is out of range.")
    return value


def _no_constants(name: str) -> Any:
    raise JSONBodyError(f"The request body is not valid JSON: {name} is not a JSON value.")


def load_json(body: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The parsed body; ``JSONBodyError`` when it is not JSON, nests deeper than ``max_depth`` or holds a
    number that is not finite."""
    too_deep = JSONBodyError(f"The request body nests deeper than {max_depth} levels of arrays and objects.")
    try:
        data = json.loads(body, parse_float=_finite, parse_constant=_no_constants)
    except JSONBodyError:
        raise
    except RecursionError:
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise JSONBodyError(f"The request body is not valid JSON: {exc}.") from None
    if nesting_exceeds(data, max_depth):
        raise too_deep
    return data


def nesting_exceeds(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest deeper than ``limit`` (the top level counts 1); iterative, so any
    depth is safe to check."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False
