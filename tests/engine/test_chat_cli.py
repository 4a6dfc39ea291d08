"""``LLM.chat`` and ``conveyor chat`` in process, on a tiny GGUF model with a chat template (written by the test)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conveyor.chat_cli import EngineChat
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.chat import render_chat
from conveyor.engine.llm import LLM
from tests.helpers.gguf import write_llama_gguf

pytestmark = pytest.mark.slow  # a real model, engine or server: run by CI, skipped by -m "not slow"

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_chat_gguf(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return write_llama_gguf(tmp_path_factory.mktemp("chat") / "tiny-chat.gguf", transformers.LlamaForCausalLM(cfg))


CONV = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


def test_llm_chat_is_generate_on_the_rendered_template(tiny_chat_gguf):
    llm = LLM(str(tiny_chat_gguf), num_kv_blocks=64)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.chat([CONV, CONV[1:]], params, use_tqdm=False)
    text = llm.tokenizer.apply_chat_template(CONV, add_generation_prompt=True)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    (ref,) = llm.generate({"prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False)}, params,
                          use_tqdm=False)
    assert outs[0].prompt_token_ids == ref.prompt_token_ids and outs[0].outputs[0].token_ids == ref.outputs[0].token_ids
    assert outs[1].prompt_token_ids == render_chat(llm.tokenizer, CONV[1:])
    # no generation prompt, and a template of the caller's
    (plain,) = llm.chat(CONV, params, use_tqdm=False, add_generation_prompt=False,
                        chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    assert plain.prompt_token_ids == llm.tokenizer.encode("be brief hello there ", add_special_tokens=False)
    # the streamed pieces of `conveyor chat` add up to the same reply
    pieces = list(EngineChat(llm.engine).stream(CONV, {"max_tokens": 6, "temperature": 0, "ignore_eos": True}))
    assert len(pieces) == 6 and "".join(pieces) == outs[0].outputs[0].text


def test_conveyor_chat_in_process_keeps_the_conversation(tiny_chat_gguf):
    done = subprocess.run([sys.executable, "-m", "conveyor", "chat", "--model", str(tiny_chat_gguf),
                           "--num-kv-blocks", "64", "--max-tokens", "5", "--system", "be brief"],
                          input="hello there\n\nsecond turn\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # one reply per turn (the blank line is none), the second one given the whole conversation so far
    llm = LLM(str(tiny_chat_gguf), num_kv_blocks=64)
    params = SamplingParams(max_tokens=5, temperature=0)
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    first = llm.chat(conv, params, use_tqdm=False)[0].outputs[0].text
    conv += [{"role": "assistant", "content": first}, {"role": "user", "content": "second turn"}]
    second = llm.chat(conv, params, use_tqdm=False)[0].outputs[0].text
    assert done.stdout == f"{first}\n{second}\n"
