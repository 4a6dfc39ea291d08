"""Logits of our model files, driven through ModelRunner, match transformers on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

from conveyor.bench.step_builder import StepBuilder
from conveyor.models import EMBEDDED_NAME, load_model
from tests.helpers.runner import LogitsRecordingRunner

pytestmark = pytest.mark.slow  # a real model, engine or server: run by CI, skipped by -m "not slow"

transformers = pytest.importorskip("transformers")

VOCAB = 96


def llama_config(**overrides):
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2)
    cfg.update(overrides)
    return transformers.LlamaConfig(**cfg)


def save_checkpoint(tmp_path, config, cls, seed=0):
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # random norm weights / biases too, so wrong wiring of them cannot hide
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    return model


def drive_and_compare(hf_model, model_dir, block_size, backend="cpu", dtype="float32", atol=1e-4, rtol=None,
                      reference=None):
    """Three requests: chunked prefill, whole prefill and decodes in mixed batches; compare every step against
    ``hf_model``. Returns the largest absolute difference seen. With ``reference`` (another HF model), compare
    ``hf_model``'s own logits against it at the same positions instead of ours (to measure an HF baseline)."""
    model, info = load_model(str(model_dir), dtype=dtype)
    runner = LogitsRecordingRunner(model, info, num_blocks=64, block_size=block_size, attention_backend=backend)
    gen = torch.Generator().manual_seed(1)
    prompts = {"a": torch.randint(3, VOCAB, (11,), generator=gen).tolist(),
               "b": torch.randint(3, VOCAB, (5,), generator=gen).tolist(),
               "c": torch.randint(3, VOCAB, (1,), generator=gen).tolist()}
    sched = StepBuilder(block_size, 64, shuffle_seed=0)
    for rid, p in prompts.items():
        sched.add(rid, p)
    seen = {rid: [] for rid in prompts}  # (position, logits) of every sampling step

    def run(chunks):
        out = sched.run(runner, chunks)
        for rid in out.sampled_token_ids:
            seen[rid].append((len(sched.tokens[rid]) - 2, runner.last_logits[rid]))

    run({"a": 6, "b": None})  # a: first chunk (no sample), b: whole prompt
    run({"a": None, "b": 1, "c": None})  # a: last chunk with context, b: decode, c: one-token prompt
    for _ in range(4):
        run({"a": 1, "b": 1, "c": 1})
    worst = 0.0
    with torch.no_grad():
        for rid, steps in seen.items():
            tokens = torch.tensor([sched.tokens[rid]])
            ref = hf_model(tokens).logits[0].float()
            mine = None if reference is None else reference(tokens).logits[0].float()
            for pos, logits in steps:
                got = logits if mine is None else mine[pos]
                torch.testing.assert_close(got, ref[pos], atol=atol, rtol=atol if rtol is None else rtol)
                worst = max(worst, (got - ref[pos]).abs().max().item())
            assert len(steps) >= 4
    return worst


@pytest.mark.parametrize("block_size", [4, 16])
def test_llama_tied(tmp_path, block_size):
    hf = save_checkpoint(tmp_path, llama_config(), transformers.LlamaForCausalLM)
    drive_and_compare(hf, tmp_path, block_size)


def test_llama3_rope_scaling_untied(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    config = llama_config(tie_word_embeddings=False, rope_parameters=rope, rope_scaling=rope)
    hf = save_checkpoint(tmp_path, config, transformers.LlamaForCausalLM)
    drive_and_compare(hf, tmp_path, block_size=4)


def test_llama_reference_backend(tmp_path):
    hf = save_checkpoint(tmp_path, llama_config(), transformers.LlamaForCausalLM)
    drive_and_compare(hf, tmp_path, block_size=4, backend="reference")


def test_llama_bfloat16_close(tmp_path):
    hf = save_checkpoint(tmp_path, llama_config(), transformers.LlamaForCausalLM)
    drive_and_compare(hf, tmp_path, block_size=4, dtype="bfloat16", atol=0.1)


# head_dim 64: one of the native CPU attention kernel's compiled head sizes (head_dim 16 above takes its generic path)
HEAD_DIM_64 = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=192)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_llama_head_dim_64_float32(tmp_path, block_size):
    hf = save_checkpoint(tmp_path, llama_config(**HEAD_DIM_64), transformers.LlamaForCausalLM)
    drive_and_compare(hf, tmp_path, block_size)


