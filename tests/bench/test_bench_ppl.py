"""``conveyor bench ppl``: sliding-window perplexity equals the same recipe computed with transformers."""

from __future__ import annotations

import math
import random

import pytest
import torch

from conveyor.bench.ppl import chunks, perplexity, windows
from conveyor.cli import main
from conveyor.engine.llm import LLM

transformers = pytest.importorskip("transformers")


def test_windows_score_every_token_once():
    for n, window, stride in ((100, 40, 16), (100, 40, 40), (41, 40, 16), (5, 40, 16)):
        spans = windows(n, window, stride)
        scored = [t for _, end, first in spans for t in range(first, end)]
        assert scored == list(range(1, n))
        assert all(end - begin <= window and begin <= first for begin, end, first in spans)
    with pytest.raises(ValueError):
        windows(100, 40, 0)


def test_chunks_cut_as_llama_perplexity_does():
    """llama-perplexity -c 40 on 100 tokens: 2 whole chunks (the last 20 tokens unused), scoring 20-39, 60-79."""
    spans = chunks(100, 40)
    assert spans == [(0, 40, 20), (40, 80, 60)]
    assert [t for _, end, first in spans for t in range(first, end)] == [*range(20, 40), *range(60, 80)]
    assert chunks(39, 40) == []


@pytest.mark.slow  # a real (tiny) model and engine
def test_perplexity_matches_transformers(tiny_llama_dir, tmp_path, capsys):
    rng = random.Random(0)
    text = " ".join(f"w{rng.randrange(4, 384)}" for _ in range(150))
    llm = LLM(str(tiny_llama_dir), dtype="float64", num_kv_blocks=64, max_num_batched_tokens=64)
    ids = llm.tokenizer.encode(text)
    result = perplexity(llm, ids, window=40, stride=16)

    ref = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float64).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for begin, end, first in windows(len(ids), 40, 16):
            logprobs = torch.log_softmax(ref(torch.tensor([ids[begin:end]])).logits[0], dim=-1)
            for t in range(first, end):
                nll -= logprobs[t - begin - 1, ids[t]].item()
                count += 1
    assert result.num_tokens == count == len(ids) - 1
    assert result.perplexity == pytest.approx(math.exp(nll / count), rel=1e-9)

    (tmp_path / "t.txt").write_text(text)
    assert main(["bench", "ppl", "--text", str(tmp_path / "t.txt"), "--model", str(tiny_llama_dir),
                 "--dtype", "float32", "--window", "40", "--stride", "16", "--num-kv-blocks", "64"]) == 0
    printed = capsys.readouterr().out
    printed_ppl = float(printed.split("perplexity ")[1].split()[0])
    assert printed_ppl == pytest.approx(result.perplexity, rel=1e-4)  # float32 here, float64 above
    assert f"{count} tokens scored in {result.num_windows} windows of 40 (stride 16)" in printed

    assert main(["bench", "ppl", "--text", str(tmp_path / "t.txt"), "--model", str(tiny_llama_dir),
                 "--dtype", "float32", "--window", "40", "--chunks", "--num-kv-blocks", "64"]) == 0
    printed = capsys.readouterr().out
    whole = len(ids) // 40
    assert f"{whole * 20} tokens scored in {whole} windows of 40 (as llama-perplexity scores them)" in printed
