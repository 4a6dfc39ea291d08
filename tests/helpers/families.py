"""Tiny random checkpoints of every model family, written with transformers, and their GGUF files made by
llama.cpp's own converter (``convert_hf_to_gguf.py``, from the llama-cpp-python sdist ``scripts/setup.sh``
extracts into ``.cache/llama.cpp``).

Every checkpoint gets a tiny SentencePiece tokenizer (``tokenizer.model``, which the converter of every family
here reads) and a word-level ``tokenizer.json`` over the same pieces (so the directory and the GGUF agree on every
token id and special token), its family's chat template and stop tokens. The weights are random with non-trivial
norms and biases, so a norm or bias wired to the wrong place shows in the logits.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

VOCAB = 320
REPO = Path(__file__).resolve().parents[2]
CONVERTER_DIR = REPO / ".cache" / "llama.cpp"

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
                  "m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MISTRAL_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
                    "[/INST]{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}")
PHI3_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@dataclass
class Tiny:
    """One tiny family member: its transformers class and config, tokenizer specials and chat template."""

    name: str
    model_class: str
    config_class: str
    config: dict
    specials: list[str] = field(default_factory=list)  # control tokens after <unk> <s> </s>
    chat_template: str = CHATML
    eos_token: str = "</s>"  # what tokenizer_config.json names (the converter writes its id as eos)
    window: int = 0  # the sliding window the prompts must exceed (0: none)
    # GGUF metadata the converter leaves out and the test adds (llama.cpp's converter drops Mistral's window)
    gguf_extra: dict = field(default_factory=dict)
    converts: bool = True  # llama.cpp's converter knows the architecture


def _common(**over) -> dict:
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2, pad_token_id=None)
    cfg.update(over)
    return cfg


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
TINIES = {
    "llama3": Tiny("llama3", "LlamaForCausalLM", "LlamaConfig", _common(rope_parameters=LLAMA3_ROPE,
                                                                         tie_word_embeddings=True),
                   specials=["<|begin_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|start_header_id|>",
                             "<|end_header_id|>"], chat_template=LLAMA3_TEMPLATE),
    "mistral": Tiny("mistral", "MistralForCausalLM", "MistralConfig", _common(sliding_window=8), window=8,
                    gguf_extra={"llama.attention.sliding_window": 8},
                    specials=["[INST]", "[/INST]"], chat_template=MISTRAL_TEMPLATE),
    # Ministral: windows on some layers only (layer_types); llama.cpp's converter has no MinistralForCausalLM
    "ministral": Tiny("ministral", "MinistralForCausalLM", "MinistralConfig",
                      _common(num_hidden_layers=3, sliding_window=8, head_dim=16,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
                      window=8, converts=False),
    "qwen2": Tiny("qwen2", "Qwen2ForCausalLM", "Qwen2Config", _common(num_key_value_heads=1, rope_theta=1000.0),
                  specials=["<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>"),
    "qwen3": Tiny("qwen3", "Qwen3ForCausalLM", "Qwen3Config", _common(head_dim=32, tie_word_embeddings=True),
                  specials=["<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>"),
    "gemma3": Tiny("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig",
                   # six layers, every 6th global: the pattern llama.cpp assumes for a gemma3 GGUF (its converter
                   # writes no pattern); the attention scale as llama.cpp derives it (head_dim ** -0.5)
                   _common(num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                           layer_types=["sliding_attention"] * 5 + ["full_attention"],
                           rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 100000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                           tie_word_embeddings=True, pad_token_id=0, hidden_activation="gelu_pytorch_tanh"),
                   specials=["<start_of_turn>", "<end_of_turn>"], chat_template=GEMMA_TEMPLATE, window=8),
    "phi3": Tiny("phi3", "Phi3ForCausalLM", "Phi3Config",
                 _common(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.75,
                                          "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                          "long_factor": [1.0 + 0.5 * i for i in range(6)],
                                          "original_max_position_embeddings": 16},
                         original_max_position_embeddings=16, sliding_window=12, pad_token_id=None),
                 specials=["<|user|>", "<|assistant|>", "<|end|>"], chat_template=PHI3_TEMPLATE, window=12),
    # mixtures of experts: 8 experts, 2 a token, so a step of a few tokens reads some and skips others
    "qwen3_moe": Tiny("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                      _common(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
                              norm_topk_prob=True),
                      specials=["<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>"),
    "mixtral": Tiny("mixtral", "MixtralForCausalLM", "MixtralConfig",
                    _common(num_local_experts=8, num_experts_per_tok=2, intermediate_size=96, rope_theta=10000.0),
                    specials=["[INST]", "[/INST]"], chat_template=MISTRAL_TEMPLATE),
    # llama.cpp's olmoe reads q and k norms of the model's width: as many KV heads as heads (OLMoE's own shape)
    "olmoe": Tiny("olmoe", "OlmoeForCausalLM", "OlmoeConfig",
                  _common(num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, intermediate_size=96,
                          pad_token_id=None),
                  specials=["<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>"),
}


def write_tokenizer(path: Path, tiny: Tiny) -> None:
    """tokenizer.model (SentencePiece BPE, byte fallback, the family's control tokens) and a word-level
    tokenizer.json over the same pieces, plus tokenizer_config.json with the chat template."""
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    corpus = ["the quick brown fox jumps over the lazy dog", "hello world how are you today",
              "sliding windows and rotary embeddings in every layer", "a b c d e f g h i j k l m n o p q r s t u v w"] * 8
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=buf, vocab_size=VOCAB, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, control_symbols=tiny.specials, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        hard_vocab_limit=False, minloglevel=2, num_threads=1)
    (path / "tokenizer.model").write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    assert sp.vocab_size() == VOCAB, sp.vocab_size()
    vocab = {sp.id_to_piece(i): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ["<unk>", "<s>", "</s>", *tiny.specials]])
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": tiny.eos_token, "unk_token": "<unk>",
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256, "add_bos_token": True,
              "chat_template": tiny.chat_template}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def save_tiny(path: Path, name: str, seed: int = 0, **overrides):
    """The tiny ``name`` checkpoint in directory ``path`` (its config with ``overrides``); returns the transformers
    model (float32, eval)."""
    import torch
    import transformers

    tiny = TINIES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, tiny.config_class)(**{**tiny.config, **overrides})
    model = getattr(transformers, tiny.model_class)(config).to(torch.float32).eval()
    with torch.no_grad():  # random norm weights and biases, so a wrongly wired one cannot hide
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, tiny)
    return model


def converter_available() -> bool:
    """Whether the converter is in ``.cache/llama.cpp``; fetched there first when it is not (a worktree that never
    ran ``scripts/setup.sh``), by the script setup.sh runs."""
    if not (CONVERTER_DIR / "convert_hf_to_gguf.py").is_file():
        subprocess.run(["bash", str(REPO / "scripts" / "fetch_llama_cpp_converter.sh"), sys.executable],
                       capture_output=True, timeout=600)
    return (CONVERTER_DIR / "convert_hf_to_gguf.py").is_file()


def convert_all(jobs: list[tuple[Path, Path, str]], timeout_s: float = 600) -> None:
    """``convert_hf_to_gguf.py model_dir --outfile outfile --outtype outtype`` for every job, in one subprocess (it
    imports its own gguf-py, which must not meet the installed gguf package here; one interpreter for all jobs
    pays torch's and transformers' import once)."""
    if not converter_available():
        raise FileNotFoundError(f"{CONVERTER_DIR}/convert_hf_to_gguf.py is missing: run scripts/setup.sh")
    script = CONVERTER_DIR / "convert_hf_to_gguf.py"
    runs = [[str(script), str(d), "--outfile", str(o), "--outtype", t] for d, o, t in jobs]
    # The tiny checkpoints' tokenizer is SentencePiece (tokenizer.model). The converters of Qwen3-MoE and OLMoE read
    # only a BPE tokenizer.json they recognise by hash (TextModel.set_vocab), so they are pointed at the converter's
    # own SentencePiece reader, which the Llama, Qwen2 and Gemma converters use for the same files; the families
    # whose converters choose their reader themselves are not affected.
    driver = ("import runpy, sys\n"
              "from conversion.base import TextModel\n"
              "TextModel.set_vocab = TextModel._set_vocab_sentencepiece\n"
              f"for argv in {runs!r}:\n"
              "    sys.argv = argv\n"
              f"    runpy.run_path({str(script)!r}, run_name='__main__')\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(CONVERTER_DIR)}
    proc = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, env=env, timeout=timeout_s,
                          cwd=str(CONVERTER_DIR))
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{proc.stderr[-4000:]}")


def convert(model_dir: Path, outfile: Path, outtype: str = "f32") -> Path:
    convert_all([(model_dir, outfile, outtype)])
    return outfile


def add_gguf_metadata(path: Path, values: dict[str, int]) -> None:
    """Rewrite the GGUF at ``path`` with extra integer metadata keys, by gguf-py's own copier (what its
    ``gguf_new_metadata`` script does)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    tmp = path.with_suffix(".tmp.gguf")
    reader = gguf.GGUFReader(path, "r")
    writer = gguf.GGUFWriter(tmp, arch=reader.get_field(gguf.Keys.General.ARCHITECTURE).contents())
    copy_with_new_metadata(reader, writer, {k: MetadataDetails(gguf.GGUFValueType.UINT32, v)
                                            for k, v in values.items()}, [])
    del reader
    tmp.replace(path)


