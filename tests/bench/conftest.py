"""A tiny OpenAI-compatible streaming server (stdlib only) for testing the bench client without an engine.

It streams ``max_tokens`` chunks of one word each, then a usage block whose counts deliberately differ from
what a tokenizer would count (so a test can tell where a count came from). A prompt containing ``FAIL``
gets an OpenAI-shaped 500 error; paths under ``/nousage`` stream no usage block.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

STUB_MODEL = "stub-model"
STUB_PROMPT_TOKENS_EXTRA = 1000  # usage.prompt_tokens = words in the prompt + this


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def _json(self, code: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path.endswith("/v1/models"):
            self._json(200, {"object": "list", "data": [{"id": STUB_MODEL, "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not found", "type": "not_found_error"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        chat = self.path.endswith("/chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if "FAIL" in prompt:
            self._json(500, {"error": {"message": "stub failure", "type": "server_error", "code": 500}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = int(body["max_tokens"])
        for _i in range(n):
            choice = ({"index": 0, "delta": {"content": " word"}} if chat
                      else {"index": 0, "text": " word"})
            self._event({"id": "x", "choices": [choice], "usage": None})
            time.sleep(0.002)
        if not self.path.startswith("/nousage") and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt.split()) + STUB_PROMPT_TOKENS_EXTRA,
                     "completion_tokens": n, "total_tokens": 0}
            self._event({"id": "x", "choices": [], "usage": usage})
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _event(self, obj: dict) -> None:
        self._chunk(f"data: {json.dumps(obj)}\n\n".encode())

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


@pytest.fixture(scope="session")
def stub_server() -> Iterator[str]:
    """Base URL of a running stub server."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def tokenizer_path() -> str:
    from tideserve.model.loader import default_model_path

    try:
        return default_model_path()
    except ValueError as e:
        pytest.skip(str(e))
