"""EngineArgs is the one source of the engine's knobs: its flags, and the configs built from it."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from conveyor.core.config import CacheConfig, SchedulerConfig
from conveyor.engine.args import EngineArgs


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return parser.parse_args(argv)


def test_every_field_has_a_flag_with_the_field_default():
    ns = parse([])
    flagged = {f.name for f in fields(EngineArgs)} - {"detokenize"}  # an API knob, not a command-line one
    assert set(vars(ns)) == flagged
    assert EngineArgs.from_cli_args(ns) == EngineArgs()


def test_flags_parse_to_typed_values():
    args = EngineArgs.from_cli_args(parse([
        "--max-num-seqs", "8", "--max-wait-ms", "2.5", "--max-model-len", "128", "--no-enable-prefix-caching",
        "--debug-invariants", "--policy", "static", "--kv-layout", "slab"]))
    assert (args.max_num_seqs, args.max_wait_ms, args.max_model_len) == (8, 2.5, 128)
    assert not args.enable_prefix_caching and args.debug_invariants
    assert args.scheduler_config(128) == SchedulerConfig(policy="static", max_num_seqs=8, max_wait_ms=2.5,
                                                         max_model_len=128)
    assert args.cache_config() == CacheConfig(enable_prefix_caching=False, kv_layout="slab")
    with pytest.raises(SystemExit):
        parse(["--policy", "fifo"])


def test_scheduler_and_cache_defaults_are_the_configs_own():
    args = EngineArgs()
    assert args.scheduler_config(SchedulerConfig.max_model_len or 1) == SchedulerConfig(max_model_len=1)
    assert args.cache_config() == CacheConfig()