# Variants of a tiny for other tests, converted in the same run: label -> (tiny, config overrides, outtypes).
# "qwen3_moe_wide": a Qwen3-MoE whose widths are whole K-quant super-blocks (256), for tests/models/test_moe.py.
VARIANTS = {"qwen3_moe_wide": ("qwen3_moe", dict(hidden_size=256, moe_intermediate_size=256, head_dim=64,
                                                 num_experts=4), ("f32",))}


def convert_tinies(root: Path, names: list[str], outtypes: tuple[str, ...] = ("f32", "q8_0"),
                   variants: tuple[str, ...] = ()) -> dict:
    """Every tiny family member written to ``root / name / "hf"`` and converted to ``root / name / "<type>.gguf"``
    for each of ``outtypes`` in one converter run, plus the metadata each family's test adds
    (``Tiny.gguf_extra``), and the ``VARIANTS`` named. Returns {name: (transformers model, hf dir, {outtype: gguf
    path})}."""
    out, jobs = {}, []
    for label in variants:
        name, overrides, types = VARIANTS[label]
        model = save_tiny(root / label / "hf", name, **overrides)
        ggufs = {t: root / label / f"{t}.gguf" for t in types}
        jobs += [(root / label / "hf", path, t) for t, path in ggufs.items()]
        out[label] = (model, root / label / "hf", ggufs)
    for name in names:
        model = save_tiny(root / name / "hf", name)
        ggufs = {t: root / name / f"{t}.gguf" for t in outtypes}
        jobs += [(root / name / "hf", path, t) for t, path in ggufs.items()]
        out[name] = (model, root / name / "hf", ggufs)
    convert_all(jobs)
    for name, (_, _, ggufs) in out.items():
        for path in ggufs.values():
            if name in TINIES and TINIES[name].gguf_extra:
                add_gguf_metadata(path, TINIES[name].gguf_extra)
    return out


