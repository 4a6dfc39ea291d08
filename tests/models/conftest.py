"""The tiny checkpoints of every model family and their GGUFs, converted once per session by llama.cpp's converter
(one run of it: its interpreter's imports cost more than the conversions), for ``test_families.py`` and
``test_moe.py``."""

from __future__ import annotations

import pytest

from tests.helpers.families import TINIES, VARIANTS, convert_tinies


@pytest.fixture(scope="session")
def converted_families(tmp_path_factory) -> dict:
    """{name: (transformers model, hf dir, {outtype: gguf path})}: every family's checkpoint with its F32 and Q8_0
    GGUFs, and each of ``VARIANTS`` with its own outtypes."""
    names = [name for name, tiny in TINIES.items() if tiny.converts]  # (the converter's architectures)
    return convert_tinies(tmp_path_factory.mktemp("families"), names, variants=tuple(VARIANTS))
