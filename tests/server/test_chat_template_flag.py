"""`kvfit serve --chat-template`: a file or an inline Jinja string, as vLLM takes it, used in
place of the tokenizer's own template for chat requests and `/tokenize`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvfit.server import serve

from .conftest import ServerThread

TEMPLATE = "{% for m in messages %}<<{{ m.role }}|{{ m.content }}>>{% endfor %}"


def parse(*flags: str) -> argparse.Namespace:
    root = argparse.ArgumentParser(prog="kvfit")
    serve.add_serve_parser(root.add_subparsers(dest="command", required=True))
    return root.parse_args(["serve", "m", *flags])


def test_chat_template_from_a_file_or_inline(tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert serve.load_chat_template(parse("--chat-template", str(path)).chat_template) == TEMPLATE
    assert serve.load_chat_template(parse("--chat-template", TEMPLATE).chat_template) == TEMPLATE
    assert serve.load_chat_template(parse().chat_template) is None


def test_a_missing_template_file_names_the_flag(tmp_path: Path) -> None:
    # A path with no Jinja in it is a file the user meant, not a template that renders itself.
    with pytest.raises(ValueError, match="--chat-template.*no such file"):
        serve.load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="--chat-template.*is a folder"):
        serve.load_chat_template(str(tmp_path))


def test_the_served_chat_template_replaces_the_tokenizers(
    start_server: Callable[..., ServerThread],
) -> None:
    server = start_server(chat_template=TEMPLATE)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        tokens = http.post("/tokenize", json=body).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text == "<<user|hi>>"
