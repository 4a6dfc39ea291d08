"""Shared fixtures: tiny randomly initialised Hugging Face checkpoints, created here with transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checkpoints import save_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
