"""docs/configuration.md is what the parser accepts, flag for flag."""

from __future__ import annotations

from pathlib import Path

from tideserve.cli import build_parser
from tideserve.cli_reference import render

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_configuration_doc_matches_the_parser():
    assert DOC.read_text() == render(build_parser()), (
        "docs/configuration.md is stale: run `python -m tideserve.cli_reference > docs/configuration.md`")


def test_every_serve_flag_is_in_the_doc():
    text = DOC.read_text()
    for flag in ("--kv-cache-memory", "--tool-call-parser", "--chat-template", "--quantization", "--trust-remote-code",
                 "--ssl-certfile", "--engine-stall-timeout", "--tensor-parallel-size"):
        assert f"`{flag}`" in text, flag
