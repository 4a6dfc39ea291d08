"""Embedding and scoring requests on the engine's one path: their prompts (text, a (query, document) pair, token
ids), the checks a pooling request gets, and the runner's ``Pooler`` for the loaded model.

An embedding or score request is a request whose ``SamplingParams.pooling`` is set (``core.pooling_params``); the
scheduler runs it to the end of its prompt and it finishes there with its result. Every protocol (OpenAI
embeddings, rerank / score, Ollama's embed, ``LLM.embed`` / ``LLM.score``) builds its prompts here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.core.pooling_params import PoolingParams
from conveyor.models.pooling_config import QWEN3_RERANKER_INSTRUCTION

if TYPE_CHECKING:  # annotations only: the API process checks pooling requests without importing torch
    from conveyor.models.build import ModelInfo

TASK_NAMES = {"embed": "embeddings", "score": "scores (rerank / score)"}


def check_task(info: ModelInfo, pooling: PoolingParams | None) -> None:
    """ValueError when the model does not serve what the request asks: embeddings or scores of a generation
    model (or of a model of the other pooling task), text of a pooling model."""
    if pooling is None:
        if info.task != "generate":
            raise ValueError(f"model: {info.name} is an {info.task} model ({TASK_NAMES[info.task]}); it does not "
                             "generate text")
        return
    if info.task != pooling.task:
        what = "a text generation model" if info.task == "generate" else f"an {info.task} model"
        raise ValueError(f"model: {info.name} is {what}; it does not return {TASK_NAMES[pooling.task]}")
    if pooling.dimensions is not None:
        check_dimensions(info, pooling.dimensions)


def check_dimensions(info: ModelInfo, dimensions: int) -> None:
    """``dimensions`` a request may ask of this model: at most its embedding's length, and one it was trained to
    be cut to (Matryoshka: ``matryoshka_dimensions`` / ``is_matryoshka`` in its config, or --pooler-config)."""
    full = info.hidden_size
    if dimensions > full:
        raise ValueError(f"dimensions: {dimensions} is more than this model's embedding length ({full})")
    allowed = info.pooling.matryoshka if info.pooling is not None else ()
    if dimensions != full and allowed is not None and dimensions not in allowed:
        raise ValueError(f"dimensions: {info.name} was not trained for shorter embeddings (Matryoshka)"
                         + (f"; it serves {sorted(allowed)}" if allowed else "; it serves only its full length "
                            f"{full}, or pass --pooler-config '{{\"matryoshka_dimensions\": true}}'"))


def check_pooling_input(token_ids: list[int], max_model_len: int, vocab_size: int, field: str = "input") -> None:
    """ValueError naming ``field`` for a pooling prompt that is empty, longer than the model's limit or holds ids
    outside its vocabulary."""
    if not token_ids:
        raise ValueError(f"{field} must not be empty")
    if len(token_ids) > max_model_len:
        raise ValueError(f"{field} is {len(token_ids)} tokens, more than this model's maximum input length of "
                         f"{max_model_len} tokens; shorten it or pass truncate_prompt_tokens")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in token_ids):
        raise ValueError(f"{field}: token ids must be integers in [0, {vocab_size})")


def truncation(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """The most tokens to keep (vLLM's ``truncate_prompt_tokens``: -1 the model's limit, None no cut)."""
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens == -1:
        return max_model_len
    if truncate_prompt_tokens < 1:
        raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {truncate_prompt_tokens}")
    return min(truncate_prompt_tokens, max_model_len)


def embed_prompt(tokenizer, text: str | list[int], keep: int | None) -> list[int]:
    """An embedding input's token ids: text with the tokenizer's special tokens (cut to ``keep`` keeping them), or
    token ids as given (cut to ``keep``)."""
    if isinstance(text, str):
        _check_text(text)
        return tokenizer.encode_input(text, max_tokens=keep)[0]
    return list(text) if keep is None else list(text)[:keep]


def score_prompt(tokenizer, info: ModelInfo, query: str, document: str, keep: int | None,
                 instruction: str | None = None) -> tuple[list[int], int | None]:
    """A (query, document) pair as the model scores it: two segments for a cross-encoder ([CLS] q [SEP] d [SEP],
    the document's end cut first), or one prompt from the decoder reranker's template. Returns (ids, where the
    second segment starts or None)."""
    _check_text(query, "query")
    _check_text(document, "documents")
    template = info.pooling.score_template if info.pooling is not None else None
    if template is None:
        return tokenizer.encode_input(query, document, max_tokens=keep)
    text = template.format(query=query, document=document, instruction=instruction or QWEN3_RERANKER_INSTRUCTION)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (ids if keep is None else ids[:keep]), None


def _check_text(text: str, field: str = "input") -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{field} is not valid Unicode text: {exc.reason} at position {exc.start}") from None


def make_pooler(model, info: ModelInfo, tokenizer):
    """The runner's ``Pooler`` for a pooling model (None for a generation model); a decoder reranker's (no, yes)
    tokens become ids here, each one token of the vocabulary or a ValueError."""
    if info.pooling is None:
        return None
    from conveyor.runner.pooler import Pooler

    ids = None
    if info.pooling.classifier_from_token:
        ids = []
        for token in info.pooling.classifier_from_token:
            encoded = tokenizer.encode(token, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(f"--pooler-config: classifier_from_token {token!r} is {len(encoded)} tokens of this "
                                 "vocabulary, not one")
            ids.append(encoded[0])
        ids = tuple(ids)
    return Pooler(model, info.pooling, ids)
