"""OpenAI-compatible HTTP API: ``build_app`` makes the FastAPI app, ``run_server`` serves it."""
