"""Tokenizers: a Hugging Face directory's (via ``tokenizers``, or transformers as a fallback), a GGUF file's (from
its metadata), or the embedded model's file-free byte tokenizer.

``load_tokenizer(model) -> Tokenizer`` for any ``--model`` value (``models/sources.py``; None: the default model). Every tokenizer offers encode / decode, the special ids,
``vocab_size`` and ``apply_chat_template`` (the jinja2 template of tokenizer_config.json / chat_template.jinja
when present, else a simple built-in one). The rendered chat text already holds its special tokens: encode it
with ``add_special_tokens=False``.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache

import jinja2
import jinja2.sandbox

# Used when a checkpoint ships no template (and for the embedded model).
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class Tokenizer:
    """Common surface; subclasses provide encode / decode and the special ids."""

    eos_token_id: int | None
    bos_token_id: int | None
    vocab_size: int
    all_special_ids: list[int]
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    pad_token: str | None = None  # none of the tokenizers here reads one (/tokenizer_info reports it)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Read-only (no tokenizer state changes), so any thread may call it."""
        raise NotImplementedError

    def encode_input(self, text: str, pair: str | None = None,
                     max_tokens: int | None = None) -> tuple[list[int], int | None]:
        """The token ids of a pooling model's input: ``text``, or the pair (``text``, ``pair``) as a cross-encoder
        takes it ([CLS] text [SEP] pair [SEP], the pair as segment 1), with the special tokens; cut to
        ``max_tokens`` keeping the special tokens (the text's end, or for a pair the second text's end, goes), as
        the tokenizer's own truncation does. Returns (ids, index of the pair's first token or None)."""
        if pair is not None:
            raise ValueError("this tokenizer does not encode text pairs (a cross-encoder's [CLS] a [SEP] b [SEP])")
        ids = self.encode(text)
        return (ids if max_tokens is None else ids[:max_tokens]), None

    def tokenizers_json(self) -> str | None:
        """The ``tokenizers`` serialisation (tokenizer.json text) of this vocabulary, for libraries that build
        their own view of it (llguidance); None when the tokenizer is not a ``tokenizers`` one."""
        return None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict] | None = None,
                            **template_kwargs) -> str:
        """Render chat messages ([{"role", "content"}]) to the prompt text the model expects (``chat_template``
        overrides the model's own; ``tools``, OpenAI's tool list, for templates that describe tools;
        ``template_kwargs``: more variables for the template, e.g. Qwen3's ``enable_thinking``)."""
        template = _compile_template(chat_template or self.chat_template or DEFAULT_CHAT_TEMPLATE)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token, eos_token=self.eos_token, tools=tools, **template_kwargs)


