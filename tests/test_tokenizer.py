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