def requantize_gguf(src: Path, dst: Path, types: dict[str, str]) -> Path:
    """A copy of the GGUF ``src`` (llama.cpp's converter's F32 output) with the tensors ``types`` names stored in
    the type given (as llama-quantize would store them): the gguf package's own quantizer for the types it
    writes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), random blocks with sane scales for the K-quants it cannot write (Q4_K,
    Q5_K, Q6_K; the weights then differ from the source's: the tests compare against the file's own
    dequantization)."""
    import gguf
    import numpy as np
    from gguf import quants

    reader = gguf.GGUFReader(src, "r")
    writer = gguf.GGUFWriter(str(dst), arch=reader.get_field(gguf.Keys.General.ARCHITECTURE).contents())
    for key in reader.fields.values():
        if key.name == gguf.Keys.General.ARCHITECTURE or key.name.startswith("GGUF."):
            continue
        kind = key.types[0]
        writer.add_key_value(key.name, key.contents(), kind,
                             sub_type=key.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    rng = np.random.default_rng(0)
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        if tensor.name in types:
            qtype = gguf.GGMLQuantizationType[types[tensor.name]]
            shape = data.shape
            if qtype.name == "Q6_K":  # random 6-bit q and int8 sub-scales in [-20, 20], d at the block's end
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                blocks = rng.integers(0, 256, size=(data.size // block, size), dtype=np.uint8)
                blocks[:, 192:208] = rng.integers(-20, 21, (len(blocks), 16), dtype=np.int8).view(np.uint8)
                d = rng.uniform(0.0005, 0.002, (len(blocks), 1)).astype(np.float16)
                blocks[:, 208:210] = d.view(np.uint8).reshape(len(blocks), 2)
                data = blocks.reshape(*shape[:-1], shape[-1] // block * size)
            elif qtype.name in ("Q4_K", "Q5_K"):
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                blocks = rng.integers(0, 256, size=(data.size // block, size), dtype=np.uint8)
                scales = rng.uniform(0.001, 0.01, (len(blocks), 2)).astype(np.float16)  # d, dmin
                blocks[:, 0:4] = scales.view(np.uint8).reshape(len(blocks), 4)
                data = blocks.reshape(*shape[:-1], shape[-1] // block * size)
            else:
                data = quants.quantize(data.astype(np.float32), qtype)
            writer.add_tensor(tensor.name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
