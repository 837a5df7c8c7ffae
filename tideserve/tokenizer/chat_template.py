"""Chat templates given by the user: loading one (``--chat-template``: a file path or a literal Jinja
string, as vLLM accepts), checking its syntax, and finding which variables it reads.

Templates render in transformers' sandboxed Jinja environment (``Tokenizer.apply_chat_template``); this
module only prepares and inspects them, so a bad template fails at start-up (a server flag) or as a 400
naming the problem (a request's ``chat_template``), never while a request runs.
"""

from __future__ import annotations

import functools
import os

# Arguments of transformers' apply_chat_template (and what they render from): a request's
# chat_template_kwargs may not set them, they are not template variables.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})


class ChatTemplateError(ValueError):
    """A template that cannot be used; ``param`` is the request field to blame."""

    def __init__(self, message: str, param: str = "chat_template") -> None:
        super().__init__(message)
        self.param = param


def load_chat_template(value: str | None) -> str | None:
    """The template text of ``--chat-template``: the contents of a file, or the value itself when it is
    a Jinja string. A value that looks like a path but names no file is an error (vLLM's rule: a literal
    template contains braces or a newline)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            template = f.read()
    elif any(c in value for c in "{}\n"):
        template = value
    else:
        raise ChatTemplateError(
            f"chat_template {value!r} looks like a file path, but no such file exists; pass the path of a "
            "Jinja template file or the template itself.")
    check_syntax(template)
    return template


def check_syntax(template: str) -> None:
    """Raise ``ChatTemplateError`` naming the line of a Jinja syntax error."""
    _compiled(template)


def reads_variable(template: str, name: str) -> bool:
    """Whether the template reads ``name`` (a request field passed as a template variable is honoured
    only by templates that read it)."""
    import jinja2.meta

    env = _compiled(template).environment
    return name in jinja2.meta.find_undeclared_variables(env.parse(template))


def check_template_kwargs(kwargs: object) -> dict:
    """A request's chat_template_kwargs: a JSON object of template variables, none of them reserved."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ChatTemplateError(f"chat_template_kwargs must be an object, got {type(kwargs).__name__}.",
                                "chat_template_kwargs")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ChatTemplateError(
            f"chat_template_kwargs may not set {', '.join(repr(k) for k in reserved)}: "
            "those are request fields or rendering options, not template variables.", "chat_template_kwargs")
    return dict(kwargs)


@functools.lru_cache(maxsize=32)
def _compiled(template: str):
    """transformers' own compilation (its sandbox, extensions and filters), cached like transformers."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        return _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat_template has a Jinja syntax error at line {exc.lineno}: "
                                f"{exc.message}.") from exc
