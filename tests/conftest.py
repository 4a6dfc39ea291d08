"""Shared fixtures: tiny randomly initialised Hugging Face checkpoints, created here with transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checkpoints import TINY_VOCAB, save_tiny_llama, write_word_tokenizer
from tests.helpers.server import CHAT_TEMPLATE


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory) -> Path:
    """The tiny Llama with a one-line chat template ("role content ... w5"), for the server tests."""
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-chat"))
    write_word_tokenizer(path, TINY_VOCAB, chat_template=CHAT_TEMPLATE)
    return path
