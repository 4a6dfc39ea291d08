"""POST /v1/embeddings (OpenAI), /v1/rerank (Cohere / Jina / vLLM; /rerank and /v2/rerank too) and /v1/score
(vLLM; /score too): adapters from each wire format to the one internal request (``SamplingParams.pooling``) and
back. Inputs are tokenized in one call off the event loop, checked (empty, too long, ids outside the vocabulary,
more than a request may hold), then queued together, one engine request each, all or nothing; a client that goes
away aborts them all."""

from __future__ import annotations

import base64
import struct
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from conveyor.core.pooling_params import PoolingParams
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.pooling import check_dimensions, check_pooling_input, embed_prompt, score_prompt, truncation
from conveyor.server.errors import bad_request
from conveyor.server.pooling_protocol import MAX_EMBEDDING_INPUTS, EmbeddingRequest, RerankRequest, ScoreRequest
from conveyor.server.served_models import ServedModels
from conveyor.server.serving_common import ServingContext, new_id


def _inputs(value) -> list[str | list[int]]:
    if isinstance(value, str) or (isinstance(value, list) and value and type(value[0]) is int):
        return [value]
    if not value:
        raise bad_request("input must not be empty", "input")
    return list(value)


async def _run(ctx: ServingContext, raw: Request, prefix: str, token_lists: list[list[int]],
               pooling: list[PoolingParams], field: str, priority: int = 0):
    """Check, queue and wait for pooling requests; (request id, final outputs)."""
    if ctx.admission_cap is not None and len(token_lists) > ctx.admission_cap:
        raise bad_request(f"{field} holds {len(token_lists)} inputs, more than this server can ever admit at once "
                          f"({ctx.admission_cap})", field)
    for ids in token_lists:
        try:
            check_pooling_input(ids, ctx.max_model_len, ctx.vocab_size, field)
        except ValueError as exc:
            raise bad_request(str(exc), field) from exc
    request_id = new_id(prefix)
    streams = await ctx.submit(request_id, [{"prompt_token_ids": ids} for ids in token_lists],
                               [SamplingParams(max_tokens=1, pooling=p, priority=priority) for p in pooling], raw)
    return request_id, await ctx.wait_final(streams, raw)


def _usage(outputs) -> dict:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _encode(vector: list[float], fmt: str):
    """OpenAI's encodings: a list of floats, or base64 of the float32 little-endian bytes (what the openai
    client asks for by default and decodes with numpy)."""
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def embed(ctx: ServingContext, raw: Request, inputs: list[str | list[int]], truncate: int | None,
                dimensions: int | None, normalize: bool | None, priority: int = 0, prefix: str = "embd"):
    """The one embedding path every protocol's adapter calls: ``inputs`` (texts or token id lists) checked,
    tokenized in one call off the event loop (cut to ``truncate`` tokens: vLLM's ``truncate_prompt_tokens``, -1
    the model's limit, None none: a longer input is a 400), queued together and awaited; (request id, outputs in
    input order)."""
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise bad_request(f"input holds {len(inputs)} items, more than the {MAX_EMBEDDING_INPUTS} one request may "
                          "hold", "input")
    if any(isinstance(i, str) and not i for i in inputs):
        raise bad_request("input must not hold empty strings", "input")
    for i, text in enumerate(inputs):
        if isinstance(text, str):
            ctx.check_prompt_chars(len(text), "input", f"input {i}")

    def tokenize(info):  # off the event loop: the whole batch in one go
        if dimensions is not None:
            check_dimensions(info.model_info, dimensions)
        keep = truncation(truncate, info.max_model_len)
        return [embed_prompt(info.tokenizer, text, keep) for text in inputs]

    token_lists = await ctx.tokenizer_call(tokenize)
    params = PoolingParams(task="embed", dimensions=dimensions, normalize=normalize)
    return await _run(ctx, raw, prefix, token_lists, [params] * len(token_lists), "input", priority)


async def create_embedding(body: EmbeddingRequest, raw: Request, ctx: ServingContext) -> JSONResponse:
    request_id, outputs = await embed(ctx, raw, _inputs(body.input), body.truncate_prompt_tokens, body.dimensions,
                                      body.normalize, body.priority)
    data = [{"object": "embedding", "index": i, "embedding": _encode(o.pooled, body.encoding_format)}
            for i, o in enumerate(outputs)]
    return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()), "model": ctx.model_name,
                         "data": data, "usage": _usage(outputs)})


async def _scores(ctx: ServingContext, raw: Request, queries: list[str], documents: list[str],
                  truncate: int | None, instruction: str | None, field: str):
    def tokenize(info):
        keep = truncation(truncate, info.max_model_len)
        return [score_prompt(info.tokenizer, info.model_info, q, d, keep, instruction)
                for q, d in zip(queries, documents)]

    pairs = await ctx.tokenizer_call(tokenize)
    return await _run(ctx, raw, "score", [ids for ids, _ in pairs],
                      [PoolingParams(task="score", pair_start=start) for _, start in pairs], field)


async def create_rerank(body: RerankRequest, raw: Request, ctx: ServingContext) -> JSONResponse:
    """Documents by relevance to the query, best first: ``results[i]`` = {index, relevance_score, document}, in the
    shape Cohere's (v1 and v2), Jina's and vLLM's clients parse."""
    if not body.documents:
        raise bad_request("documents must not be empty", "documents")
    if not body.query:
        raise bad_request("query must not be empty", "query")
    request_id, outputs = await _scores(ctx, raw, [body.query] * len(body.documents), body.documents,
                                        body.truncate_prompt_tokens, body.instruction, "documents")
    ranked = sorted(range(len(outputs)), key=lambda i: -outputs[i].pooled[0])[:body.top_n]
    results = [{"index": i, "relevance_score": outputs[i].pooled[0],
                **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in ranked]
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return JSONResponse({"id": request_id, "model": ctx.model_name, "results": results,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                         "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}}})


async def create_score(body: ScoreRequest, raw: Request, ctx: ServingContext) -> JSONResponse:
    """vLLM's score: one text_1 against every text_2, or pairs position by position."""
    first = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
    second = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
    if not first or not second:
        raise bad_request("text_1 and text_2 must not be empty", "text_1" if not first else "text_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise bad_request(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or one per "
                          "text_2", "text_2")
    if len(second) > MAX_EMBEDDING_INPUTS:
        raise bad_request(f"text_2 holds {len(second)} texts, more than {MAX_EMBEDDING_INPUTS}", "text_2")
    request_id, outputs = await _scores(ctx, raw, first, second, body.truncate_prompt_tokens, body.instruction,
                                        "text_2")
    data = [{"index": i, "object": "score", "score": o.pooled[0]} for i, o in enumerate(outputs)]
    return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()), "model": ctx.model_name,
                         "data": data, "usage": _usage(outputs)})

def install_pooling_routes(app, served: ServedModels) -> dict:
    """The pooling endpoints, each on the served model its body names (or the first of the endpoint's task); returns
    the embeddings route's (body model, handler) by path, for the Batch API."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request):
        return await create_embedding(body, raw, served.for_request(body.model, "embed"))

    async def rerank(body: RerankRequest, raw: Request):
        return await create_rerank(body, raw, served.for_request(body.model, "score"))

    async def score(body: ScoreRequest, raw: Request):
        return await create_score(body, raw, served.for_request(body.model, "score"))

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):  # vLLM and Jina's, llama.cpp's, Cohere's v2 client's
        app.post(path)(rerank)
    for path in ("/v1/score", "/score"):
        app.post(path)(score)
    return {"/v1/embeddings": (EmbeddingRequest, embeddings)}
