"""Request bodies of the pooling endpoints: OpenAI's embeddings, the rerank body Cohere's, Jina's and vLLM's clients
send, and vLLM's score; every number and flag declared with ``server.fields``' bounded types."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator

from conveyor.server.fields import Bool, Int64, PositiveInt, Priority, Prompt

# OpenAI's own bound on inputs per embeddings request (LangChain sends 1000 at a time)
MAX_EMBEDDING_INPUTS = 2048
MAX_DOCUMENTS = 1000  # Cohere's bound on documents per rerank request


def _document(value: Any) -> str:
    """A rerank document: a string, or Cohere's / Jina's {"text": ...}."""
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        return value["text"]
    if isinstance(value, str):
        return value
    raise ValueError("must be a string or an object with a string `text`")


Document = Annotated[str, PlainValidator(_document)]


class EmbeddingRequest(BaseModel):
    """OpenAI's ``/v1/embeddings`` body, and vLLM's ``truncate_prompt_tokens`` / ``normalize``."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    user: str | None = None
    truncate_prompt_tokens: Int64 | None = None  # -1: the model's limit; None: a longer input is a 400
    normalize: Bool | None = None
    priority: Priority = 0  # vLLM's (--scheduling-policy priority): lower runs first


class RerankRequest(BaseModel):
    """The rerank body of Cohere's (v1 and v2), Jina's and vLLM's APIs."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    query: str
    documents: list[Document] = Field(max_length=MAX_DOCUMENTS)
    top_n: PositiveInt | None = None
    return_documents: Bool = True
    truncate_prompt_tokens: Int64 | None = None
    instruction: str | None = None  # a decoder reranker's task line (Qwen3-Reranker's {instruction})


class ScoreRequest(BaseModel):
    """vLLM's ``/score`` body: ``text_1`` against each of ``text_2`` (or pairs position by position)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Int64 | None = None
    instruction: str | None = None
