"""An ``llguidance.LLTokenizer`` for any conveyor tokenizer: the token bytes the bitmask is computed over."""

from __future__ import annotations

from conveyor.tokenizer import ByteTokenizer, Tokenizer


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int):
    """The llguidance tokenizer of ``tokenizer``, its vocabulary padded to the model's ``vocab_size`` (rows of
    the logits past the tokenizer's own vocabulary are never allowed). Takes a few hundred ms: build it once."""
    import llguidance

    eos = tokenizer.eos_token_id
    serialised = tokenizer.tokenizers_json()
    if serialised is not None:  # HF tokenizer.json or a GGUF vocabulary: both `tokenizers` tokenizers
        try:
            return llguidance.LLTokenizer(serialised, n_vocab=vocab_size, eos_token=eos)
        except Exception as exc:  # llguidance reads byte-level BPE and SentencePiece vocabularies, not all others
            raise ValueError(f"structured outputs are not available for this model's tokenizer: {exc}") from None
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(_ByteVocabulary(tokenizer, vocab_size), n_vocab=vocab_size, eos_token=eos)
    raise ValueError(f"structured outputs need a tokenizers-based tokenizer, not {type(tokenizer).__name__}")


class _ByteVocabulary:
    """The embedded model's byte tokenizer in the shape llguidance's ``TokenizerWrapper`` reads: each id's bytes
    (ids past the 256 bytes are the pseudo-words the tokenizer decodes them to) and an encoder."""

    def __init__(self, tokenizer: ByteTokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id, self.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        self.special_token_ids = list(tokenizer.all_special_ids)
        specials = [s.encode() for s in ByteTokenizer.SPECIALS]
        offset = ByteTokenizer.BYTE_OFFSET
        self.tokens = specials + [bytes([b]) for b in range(256)] + [
            tokenizer.pseudo_word(i).encode() for i in range(offset + 256, vocab_size)]
        self.is_tokenizer_wrapper = True

    def __call__(self, text: str | bytes) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        return [b + ByteTokenizer.BYTE_OFFSET for b in data]
