"""/v1/embeddings, /v1/rerank and /v1/score against a real server with the clients applications use: the openai SDK
(float and base64), LangChain's OpenAIEmbeddings and a retriever over its in-memory vector store, LiteLLM, Cohere's
client (rerank v2) and Jina's / vLLM's rerank shape; bad input answered 4xx naming the field while the server keeps
serving; a generation model and an embedding model side by side in one ``conveyor serve`` (each in its own engine
process), under load: many clients, the largest batch, and clients that disconnect mid-request."""

from __future__ import annotations

import asyncio
import base64
import os
import re

import httpx
import numpy as np
import pytest

from conveyor.engine.cpu_priority import thread_cpu_priority
from conveyor.engine.llm_engine import LLMEngine
from conveyor.server.app import build_app
from tests.helpers.checkpoints import save_tiny_llama
from tests.helpers.load import assert_serving, idle, start_serve, wait_gauges
from tests.helpers.pooling import minilm_dir, save_tiny_cross_encoder
from tests.helpers.server import running_server

pytestmark = pytest.mark.slow
EMB = "minilm"
DOCS = ["Paris is the capital of France.", "The mitochondria is the powerhouse of the cell.",
        "Bread is baked from flour, water and yeast.", "The Eiffel Tower stands in Paris."]


def _serve_beside_chat(root, *extra: str):
    """``conveyor serve --model tiny-llama --embedding-model all-MiniLM-L6-v2``: two engine processes."""
    gen = save_tiny_llama(root / "gen")
    server = start_serve(str(gen), root / "serve.log", extra=("--embedding-model", minilm_dir(),
                                                              "--embedding-served-model-name", EMB,
                                                              "--dtype", "float32", "--max-num-seqs", "64",
                                                              *extra))
    yield server
    _, left = server.stop(timeout_s=30)
    assert not left, f"processes outlived conveyor serve: {left}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The default layout: the embedding engine at the lower priority ``auto`` gives it beside a chat model."""
    yield from _serve_beside_chat(tmp_path_factory.mktemp("emb"))


@pytest.fixture(scope="module")
def served_at_equal_priority(tmp_path_factory):
    """The same two engines at one CPU priority, for the load test: at nice 19 the embedding engine gets only what
    other work on the machine leaves, so on a machine kept busy (both cores) a burst of its requests would take
    minutes (178 s measured) and the test would measure the neighbours, not the server."""
    yield from _serve_beside_chat(tmp_path_factory.mktemp("emb_equal"), "--embedding-cpu-priority", "normal")


def reference(texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_dir(), device="cpu").encode(texts)


def test_openai_sdk_float_and_base64(served):
    import openai

    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x")
    ref = reference(DOCS)
    floats = client.embeddings.create(model=EMB, input=DOCS, encoding_format="float")
    b64 = client.embeddings.create(model=EMB, input=DOCS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in floats.data] == list(range(len(DOCS)))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(DOCS)
    for got in (np.array([d.embedding for d in floats.data]), np.array([d.embedding for d in b64.data])):
        cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
        assert cos.min() >= 0.99999
    raw = httpx.post(served.url + "/v1/embeddings", json={"input": [[101, 7592, 102]], "encoding_format": "base64"})
    vector = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    assert raw.status_code == 200 and vector.shape == (384,) and abs(np.linalg.norm(vector) - 1) < 1e-5
    # the generation model still answers beside it, routed by endpoint
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}], max_tokens=3)
    assert chat.choices[0].message.content is not None
    assert {m.id for m in client.models.list().data} == {"tiny", EMB}


