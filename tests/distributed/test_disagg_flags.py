"""``--disaggregate xPyD``: the spec's parsing and the flags it refuses beside it, without Ray."""

import pytest

from conveyor.cli import main as conveyor
from conveyor.distributed import parse_disaggregate


def test_spec_names_prefill_and_decode_replicas():
    assert parse_disaggregate("1P1D") == (1, 1)
    assert parse_disaggregate("2p3d") == (2, 3)
    for bad in ("", "1P", "0P1D", "1P0D", "P1D", "1C", "1P1D@4"):
        with pytest.raises(ValueError, match="xPyD"):
            parse_disaggregate(bad)


@pytest.mark.parametrize("flags,why", [
    (["--disaggregate", "1X1D"], "xPyD"),
    (["--disaggregate", "1P1D", "--data-parallel-size", "2"], "drop --data-parallel-size"),
    (["--disaggregate", "1P1D", "--cpu-ids", "0"], "--cpu-ids"),
])
def test_serve_refuses_before_starting_anything(flags, why, capsys):
    with pytest.raises(SystemExit) as exc:
        conveyor(["serve", "--model", "conveyor-embedded-llama-40m-random", *flags])
    assert why in str(exc.value.code) + capsys.readouterr().err
