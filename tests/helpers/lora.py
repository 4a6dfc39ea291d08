"""Random PEFT LoRA adapters of a tiny base checkpoint, written by the tests with ``peft``, and the merged model as
the oracle (transformers + peft's ``merge_and_unload``)."""

from __future__ import annotations

from pathlib import Path


def save_random_adapter(base: Path, out: Path, seed: int, r: int = 8, alpha: int = 16,
                        targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"),
                        use_rslora: bool = False, **extra) -> Path:
    """A LoRA adapter of ``base`` with random A and B (PEFT initialises B to zero: no effect to test)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                        lora_dropout=0.0, **extra)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    peft_model.save_pretrained(out)
    return out


def merged_model(base: Path, adapter: Path | None):
    """The base model with ``adapter`` merged into its weights (the oracle), float32, eval mode."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


def teacher_forced_logprobs(model, token_ids: list[int]):
    """log_softmax of the model's logits at every position of ``token_ids`` ([len, vocab], float32)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def rounded_adapter(adapter: Path, out: Path, dtype) -> Path:
    """A copy of ``adapter`` whose weights are what conveyor's adapter slots of ``dtype`` hold: A rounded, B rounded
    with the scaling folded in (then unfolded: the scalings of the tests' adapters are powers of two, exact)."""
    import json
    import math
    import shutil

    from safetensors.torch import load_file, save_file

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    r = cfg["r"]
    scaling = cfg.get("lora_alpha", r) / (math.sqrt(r) if cfg.get("use_rslora") else r)
    tensors = load_file(adapter / "adapter_model.safetensors")
    for name, t in tensors.items():
        s = scaling if "lora_B" in name else 1.0
        tensors[name] = ((t.float() * s).to(dtype).float() / s).to(t.dtype)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(adapter / "adapter_config.json", out / "adapter_config.json")
    save_file(tensors, out / "adapter_model.safetensors")
    return out