def test_embedding_engine_computes_at_low_priority(served):
    """Beside a chat model the embedding engine yields the CPU (``--embedding-cpu-priority`` auto): every thread of
    its process, torch's workers included, runs at nice 19, while the chat engine and the API server keep the
    normal priority (read from /proc, as the kernel's scheduler sees them)."""
    r = httpx.post(served.url + "/v1/embeddings", json={"model": EMB, "input": DOCS * 8}, timeout=60)
    assert r.status_code == 200  # its torch threads have run
    chat_pid = int(re.search(r"engine in process (\d+)", served.log()).group(1))
    embedding = [p.pid for p in served.descendants()
                 if p.pid != chat_pid and "multiprocessing.spawn" in " ".join(p.cmdline())]
    assert len(embedding) == 1, embedding

    def priorities(pid: int) -> list[str]:
        found = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                found.append(thread_cpu_priority(pid, int(tid)))
            except FileNotFoundError:  # a thread that ended meanwhile (the server's short-lived ones)
                pass
        return found

    assert len(priorities(embedding[0])) >= 3 and set(priorities(embedding[0])) == {"low"}
    assert set(priorities(chat_pid)) == set(priorities(served.pid)) == {thread_cpu_priority(os.getpid(), os.getpid())}


def test_langchain_retriever_and_litellm(served):
    import litellm
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model=EMB, base_url=served.url + "/v1", api_key="x", check_embedding_ctx_length=False)
    store = InMemoryVectorStore.from_texts(DOCS, embeddings)
    found = store.as_retriever(search_kwargs={"k": 2}).invoke("What is the capital city of France?")
    assert {d.page_content for d in found} == {DOCS[0], DOCS[3]}
    result = litellm.embedding(model=f"openai/{EMB}", input=["hello", "world"], api_base=served.url + "/v1",
                               api_key="x")
    assert len(result.data) == 2 and len(result.data[0]["embedding"]) == 384


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["ok", ""]}, "input"),
    ({"input": ["x"] * 100_000}, "input"), ({"input": [[1, 2, 999_999]]}, "input"),
    ({"input": "x", "dimensions": 4096}, "dimensions"), ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "word " * 400}, "input"), ({"input": "x", "model": "tiny"}, "model"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_input_names_the_field(served, body, param):
    r = httpx.post(served.url + "/v1/embeddings", json={"model": EMB, **body} if "model" not in body else body,
                   timeout=60)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert_serving(served)


def test_ollama_client_embed_and_embeddings(served):
    """Ollama's /api/embed and /api/embeddings through the ``ollama`` client: the same vectors as
    sentence-transformers (unit length from /api/embed; /api/embeddings as the model pools, not normalised), the
    model named with its tag, and Ollama's errors, the server serving after each."""
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=served.url)
    ref = reference(DOCS)
    got = client.embed(model=f"{EMB}:latest", input=DOCS)
    vectors = np.array(got.embeddings)
    assert vectors.shape == (len(DOCS), 384) and np.abs(np.linalg.norm(vectors, axis=1) - 1).max() < 1e-5
    assert ((vectors * ref).sum(1) / np.linalg.norm(ref, axis=1)).min() >= 0.99999
    assert got.prompt_eval_count > len(DOCS)
    one = np.array(client.embed(model=EMB, input=DOCS[0]).embeddings)
    assert one.shape == (1, 384) and np.allclose(one[0], vectors[0], atol=1e-6)
    legacy = np.array(client.embeddings(model=EMB, prompt=DOCS[0]).embedding)
    assert abs(np.linalg.norm(legacy) - 1) > 1e-3  # pooled, not normalised
    assert np.allclose(legacy / np.linalg.norm(legacy), vectors[0], atol=1e-5)
    assert client.embed(model=EMB, input=[]).embeddings == []
    long = "word " * 400  # past MiniLM's 256 positions: cut by default, a 400 with truncate false
    assert len(client.embed(model=EMB, input=long).embeddings[0]) == 384
    for kwargs, status in [({"model": "nope", "input": "x"}, 404), ({"model": "tiny", "input": "x"}, 400),
                           ({"model": EMB, "input": long, "truncate": False}, 400),
                           ({"model": EMB, "input": ["ok", ""]}, 400),
                           ({"model": EMB, "input": ["x"] * 100_000}, 400)]:
        with pytest.raises(ollama.ResponseError) as err:
            client.embed(**kwargs)
        assert err.value.status_code == status and err.value.error, kwargs
        assert_serving(served)
    r = httpx.post(served.url + "/api/embed", json={"model": EMB, "input": [1, 2]}, timeout=30)
    assert r.status_code == 400 and set(r.json()) == {"error"}, r.text


