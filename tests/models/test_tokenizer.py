"""Tokenizers: the embedded byte tokenizer and a HF directory built in the test (no download)."""

from __future__ import annotations

import pytest

from conveyor.models.sources import EMBEDDED_NAME
from conveyor.tokenizer import load_tokenizer


def test_byte_tokenizer_roundtrip_and_specials():
    tok = load_tokenizer(EMBEDDED_NAME)
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 1 and tok.eos_token_id == 2 and tok.vocab_size == 32000
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode([1, 2], skip_special_tokens=False) == "<s></s>"


def test_byte_tokenizer_decodes_every_id():
    tok = load_tokenizer(EMBEDDED_NAME)
    words = [tok.decode([i]) for i in range(32000)]
    assert all(isinstance(w, str) for w in words)
    assert words[300].startswith(" ") and words[300].strip().isalpha()
    assert tok.decode([300, 301]) == words[300] + words[301]  # deterministic, context-free


def test_hf_tokenizer_dir(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rust = Tokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rust.train_from_iterator(["hello world, the quick brown fox"] * 20, trainer)
    rust.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}" \
                         "{% if add_generation_prompt %}[assistant] {% endif %}"
    fast.save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    ids = tok.encode("hello world")
    assert ids[0] == 1 == tok.bos_token_id and tok.eos_token_id == 2
    assert tok.decode(ids) == "hello world"
    assert tok.decode(ids + [10**6]) == "hello world"  # ids beyond the vocab never raise
    assert 2 in tok.all_special_ids
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "[user] hi\n[assistant] "


def test_missing_dir():
    with pytest.raises(FileNotFoundError):
        load_tokenizer("/nonexistent/model")


def test_continue_final_message_leaves_the_last_message_open():
    """vLLM's (transformers') rule: render, then cut right after the final message's content."""
    from conveyor.engine.chat import FinalMessageError, chat_prompt

    tok = load_tokenizer(EMBEDDED_NAME)  # ByteTokenizer, DEFAULT_CHAT_TEMPLATE: <|role|>\ncontent</s>\n per message
    conv = [{"role": "user", "content": "Once upon"}, {"role": "assistant", "content": "Once upon"}]
    closed = chat_prompt(tok, conv, add_generation_prompt=False)
    assert closed == "<s><|user|>\nOnce upon</s>\n<|assistant|>\nOnce upon</s>\n"
    # the last occurrence is the final message's, although the user's text is the same
    assert chat_prompt(tok, conv, False, continue_final_message=True) == closed[:-len("</s>\n")]
    spaced = [{"role": "assistant", "content": "  Once upon "}]
    assert chat_prompt(tok, spaced, False, continue_final_message=True).endswith("\n  Once upon ")  # kept
    trims = "{% for m in messages %}[{{ m['content'] | trim }}]{% endfor %}"
    assert chat_prompt(tok, spaced, False, trims, continue_final_message=True) == "[Once upon"  # trimmed: followed
    rewrites = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    for template, content in ((rewrites, "Once upon"), (None, ""), (None, "  \n"), (None, None)):
        with pytest.raises(FinalMessageError):
            chat_prompt(tok, [{"role": "assistant", "content": content}], False, template, continue_final_message=True)
    with pytest.raises(ValueError, match="cannot both be true"):
        chat_prompt(tok, conv, True, continue_final_message=True)
