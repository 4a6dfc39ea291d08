"""Many LoRA adapters in one batch: conveyor's greedy tokens and logprobs for each adapter equal peft's merged model in
transformers (float32 logprobs within 2e-3), for 8 adapters and the bare base model in one batch with chunked
prefill, preemption, prefix caching and adapter swapping (fewer slots than adapters); Llama and Qwen2/3 bases, float
and int8-quantized base weights; adapters conveyor refuses, with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conveyor import LLM, LoRARequest, SamplingParams
from conveyor.models.lora_format import AdapterError, LoRABase, read_adapter
from tests.helpers.checkpoints import save_tiny_llama
from tests.helpers.families import save_tiny
from tests.helpers.lora import merged_model, rounded_adapter, save_random_adapter, teacher_forced_logprobs

pytestmark = pytest.mark.slow

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (rank, alpha, targets, rsLoRA) of each adapter: ranks 1..16, subsets of the modules, one rsLoRA
SHAPES = [(8, 16, ALL, False), (4, 8, ("q_proj", "v_proj"), False), (16, 16, ALL, True), (2, 4, ("o_proj", "down_proj"), False),
          (8, 32, ("gate_proj", "up_proj"), False), (1, 2, ALL, False), (12, 24, ("k_proj", "v_proj", "o_proj"), False),
          (16, 8, ALL, False)]
TOL = 2e-3


def _adapters(base: Path, root: Path, count: int) -> list[LoRARequest]:
    loras = []
    for i, (r, alpha, targets, rs) in enumerate(SHAPES[:count]):
        path = save_random_adapter(base, root / f"adapter{i}", seed=100 + i, r=r, alpha=alpha, targets=targets,
                                   use_rslora=rs)
        loras.append(LoRARequest(f"adapter{i}", i + 1, str(path)))
    return loras


def _prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(4, vocab, (32,), generator=g).tolist()  # two full blocks every prompt starts with
    return [shared + torch.randint(4, vocab, (8 + 3 * i,), generator=g).tolist() for i in range(n)]


def _check(outs, prompts, loras, oracle) -> None:
    """Every output's greedy tokens and their logprobs equal the oracle's (teacher-forced on those tokens)."""
    for prompt, lora, out in zip(prompts, loras, outs):
        done = out.outputs[0]
        lps = teacher_forced_logprobs(oracle(lora), prompt + done.token_ids)
        n = len(prompt)
        name = lora.lora_name if lora is not None else "base"
        assert done.token_ids == [int(lps[n - 1 + i].argmax()) for i in range(len(done.token_ids))], name
        mine = torch.tensor([lp.logprob for lp in done.logprobs])
        ref = torch.tensor([float(lps[n - 1 + i, t]) for i, t in enumerate(done.token_ids)])
        assert (mine - ref).abs().max().item() < TOL, (name, mine, ref)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Path, list[LoRARequest]]:
    root = tmp_path_factory.mktemp("lora_llama")
    base = save_tiny_llama(root / "base")
    return base, _adapters(base, root, 8)


def test_eight_adapters_and_the_base_in_one_batch_equal_peft_merged(llama):
    base, loras = llama
    # 3 slots for 8 adapters: swapped in and out; 14 blocks of 16 for 11 requests of ~70 tokens: preemption;
    # a 32-token budget: prompts in chunks beside decodes; the same 32 tokens open every prompt: prefix caching,
    # which must never hand one adapter's KV to another (or to the base model)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, max_num_batched_tokens=32,
              num_kv_blocks=14, max_model_len=128, enable_prefix_caching=True, debug_invariants=True)
    each = [None] + loras + [loras[0], None]  # one adapter and the base twice: their prefixes are cache hits
    prompts = _prompts(len(each), 384)
    prompts[-2], prompts[-1] = prompts[1], prompts[0]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=each, use_tqdm=False)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_manager.prefix_hits > 0
    assert engine.executor.lora.num_loads > len(loras)  # swapped: some adapter entered a slot twice
    oracles = {}
    _check(outs, prompts, each, lambda lora: oracles.setdefault(lora, merged_model(
        base, None if lora is None else Path(lora.lora_path))))
    # the adapters do change the output: no two of the first three agree (a no-op adapter would pass the above)
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:3]}) == 3


def _tokens_and_logprobs(outs) -> list:
    return [(o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adapter_steps_run_in_the_native_layer_stack(llama, dtype):
    """Decode steps with adapter rows run in the one-call native layer stack (the adapter kernel after each of its
    GEMMs), with results bit-identical to the per-layer path's; slots hold the base's dtype (float32, bfloat16)."""
    base, loras = llama
    llm = LLM(str(base), dtype=dtype, enable_lora=True, max_loras=8, enable_prefix_caching=False)
    model, slots = llm.engine.model, llm.engine.executor.lora
    assert slots.model.weight_dtype == getattr(torch, dtype)
    stack = model.native_stack
    if stack is None:
        pytest.skip(f"no native layer stack for {dtype} on this CPU")
    each = [None] + loras
    prompts = _prompts(len(each), 384)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    with_adapters = []
    run = stack.run
    stack.run = lambda *a: with_adapters.append(model.lora.active) or run(*a)
    try:
        fused = llm.generate(prompts, params, lora_request=each, use_tqdm=False)
    finally:
        del stack.run
    assert any(with_adapters)  # the decode steps with adapter rows went through the stack
    model.native_stack = None
    try:
        per_layer = llm.generate(prompts, params, lora_request=each, use_tqdm=False)
    finally:
        model.native_stack = stack
    assert _tokens_and_logprobs(fused) == _tokens_and_logprobs(per_layer)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_bases(tmp_path, family):
    base = tmp_path / "base"
    save_tiny(base, family)
    loras = _adapters(base, tmp_path, 3)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=4, max_num_batched_tokens=32)
    each = [None] + loras
    prompts = _prompts(len(each), 200)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True),
                        lora_request=each, use_tqdm=False)
    _check(outs, prompts, each, lambda lora: merged_model(base, None if lora is None else Path(lora.lora_path)))


def test_int8_base_weights(llama, tmp_path):
    """Quantized base weights: the integer GEMM, then the adapters' float products. The oracle is peft's merge on
    the very weights conveyor computes with (its int8 weights dequantized into the transformers model, the
    adapters rounded to bfloat16 as its slots hold them on a quantized base: models.lora_model.adapter_dtype)."""
    base, loras = llama
    llm = LLM(str(base), dtype="float32", quantization="int8", enable_lora=True, max_loras=2,
              max_num_batched_tokens=32)
    each = [None, loras[0], loras[2]]
    prompts = _prompts(len(each), 384)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True),
                        lora_request=each, use_tqdm=False)
    model = llm.engine.model
    cfg = model.config
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size

    def oracle(lora):
        hf = merged_model(base, None)
        with torch.no_grad():
            for ours, theirs in zip(model.layers, hf.model.layers):
                qkv = ours.self_attn.qkv_proj.base.dequantized(torch.float32)
                gate_up = ours.mlp.gate_up_proj.base.dequantized(torch.float32)
                for name, w in (("q_proj", qkv[:q]), ("k_proj", qkv[q:q + kv]), ("v_proj", qkv[q + kv:]),
                                ("o_proj", ours.self_attn.o_proj.base.dequantized(torch.float32))):
                    getattr(theirs.self_attn, name).weight.copy_(w)
                for name, w in (("gate_proj", gate_up[:inter]), ("up_proj", gate_up[inter:]),
                                ("down_proj", ours.mlp.down_proj.base.dequantized(torch.float32))):
                    getattr(theirs.mlp, name).weight.copy_(w)
        if lora is None:
            return hf
        from peft import PeftModel

        held = rounded_adapter(Path(lora.lora_path), tmp_path / f"held_{lora.lora_name}", torch.bfloat16)
        return PeftModel.from_pretrained(hf, held).merge_and_unload().eval()

    _check(outs, prompts, each, oracle)
    assert llm.engine.executor.lora.model.weight_dtype == torch.bfloat16  # a quantized base's adapters


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def test_refusals_name_the_reason(llama, tmp_path):
    base, loras = llama
    info_base = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8)
    lora_base: LoRABase = info_base.engine.model_info.lora_base
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="rank 16 is above --max-lora-rank 8"):
        info_base.generate([[5, 6, 7]], params, lora_request=loras[2], use_tqdm=False)
    with pytest.raises(ValueError, match="no such directory"):
        info_base.generate([[5, 6, 7]], params, lora_request=LoRARequest("gone", 99, str(tmp_path / "nope")),
                           use_tqdm=False)
    other = save_tiny_llama(tmp_path / "wide", hidden_size=96, intermediate_size=160)
    wide = save_random_adapter(other, tmp_path / "wide_adapter", seed=1, r=4)
    with pytest.raises(AdapterError, match="another base shape"):
        read_adapter(str(wide), lora_base, 16)
    deep = save_random_adapter(save_tiny_llama(tmp_path / "deep", num_hidden_layers=3), tmp_path / "deep_adapter",
                               seed=1, r=4)
    with pytest.raises(AdapterError, match="the base model has 2 layers"):
        read_adapter(str(deep), lora_base, 16)
    missing = save_random_adapter(base, tmp_path / "missing", seed=2, r=4)
    (missing / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="missing adapter_model.safetensors"):
        read_adapter(str(missing), lora_base, 16)
    dora = save_random_adapter(base, tmp_path / "dora", seed=3, r=4, use_dora=True)
    with pytest.raises(AdapterError, match="DoRA"):
        read_adapter(str(dora), lora_base, 16)
    saved = save_random_adapter(base, tmp_path / "saved", seed=4, r=4, targets=("q_proj",))
    _edit_config(saved, modules_to_save=["lm_head"])
    with pytest.raises(AdapterError, match="modules_to_save"):
        read_adapter(str(saved), lora_base, 16)
    embed = save_random_adapter(base, tmp_path / "embed", seed=5, r=4, targets=("q_proj", "embed_tokens"))
    with pytest.raises(AdapterError, match="unsupported target module"):
        read_adapter(str(embed), lora_base, 16)
    (tmp_path / "nojson").mkdir()
    with pytest.raises(AdapterError, match="missing adapter_config.json"):
        read_adapter(str(tmp_path / "nojson"), lora_base, 16)
    bare = LLM(str(base), dtype="float32")
    with pytest.raises(ValueError, match="enable_lora"):
        bare.generate([[5, 6, 7]], params, lora_request=loras[0], use_tqdm=False)
