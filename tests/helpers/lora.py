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
