"""A prompt as the engine takes it, and its token ids: ``PromptType``, ``encode_text``, ``prompt_tokens``; and
the token sequences of a request's ``bad_words`` (``tokenize_bad_words``).

``LLMEngine``, the facts a server reads of any engine (``engine_client.EngineInfo``) and chat rendering
(``chat.render_chat``) share these, so text becomes tokens by one rule wherever the engine runs.
"""

from __future__ import annotations

PromptType = str | list[int] | dict  # text, token ids, or {"prompt_token_ids": [...], "prompt": text or None}


def encode_text(tokenizer, text: str, add_special_tokens: bool = True, field: str = "prompt") -> list[int]:
    """Token ids of ``text``; ValueError (naming ``field``) for text that is not valid Unicode (a lone surrogate,
    which JSON can carry), which the tokenizers would refuse with an error of their own."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{field} is not valid Unicode text: {exc.reason} at position {exc.start}") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def prompt_tokens(tokenizer, prompt: PromptType) -> tuple[str | None, list[int]]:
    """A prompt as (text or None, token ids): a string, a list of ids, or ``{"prompt_token_ids": [...]}``."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        return prompt, encode_text(tokenizer, prompt)
    return None, list(prompt)


def tokenize_bad_words(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token sequences, as vLLM forms them: the word as written and with a leading space (the
    form it takes after another word), each once."""
    sequences: list[list[int]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