class ByteTokenizer(Tokenizer):
    """The embedded model's tokenizer, needing no files: <unk>=0 <s>=1 </s>=2 <pad>=3, UTF-8 bytes at 4..259.

    Ids from 260 up (which a random-weights model emits almost always) decode to a deterministic pseudo-word
    with a leading space, so its output prints as text-ish instead of nothing. Any int decodes without error.
    """

    SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
    BYTE_OFFSET = 4
    CONSONANTS = "bcdfghjklmnprstvz"
    VOWELS = "aeiou"

    def __init__(self, vocab_size: int = 32000) -> None:
        self.vocab_size = vocab_size
        self.unk_token_id, self.bos_token_id, self.eos_token_id, self.pad_token_id = 0, 1, 2, 3
        self.all_special_ids = [0, 1, 2, 3]
        self.bos_token, self.eos_token = "<s>", "</s>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + self.BYTE_OFFSET for b in text.encode("utf-8")]
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def pseudo_word(self, token_id: int) -> str:
        n = (token_id * 2654435761) % (1 << 32)  # scramble, so neighbouring ids look unrelated
        syllables = []
        for _ in range(1 + n % 3):  # 1-3 syllables
            n, s = divmod(n, len(self.CONSONANTS) * len(self.VOWELS))
            syllables.append(self.CONSONANTS[s % len(self.CONSONANTS)] + self.VOWELS[s // len(self.CONSONANTS)])
        return " " + "".join(syllables)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        pieces: list[str] = []
        pending = bytearray()  # consecutive byte tokens decode together (multi-byte UTF-8)
        for i in ids:
            i = int(i)
            if self.BYTE_OFFSET <= i < self.BYTE_OFFSET + 256:
                pending.append(i - self.BYTE_OFFSET)
                continue
            if pending:
                pieces.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if 0 <= i < self.BYTE_OFFSET:
                if not skip_special_tokens:
                    pieces.append(self.SPECIALS[i])
            elif i >= self.BYTE_OFFSET + 256:
                pieces.append(self.pseudo_word(i))
            elif not skip_special_tokens:
                pieces.append(self.SPECIALS[0])  # negative ids: unknown
        if pending:
            pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)


class HFTokenizer(Tokenizer):
    """A checkpoint's tokenizer.json through ``tokenizers``, with special tokens from tokenizer_config.json."""

    def __init__(self, model_dir: str) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self._tok = RustTokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        # A tokenizer.json may carry the padding and truncation its trainer batched with (all-MiniLM-L6-v2's pads
        # every text to 128 ids): the engine packs sequences without padding and checks lengths itself.
        self._tok.no_padding()
        self._tok.no_truncation()
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        self.bos_token = _token_text(config.get("bos_token")) or ""
        self.eos_token = _token_text(config.get("eos_token")) or ""
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        added = config.get("added_tokens_decoder", {})
        self.all_special_ids = sorted({int(i) for i, t in added.items() if t.get("special")}
                                      | {i for i in (self.bos_token_id, self.eos_token_id) if i is not None})
        self.chat_template = _chat_template(model_dir, config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def tokenizers_json(self) -> str:
        return self._tok.to_str()

    def encode_input(self, text: str, pair: str | None = None,
                     max_tokens: int | None = None) -> tuple[list[int], int | None]:
        return _encode_with_template(self._tok, text, pair, max_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        vocab = self.vocab_size
        return self._tok.decode([i for i in ids if 0 <= i < vocab], skip_special_tokens=skip_special_tokens)


def _encode_with_template(tok, text: str, pair: str | None, max_tokens: int | None,
                          bos: int | None = None) -> tuple[list[int], int | None]:
    """``Tokenizer.encode_input`` on a ``tokenizers`` tokenizer: the texts' own tokens cut first, then its
    post-processor's special tokens (and type ids) added, so a cut keeps them; ``bos`` prepended after."""
    first = tok.encode(text, add_special_tokens=False)
    second = tok.encode(pair, add_special_tokens=False) if pair is not None else None
    if max_tokens is not None:
        room = max_tokens - tok.num_special_tokens_to_add(second is not None) - (bos is not None)
        if second is None:
            first.truncate(max(room, 0))
        else:
            second.truncate(max(room - len(first.ids), 0))
    enc = tok.post_process(first, second, add_special_tokens=True)
    ids = ([bos] if bos is not None else []) + enc.ids
    if second is None:
        return ids, None
    if 1 not in enc.type_ids:
        raise ValueError("this tokenizer does not mark a text pair's second segment (no token type ids)")
    return ids, enc.type_ids.index(1) + (bos is not None)


class TransformersTokenizer(Tokenizer):
    """Fallback for directories without tokenizer.json (sentencepiece, vocab.json + merges.txt)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model_dir)
        self.bos_token_id, self.eos_token_id = self._tok.bos_token_id, self._tok.eos_token_id
        self.bos_token, self.eos_token = self._tok.bos_token or "", self._tok.eos_token or ""
        self.vocab_size = len(self._tok)
        self.all_special_ids = list(self._tok.all_special_ids)
        self.chat_template = _chat_template(model_dir, _read_json(os.path.join(model_dir, "tokenizer_config.json")))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [i for i in ids if 0 <= i < self.vocab_size]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


class GGUFTokenizer(Tokenizer):
    """A GGUF file's tokenizer and chat template (``models/gguf_vocab.py`` reads them). BOS is prepended when the
    file asks for it (``tokenizer.ggml.add_bos_token``; SentencePiece vocabularies default to yes, as llama.cpp)."""

    def __init__(self, path: str) -> None:
        from conveyor.models.gguf_vocab import read_gguf_vocab

        vocab = read_gguf_vocab(path)
        self._tok = vocab.tokenizer
        self.bos_token_id, self.eos_token_id = vocab.bos_token_id, vocab.eos_token_id
        self.bos_token, self.eos_token = vocab.bos_token, vocab.eos_token
        self.add_bos, self.vocab_size = vocab.add_bos, vocab.vocab_size
        self.all_special_ids, self.chat_template = vocab.special_ids, vocab.chat_template
        self.post_processed = vocab.post_processed  # WordPiece adds [CLS] .. [SEP] itself

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.post_processed:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def tokenizers_json(self) -> str:
        return self._tok.to_str()

    def encode_input(self, text: str, pair: str | None = None,
                     max_tokens: int | None = None) -> tuple[list[int], int | None]:
        bos = self.bos_token_id if self.add_bos and not self.post_processed else None
        return _encode_with_template(self._tok, text, pair, max_tokens, bos)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        vocab = self.vocab_size
        return self._tok.decode([i for i in ids if 0 <= i < vocab], skip_special_tokens=skip_special_tokens)


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(model_dir: str, config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = os.path.join(model_dir, "chat_template.jinja")  # transformers 5 saves it on its own
    if not template and os.path.exists(jinja_file):
        with open(jinja_file) as f:
            template = f.read()
    return template or None


def load_tokenizer(model: str | None) -> Tokenizer:
    """The tokenizer of a ``--model`` value: a named model, a GGUF file, a HF directory (None: the default)."""
    from conveyor.models.sources import resolve_model

    source = resolve_model(model)
    if source.kind == "embedded":
        return ByteTokenizer()
    if source.kind == "gguf":
        return GGUFTokenizer(source.path)
    model_dir = source.path
    if os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        return HFTokenizer(model_dir)
    try:
        return TransformersTokenizer(model_dir)
    except Exception as e:  # transformers raises many types for "no tokenizer here"
        raise FileNotFoundError(f"{model_dir}: no usable tokenizer (tokenizer.json or transformers files): {e}")
