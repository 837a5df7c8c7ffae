"""Structured output: JSON schemas, JSON mode, regexes, choices and grammars enforced token by token.

What a request asks for is ``StructuredOutputsParams`` (tideserve/structured_outputs_params.py, vLLM's
name), a plain parameter type beside ``SamplingParams``; here ``backend`` compiles it with llguidance and
keeps one matcher per request, and ``manager`` computes a step's token masks for the batch.
"""
