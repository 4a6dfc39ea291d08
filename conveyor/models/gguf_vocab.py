"""The tokenizer a GGUF file describes in its metadata (``tokenizer.ggml.*``), rebuilt with ``tokenizers``
(``conveyor.tokenizer.GGUFTokenizer`` wraps it).

A GGUF holds no tokenizer.json: it stores the vocabulary, merges or scores, token types, special ids and the chat
template. Two kinds of vocabulary cover the Llama family:

- ``gpt2``: byte-level BPE (SmolLM, Llama 3, Qwen2). The merges are stored; the way text is split before merging
  is named by ``tokenizer.ggml.pre`` and follows llama.cpp's ``llama-vocab.cpp`` for the names we know.
- ``llama``: SentencePiece BPE (Llama 2, Mistral, TinyLlama) with byte fallback. Merges are rebuilt from the
  token scores, as Hugging Face's converter does.

Token type 3 (control, e.g. ``<|im_end|>``) becomes a special token, matched whole and dropped by
``skip_special_tokens``; type 4 (user-defined) is matched whole and kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from conveyor.models.gguf_file import GGUFError, GGUFFile

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
# Control tokens that end a turn, by their text, as llama.cpp's llama-vocab.cpp finds them (converters write one
# eos id; a chat model's turns end with these): stop tokens of every family's GGUF (models.gguf_config)
END_OF_TURN_TEXTS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                               "<|end_of_text|>", "<EOT>", "<end_of_utterance>", "<|return|>", "<|call|>"})

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level_pre_tokenizer(pre: str | None):
    """How text is split before byte-level BPE, by llama.cpp's pre-tokenizer name (GPT-2's regex otherwise)."""
    if pre == "smollm":  # llama.cpp: each digit alone, then GPT-2's regex (as SmolLM's own tokenizer.json)
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    split = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
             "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}.get(pre)
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens, best score
    first (Hugging Face's ``generate_merges`` with scores)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        local = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend((score, left, right) for left, right in local)
    merges.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)  # stable: ties keep vocab order
    return [(left, right) for _, left, right in merges]


def build_gguf_tokenizer(f: GGUFFile) -> RustTokenizer:
    """A ``tokenizers.Tokenizer`` for the vocabulary in ``f``'s metadata; GGUFError when it has none we read."""
    kind, tokens = f.get("tokenizer.ggml.model"), f.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise GGUFError(f"{f.path}: the file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens "
                        "missing); conveyor needs one to serve text")
    types = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in f.get("tokenizer.ggml.merges") or []]
        tok = RustTokenizer(models.BPE(vocab, merges, fuse_unk=False))
        tok.pre_tokenizer = _byte_level_pre_tokenizer(f.get("tokenizer.ggml.pre"))
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores = f.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        unk_id = f.get("tokenizer.ggml.unknown_token_id", 0)
        tok = RustTokenizer(models.BPE(vocab, sentencepiece_merges(tokens, scores), unk_token=tokens[unk_id],
                                       fuse_unk=True, byte_fallback=True))
        steps = [normalizers.Replace(" ", "\u2581")]
        if f.get("tokenizer.ggml.add_space_prefix", True):
            steps.insert(0, normalizers.Prepend("\u2581"))
        tok.normalizer = normalizers.Sequence(steps)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    elif kind == "bert":
        tok = _wordpiece(f, tokens, types)
    else:
        raise GGUFError(f"{f.path}: tokenizer type {kind!r} is not supported; supported: gpt2 (byte-level BPE), "
                        "llama (SentencePiece), bert (WordPiece)")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return tok


def _wordpiece(f: GGUFFile, tokens: list[str], types: list[int]) -> RustTokenizer:
    """BERT's WordPiece from llama.cpp's "phantom space" vocabulary: its converter writes a word-initial piece
    ``w`` as ``\u2581w`` and a continuation ``##w`` as ``w`` (control tokens as they are), so this undoes that.
    Text is split and normalised as llama.cpp's WPM tokenizer and BERT's own do (lower case and accents stripped
    when the file says so), and [CLS] text [SEP] (a pair: [CLS] a [SEP] b [SEP], b as segment 1) added."""
    from tokenizers import processors

    vocab = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        piece = t if ty == CONTROL else (t[1:] if t.startswith("\u2581") else "##" + t)
        vocab.setdefault(piece, i)
    unk = f.get("tokenizer.ggml.unknown_token_id")
    tok = RustTokenizer(models.WordPiece(vocab, unk_token=tokens[unk] if unk is not None else "[UNK]",
                                         max_input_chars_per_word=100))
    lower = bool(f.get("tokenizer.ggml.normalizer.lowercase", True))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, lowercase=lower,
        strip_accents=bool(f.get("tokenizer.ggml.normalizer.strip_accents", lower)))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    cls_id = f.get("tokenizer.ggml.cls_token_id", f.get("tokenizer.ggml.bos_token_id"))
    sep_id = f.get("tokenizer.ggml.seperator_token_id", f.get("tokenizer.ggml.eos_token_id"))
    if cls_id is None or sep_id is None:
        raise GGUFError(f"{f.path}: a WordPiece vocabulary without [CLS] / [SEP] ids (tokenizer.ggml.cls_token_id, "
                        "seperator_token_id)")
    cls, sep = (tokens[cls_id], cls_id), (tokens[sep_id], sep_id)
    tok.post_processor = processors.TemplateProcessing(single=f"{cls[0]} $A {sep[0]}",
                                                       pair=f"{cls[0]} $A {sep[0]} $B:1 {sep[0]}:1",
                                                       special_tokens=[cls, sep])
    return tok


@dataclass
class GGUFVocab:
    """Everything a tokenizer needs from a GGUF file's metadata."""

    tokenizer: RustTokenizer
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    bos_token: str
    eos_token: str
    add_bos: bool
    special_ids: list[int]
    chat_template: str | None
    # the tokenizer adds its own special tokens (WordPiece's [CLS] .. [SEP]); else only BOS, by add_bos
    post_processed: bool = False


def read_gguf_vocab(path: str) -> GGUFVocab:
    """The tokenizer, special tokens and chat template of the GGUF file at ``path``."""
    with GGUFFile(path) as f:
        tok = build_gguf_tokenizer(f)
        tokens, types = f.get("tokenizer.ggml.tokens"), f.get("tokenizer.ggml.token_type") or []

        def special(key: str) -> int | None:
            i = f.get(f"tokenizer.ggml.{key}_token_id")
            return int(i) if i is not None and 0 <= i < len(tokens) else None

        bos, eos = special("bos"), special("eos")
        return GGUFVocab(
            tokenizer=tok, vocab_size=len(tokens), bos_token_id=bos, eos_token_id=eos,
            bos_token=tokens[bos] if bos is not None else "", eos_token=tokens[eos] if eos is not None else "",
            add_bos=bool(f.get("tokenizer.ggml.add_bos_token", f.get("tokenizer.ggml.model") == "llama")),
            special_ids=sorted({i for i, ty in enumerate(types) if ty == CONTROL} | {i for i in (bos, eos) if i is not None}),
            chat_template=f.get("tokenizer.chat_template"), post_processed=f.get("tokenizer.ggml.model") == "bert")
