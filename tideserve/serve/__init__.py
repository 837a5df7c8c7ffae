"""Serving: the OpenAI-compatible HTTP server (``openai/``) and its Prometheus metrics (``metrics.py``)."""
