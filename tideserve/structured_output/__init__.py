"""Structured output: JSON schemas, JSON mode, regexes, choices and grammars enforced token by token.

``params`` is what a request asks for (vLLM's ``StructuredOutputsParams``), ``backend`` compiles it with
llguidance and keeps one matcher per request, ``manager`` computes a step's token masks for the batch.
"""

from tideserve.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