@pytest.mark.parametrize("config", [HEAD_DIM_64, {}], ids=["head_dim64", "head_dim16"])
def test_llama_bfloat16_matches_transformers_bfloat16(tmp_path, config):
    """In bfloat16 our logits sit within bf16 resolution of transformers' own bfloat16 logits, and no further
    from the float32 truth than transformers' bfloat16 is (up to a factor of 2)."""
    hf = save_checkpoint(tmp_path, llama_config(**config), transformers.LlamaForCausalLM)
    hf16 = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ours_vs_16 = drive_and_compare(hf16, tmp_path, block_size=4, dtype="bfloat16", atol=1e-2, rtol=1.6e-2)
    hf16_vs_32 = drive_and_compare(hf16, tmp_path, block_size=4, dtype="bfloat16", reference=hf, atol=0.1)
    ours_vs_32 = drive_and_compare(hf, tmp_path, block_size=4, dtype="bfloat16", atol=0.1)
    assert ours_vs_16 <= 1e-2
    assert ours_vs_32 <= 2 * hf16_vs_32, (ours_vs_32, hf16_vs_32)


def test_qwen2_qkv_bias(tmp_path):
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
                                      tie_word_embeddings=False, rope_theta=1000.0)
    hf = save_checkpoint(tmp_path, config, transformers.Qwen2ForCausalLM)
    drive_and_compare(hf, tmp_path, block_size=4)


def test_gpt2(tmp_path):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    hf = save_checkpoint(tmp_path, config, transformers.GPT2LMHeadModel)
    drive_and_compare(hf, tmp_path, block_size=4)


def test_sharded_checkpoint_and_info(tmp_path):
    hf = save_checkpoint(tmp_path, llama_config(), transformers.LlamaForCausalLM)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    model, info = load_model(str(tmp_path / "sharded"))
    assert (info.architecture, info.num_layers, info.num_kv_heads, info.head_dim) == ("LlamaForCausalLM", 2, 2, 16)
    assert info.eos_token_ids == [2] and info.bos_token_id == 1 and info.vocab_size == VOCAB
    drive_and_compare(hf, tmp_path / "sharded", block_size=4)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text('{"architectures": ["MambaForCausalLM"], "model_type": "mamba"}')
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(str(tmp_path))


def test_embedded_model_is_deterministic():
    m1, info = load_model(EMBEDDED_NAME, seed=3)
    m2, _ = load_model(EMBEDDED_NAME, seed=3)
    assert info.name == "conveyor-embedded-llama-40m-random" and 39e6 < info.num_params < 41e6
    assert (info.hidden_size, info.num_layers, info.vocab_size) == (512, 8, 32000)
    torch.testing.assert_close(m1.layers[3].mlp.down_proj.weight, m2.layers[3].mlp.down_proj.weight)


def test_building_a_model_draws_no_random_numbers():
    from conveyor.models.build import build_model
    from conveyor.models.config import ModelConfig
    from conveyor.models.embedded import EMBEDDED_CONFIG

    state = torch.random.get_rng_state()
    model = build_model(ModelConfig(**EMBEDDED_CONFIG), torch.bfloat16, "cpu")
    assert torch.equal(torch.random.get_rng_state(), state)  # no layer ran its random init
    assert {(p.device.type, p.dtype, p.requires_grad) for p in model.parameters()} == {("cpu", torch.bfloat16, False)}
    cos_sin = model.rotary.cos_sin  # a computed buffer is real data, not an empty parameter
    assert cos_sin.dtype == torch.bfloat16 and cos_sin[0, 0].float().eq(1.0).all() and cos_sin[0, 1].eq(0).all()
