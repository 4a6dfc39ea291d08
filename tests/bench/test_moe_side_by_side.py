"""benchmarks/moe_side_by_side.py: ``make`` takes an existing checkpoint only when it has the benchmark's shape
(read from the config transformers writes). Its ``profile`` bytes are checked on a tiny GGUF in
tests/models/test_moe.py (where the converted checkpoints are)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "moe_side_by_side.py"
spec = importlib.util.spec_from_file_location("moe_side_by_side", SCRIPT)
msb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(msb)


def test_make_takes_a_checkpoint_of_the_benchmarks_shape_as_transformers_writes_its_config():
    import transformers

    config = transformers.Qwen3MoeConfig(**msb.SHAPE).to_dict()  # transformers 5: num_local_experts, rope_parameters
    msb.check_shape(config)
    with pytest.raises(SystemExit, match=r"num_hidden_layers=24 \(want 16\)"):
        msb.check_shape({**config, "num_hidden_layers": 24})
    with pytest.raises(SystemExit, match=r"moe_intermediate_size=384 \(want 512\)"):
        msb.check_shape({**config, "moe_intermediate_size": 384})
