"""benchmarks/gguf_side_by_side.py: llama-bench's JSON read as llama-bench writes it, llama-server's command line,
and the conveyor-only path end to end on the wheel's GGUF (a few requests)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gguf_side_by_side.py"
spec = importlib.util.spec_from_file_location("gguf_side_by_side", SCRIPT)
sbs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sbs)

# literal output of `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -p 16 -n 8 -r 1 -t 2 -o json` (llama.cpp
# 0c1e570, AMD EPYC Zen 5, 2 vCPU): one entry per test, a prompt-only one and a generation-only one
LLAMA_BENCH_JSON = (Path(__file__).parent / "data" / "llama_bench_q4_1_p16_n8.json").read_text()


def test_parse_llama_bench():
    assert sbs.parse_llama_bench(LLAMA_BENCH_JSON) == {"pp16": 357.480908, "tg8": 141.846298}


def test_llama_server_gets_32_slots_of_the_longest_requests_context():
    cmd = sbs.llama_server_cmd("llama-server", "m.gguf", 8080, 2, 768)
    assert cmd[cmd.index("-c") + 1] == str(32 * 768) and cmd[cmd.index("--parallel") + 1] == "32"
    assert cmd[cmd.index("-t") + 1] == cmd[cmd.index("-tb") + 1] == "2" and "-cb" in cmd
    # no prompt cache (the phases resend the same prompts), and pass-through arguments last, so they override
    assert "--no-cache-prompt" in cmd and cmd[cmd.index("--cache-ram") + 1] == "0"
    assert sbs.llama_server_cmd("llama-server", "m.gguf", 8080, 2, 768, ["--cache-prompt"])[-1] == "--cache-prompt"


def test_conveyor_runs_without_prefix_caching_unless_told():
    cmd = sbs.conveyor_cmd("m.gguf", 8080, 2, ["--enable-prefix-caching"])
    assert cmd.index("--no-enable-prefix-caching") < cmd.index("--enable-prefix-caching")


def test_short_requests_are_the_failed_and_the_stopped_early():
    from conveyor.bench.metrics import RequestTiming
    from conveyor.bench.workload import Workload, WorkloadRequest

    workload = Workload("w", [WorkloadRequest(i, max_tokens=4) for i in range(3)])
    timings = [RequestTiming("0", 3, 4, 0.0, 0.1, [0.1] * 4, 0.5),
               RequestTiming("1", 3, 2, 0.0, 0.1, [0.1] * 2, 0.5),  # stopped at EOS: less work
               RequestTiming("2", 3, 0, 0.0, None, [], None, error="HTTP 500")]
    assert sbs.short_requests(workload, timings) == ["1", "2"]


@pytest.mark.slow  # a real server on the real default model
def test_conveyor_only_run_prints_its_row():
    from conveyor.models.sources import DEFAULT_MODEL, packaged_model_path

    gguf = packaged_model_path(DEFAULT_MODEL)
    done = subprocess.run([sys.executable, str(SCRIPT), "--gguf", gguf, "--num-requests", "4", "--output-tokens",
                           "8", "--warmup", "1", "--threads", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| conveyor |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1] == Path(gguf).name
    assert float(cells[2]) > 0 and float(cells[3]) > 0 and float(cells[-1]) > 0
    median, spread = cells[-2].split(" ")  # "median (min-max)" of the three batch-1 requests
    low, high = (float(v) for v in spread.strip("()").split("-"))
    assert 0 < low <= float(median) <= high


def test_batch1_summary_is_the_median_run():
    runs = [dict(tok_s=r, tokens=8, ignore_eos_honoured=True) for r in (210.0, 150.0, 190.0)]
    got = sbs.batch1_summary(runs)
    assert (got["tok_s"], got["tok_s_min"], got["tok_s_max"], got["runs"]) == (190.0, 150.0, 210.0, runs)
    assert sbs.batch1_summary(runs[:2])["tok_s"] == 180.0
    runs[0]["ignore_eos_honoured"] = False
    assert not sbs.batch1_summary(runs)["ignore_eos_honoured"]
