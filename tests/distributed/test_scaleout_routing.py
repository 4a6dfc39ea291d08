"""The prefix router's decisions as plain unit tests: no Ray, no clock (time is passed in)."""

import random
import subprocess
import sys

from conveyor.core.kv_manager import KVCacheManager
from conveyor.core.request import Request
from conveyor.core.sampling_params import SamplingParams
from conveyor.distributed.affinity import PrefixAffinity, choose_prefix, leading_block_hashes, power_of_two

BS = 4
SYSTEM_A = list(range(100, 116))  # four blocks
SYSTEM_B = list(range(200, 216))


def test_hashes_are_the_kv_caches_own():
    prompt = SYSTEM_A + [7, 8, 9]
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    request = Request("r", prompt, SamplingParams(max_tokens=1))
    assert leading_block_hashes(prompt, BS, max_blocks=64) == kv._update_block_hashes(request, len(prompt))
    assert len(leading_block_hashes(prompt, BS, max_blocks=2)) == 2
    assert leading_block_hashes([1, 2, 3], BS, max_blocks=64) == []  # no full block: nothing to share


def test_match_counts_the_chain_per_replica_and_ages():
    table = PrefixAffinity(ttl_s=10.0)
    table.record(leading_block_hashes(SYSTEM_A, BS, 64), "r0", now=0.0)
    table.record(leading_block_hashes(SYSTEM_A[:8] + [1] * 8, BS, 64), "r1", now=5.0)
    query = leading_block_hashes(SYSTEM_A + [5, 6, 7, 8], BS, 64)
    assert table.matched_blocks(query, ["r0", "r1", "r2"], now=6.0) == {"r0": 4, "r1": 2, "r2": 0}
    assert table.matched_blocks(query, ["r0", "r1"], now=12.0) == {"r0": 0, "r1": 2}  # r0's sighting aged out
    table.forget("r1")
    assert table.matched_blocks(query, ["r0", "r1"], now=6.0) == {"r0": 4, "r1": 0}


def test_table_is_bounded_least_recently_seen_first():
    table = PrefixAffinity(capacity=4)
    table.record(leading_block_hashes(SYSTEM_A, BS, 64), "r0", now=0.0)
    table.record(leading_block_hashes(SYSTEM_B, BS, 64), "r1", now=1.0)
    assert len(table) == 4
    assert table.matched_blocks(leading_block_hashes(SYSTEM_A, BS, 64), ["r0"], now=2.0) == {"r0": 0}
    assert table.matched_blocks(leading_block_hashes(SYSTEM_B, BS, 64), ["r1"], now=2.0) == {"r1": 4}


def test_shared_prefix_goes_to_the_replica_holding_it_while_balanced():
    rng = random.Random(0)
    d = choose_prefix({"r0": 0, "r1": 3}, {"r0": 1, "r1": 3}, imbalance_threshold=4, rng=rng)
    assert d.reason == "prefix" and d.ranks[0] == ["r1"]
    assert d.ranks[1] == ["r0"]  # the fallback rank when r1 cannot take it


def test_spreads_when_one_queue_runs_ahead():
    rng = random.Random(0)
    d = choose_prefix({"r0": 0, "r1": 3}, {"r0": 0, "r1": 9}, imbalance_threshold=4, rng=rng)
    assert d.reason == "imbalanced" and d.ranks == [["r0", "r1"]]  # power of two: the shorter queue first


def test_no_match_is_power_of_two_and_ties_take_the_shorter_queue():
    rng = random.Random(0)
    d = choose_prefix({"r0": 0, "r1": 0}, {"r0": 2, "r1": 1}, imbalance_threshold=4, rng=rng)
    assert d.reason == "no-match" and d.ranks == [["r1", "r0"]]
    d = choose_prefix({"r0": 2, "r1": 2}, {"r0": 2, "r1": 1}, imbalance_threshold=4, rng=rng)
    assert d.reason == "prefix" and d.ranks[0] == ["r1"]


def test_power_of_two_samples_two_of_many():
    rng = random.Random(1)
    lens = {f"r{i}": i for i in range(6)}
    seen = set()
    for _ in range(50):
        pair = power_of_two(list(lens), lens, rng)
        assert len(pair) == 2 and lens[pair[0]] <= lens[pair[1]]
        seen.update(pair)
    assert seen == set(lens)


def test_affinity_and_serve_cli_import_no_ray():
    code = ("import sys, conveyor.distributed.affinity, conveyor.serve, conveyor.cli\n"
            "conveyor.cli.build_parser()\n"
            "assert 'ray' not in sys.modules, 'ray imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_data_parallel_without_ray_names_the_extra():
    # sys.modules["ray"] = None makes every "import ray" fail, as on a machine without the extra.
    code = ("import sys\nsys.modules['ray'] = None\nfrom conveyor.cli import main\n"
            "try:\n    main(['serve', '--data-parallel-size', '2'])\nexcept SystemExit as e:\n    print(e)\n"
            "else:\n    print('no error')\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert "conveyor[ray]" in out and "Ray Serve" in out, out


def test_data_parallel_refuses_one_engines_cpu_placement():
    for flags in (["--cpu-ids", "1"], ["--frontend-cpus", "1"]):
        code = ("from conveyor.cli import main\n"
                f"try:\n    main(['serve', '--data-parallel-size', '2', *{flags!r}])\nexcept SystemExit as e:\n"
                "    print(e)\nelse:\n    print('no error')\n")
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
        assert "Ray places the replicas" in out, out