def test_rerank_and_score_cross_encoder(tmp_path):
    import cohere
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = save_tiny_cross_encoder(tmp_path / "ce")
    app = build_app(LLMEngine(model=str(path), dtype="float32"), "ce", log_stats_interval_s=0.0,
                    shutdown_timeout_s=2.0)
    query, docs = "w1 w2", ["w3 w4", "w1 w2 w5", "abc"]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.sigmoid(model(**tok([query] * 3, docs, return_tensors="pt", padding=True)).logits[:, 0])
    order = sorted(range(3), key=lambda i: -want[i].item())
    with running_server(app) as url:
        co = cohere.ClientV2(api_key="x", base_url=url)
        ranked = co.rerank(model="ce", query=query, documents=docs, top_n=2)
        assert [r.index for r in ranked.results] == order[:2]
        assert abs(ranked.results[0].relevance_score - want[order[0]].item()) < 1e-5
        jina = httpx.post(url + "/v1/rerank", json={"model": "ce", "query": query, "documents": docs}).json()
        assert [r["index"] for r in jina["results"]] == order and jina["usage"]["total_tokens"] > 0
        assert jina["results"][0]["document"] == {"text": docs[order[0]]}
        score = httpx.post(url + "/v1/score", json={"model": "ce", "text_1": query, "text_2": docs}).json()
        assert [d["index"] for d in score["data"]] == [0, 1, 2]
        assert max(abs(d["score"] - w.item()) for d, w in zip(score["data"], want)) < 1e-5
        for body, param in (({"query": query, "documents": []}, "documents"),
                            ({"query": "", "documents": docs}, "query"),
                            ({"query": query, "documents": [{"nope": 1}]}, "documents")):
            bad = httpx.post(url + "/v1/rerank", json=body)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        bad = httpx.post(url + "/v1/embeddings", json={"input": "x"})  # a reranker asked for embeddings
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"


def test_embeddings_beside_chat_under_load(served_at_equal_priority):
    """Many clients (embeddings of every size, chat), the largest batch OpenAI allows, and clients that hang up
    mid-request: every request ends (200, or a 4xx/5xx in OpenAI's shape), nothing is left running, and the
    server answers both models afterwards."""
    served = served_at_equal_priority

    async def drive():
        outcomes: list[int] = []
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
            async def embed(k: int):
                texts = [f"passage {k} number {i} " * (1 + (k * 7 + i) % 40) for i in range(1 + k % 16)]
                r = await client.post("/v1/embeddings", json={"model": EMB, "input": texts})
                outcomes.append(r.status_code)
                if r.status_code == 200:
                    assert len(r.json()["data"]) == len(texts)

            async def chat(k: int):
                r = await client.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": f"w{k % 90 + 5}"}], "max_tokens": 8})
                outcomes.append(r.status_code)

            async def hang_up(k: int):  # a big request abandoned while it is queued or running
                try:
                    await client.post("/v1/embeddings", json={"model": EMB, "input": ["long text " * 100] * 64},
                                      timeout=0.05 + 0.02 * k)
                except httpx.TimeoutException:
                    outcomes.append(499)

            largest = client.post("/v1/embeddings", json={"model": EMB, "input": [f"t{i}" for i in range(2048)]})
            jobs = [embed(k) for k in range(24)] + [chat(k) for k in range(8)] + [hang_up(k) for k in range(12)]
            results = await asyncio.gather(largest, *jobs, return_exceptions=True)
            errors = [r for r in results if isinstance(r, Exception)]
            assert not errors, errors[:3]
            assert results[0].status_code == 200 and len(results[0].json()["data"]) == 2048
        return outcomes

    outcomes = asyncio.run(drive())
    assert set(outcomes) <= {200, 499}, outcomes
    settled, last, _ = wait_gauges(served.url, idle, 60.0)
    assert settled, f"requests left running after the burst: {last}"
    assert_serving(served)
    r = httpx.post(served.url + "/v1/embeddings", json={"model": EMB, "input": "still here"}, timeout=30)
    assert r.status_code == 200
