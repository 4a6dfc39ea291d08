"""The Batch API (/v1/files, /v1/batches) against a real server: the openai SDK's workflow unchanged (upload, create,
poll, download) for chat, completion and embedding lines; a line's bad body in the error file while the rest run;
bad input files refused naming the line, a missing file 404, nothing else lost; one API key never sees another's
files or batches; cancel; the store's bounds."""

from __future__ import annotations

import io
import json
import time

import httpx
import openai
import pytest

from conveyor.core.policies import BATCH_PRIORITY
from conveyor.engine.args import EngineArgs
from conveyor.engine.llm_engine import LLMEngine
from conveyor.server.app import build_app
from conveyor.server.batches.setup import BatchAPIConfig
from conveyor.server.batches.store import StoreLimits
from tests.helpers.pooling import minilm_dir
from tests.helpers.server import make_engine, running_server

pytestmark = pytest.mark.slow
KEYS = ["key-a", "key-b"]
DONE = ("completed", "failed", "cancelled", "expired")


def chat_line(i: int, max_tokens: int = 4, **body) -> dict:
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": f"w{i % 7} w3"}],
                     "max_tokens": max_tokens, **body}}


def jsonl(lines: list[dict]) -> bytes:
    return "\n".join(json.dumps(line) for line in lines).encode() + b"\n"


def wait_done(client: openai.OpenAI, batch_id: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    batch = client.batches.retrieve(batch_id)
    while batch.status not in DONE:
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.1)
        batch = client.batches.retrieve(batch_id)
    return batch


def records(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def server(tiny_chat_dir, tmp_path_factory):
    """The tiny chat model and all-MiniLM-L6-v2 behind one app, two keys, the Batch API in a temporary directory."""
    data_dir = tmp_path_factory.mktemp("batches")
    embedder = LLMEngine(EngineArgs(model=minilm_dir(), dtype="float32", num_kv_blocks=64))
    app = build_app(make_engine(tiny_chat_dir), "tiny", KEYS, log_stats_interval_s=0.0, shutdown_timeout_s=2.0,
                    also_serve=[(embedder, "minilm")],
                    batches=BatchAPIConfig(str(data_dir), StoreLimits(max_file_bytes=64 * 1024), 8, BATCH_PRIORITY))
    with running_server(app) as url:
        yield url


def client(url: str, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_openai_sdk_workflow_for_chat_completion_and_embedding_lines(server):
    c = client(server)
    embed_texts = ["Paris is in France.", "Bread is baked."]
    jobs = {
        "/v1/chat/completions": [chat_line(i) for i in range(12)],
        "/v1/completions": [{"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
                             "body": {"model": "tiny", "prompt": f"w{i} w2", "max_tokens": 3}} for i in range(5)],
        "/v1/embeddings": [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                            "body": {"model": "minilm", "input": text}} for i, text in enumerate(embed_texts)],
    }
    for endpoint, lines in jobs.items():
        uploaded = c.files.create(file=("requests.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
        batch = c.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h",
                                 metadata={"job": "nightly"})
        assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "nightly"}
        batch = wait_done(c, batch.id)
        assert batch.status == "completed" and batch.error_file_id is None, batch
        assert batch.request_counts.completed == len(lines) and batch.request_counts.failed == 0
        out = records(c, batch.output_file_id)
        assert [r["custom_id"] for r in out] == [line["custom_id"] for line in lines]
        for r in out:
            assert r["response"]["status_code"] == 200 and r["error"] is None
            assert r["response"]["request_id"] == r["response"]["body"]["id"]
        if endpoint == "/v1/embeddings":
            direct = c.embeddings.create(model="minilm", input=embed_texts, encoding_format="float")
            for r, d in zip(out, direct.data):
                assert r["response"]["body"]["data"][0]["embedding"] == pytest.approx(d.embedding, abs=1e-5)
        else:
            kind = "chat.completion" if endpoint == "/v1/chat/completions" else "text_completion"
            assert {r["response"]["body"]["object"] for r in out} == {kind}
    listed = c.batches.list(limit=2)
    assert len(listed.data) == 2 and listed.has_more and listed.data[0].endpoint == "/v1/embeddings"
    assert listed.data[1].id == c.batches.list(limit=1, after=listed.data[0].id).data[0].id


def test_a_line_with_a_bad_body_goes_to_the_error_file_and_the_rest_run(server):
    c = client(server)
    lines = [chat_line(0), chat_line(1, temperature="hot"), chat_line(2, model="nope"), chat_line(3),
             chat_line(4, max_tokens=10**9)]
    uploaded = c.files.create(file=("mixed.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = wait_done(c, c.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                          completion_window="24h").id)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 3)
    assert [r["custom_id"] for r in records(c, batch.output_file_id)] == ["c0", "c3"]
    errors = {r["custom_id"]: r["response"] for r in records(c, batch.error_file_id)}
    assert errors["c1"]["status_code"] == 400 and errors["c1"]["body"]["error"]["param"] == "temperature"
    assert errors["c2"]["status_code"] == 404 and errors["c2"]["body"]["error"]["code"] == "model_not_found"
    assert errors["c4"]["status_code"] == 400 and "max_tokens" in errors["c4"]["body"]["error"]["message"]


BAD_FILES = [
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n{not json\n',
     "line 2", "invalid_json_line"),
    (jsonl([{**chat_line(0), "url": "/v1/images/generations"}]), "line 1", "invalid_url"),
    (jsonl([chat_line(0), chat_line(0)]), "line 2", "duplicate_custom_id"),
    (jsonl([chat_line(0, stream=True)]), "line 1", "invalid_body"),
    (jsonl([chat_line(0), {**chat_line(1), "url": "/v1/completions"}]), "line 2", "mismatched_endpoint"),
    (jsonl([{**chat_line(0), "method": "GET"}]), "line 1", "invalid_method"),
    (b"\n\n", "no request", "empty_file"),
    (b"\xff\xfe{}\n", "line 1", "invalid_json_line"),
]


@pytest.mark.parametrize("content, where, code", BAD_FILES)
def test_a_bad_input_file_is_refused_naming_the_line(server, content, where, code):
    c = client(server)
    before = len(c.files.list().data)
    with pytest.raises(openai.BadRequestError) as caught:
        c.files.create(file=("bad.jsonl", io.BytesIO(content)), purpose="batch")
    error = caught.value.body
    assert error["code"] == code and where in error["message"] and error["param"] == "file", error
    assert len(c.files.list().data) == before, "a refused upload is not kept"


def test_refusals_at_the_edges_lose_nothing_else(server):
    c = client(server)
    with pytest.raises(openai.APIStatusError) as caught:  # over --batch-max-file-bytes (64 KiB here)
        c.files.create(file=("big.jsonl", io.BytesIO(jsonl([chat_line(i) for i in range(1000)]))), purpose="batch")
    assert caught.value.status_code == 413
    with pytest.raises(openai.NotFoundError) as caught:
        c.batches.create(input_file_id="file-missing", endpoint="/v1/chat/completions", completion_window="24h")
    assert caught.value.body["param"] == "input_file_id"
    good = c.files.create(file=("good.jsonl", io.BytesIO(jsonl([chat_line(0)]))), purpose="batch")
    for kwargs, param in ((dict(endpoint="/v1/completions", completion_window="24h"), "endpoint"),
                          (dict(endpoint="/v1/chat/completions", completion_window="1h"), "completion_window"),
                          (dict(endpoint="/v1/moderations", completion_window="24h"), "endpoint")):
        with pytest.raises(openai.BadRequestError) as caught:
            c.batches.create(input_file_id=good.id, **kwargs)
        assert caught.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as caught:
        c.files.create(file=("good.jsonl", io.BytesIO(jsonl([chat_line(0)]))), purpose="fine-tune")
    assert caught.value.body["param"] == "purpose"
    r = httpx.post(server + "/v1/files", json={"purpose": "batch"}, headers={"Authorization": "Bearer key-a"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    with pytest.raises(openai.NotFoundError):
        c.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        c.files.delete("file-nope")
    # and the server goes on: the good file runs
    batch = wait_done(c, c.batches.create(input_file_id=good.id, endpoint="/v1/chat/completions",
                                          completion_window="24h").id)
    assert batch.status == "completed" and batch.request_counts.completed == 1


def test_one_key_never_sees_another_keys_files_or_batches(server):
    a, b = client(server, "key-a"), client(server, "key-b")
    mine = a.files.create(file=("mine.jsonl", io.BytesIO(jsonl([chat_line(0)]))), purpose="batch")
    batch = a.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert mine.id not in {f.id for f in b.files.list().data}
    assert batch.id not in {x.id for x in b.batches.list().data}
    for call in (lambda: b.files.retrieve(mine.id), lambda: b.files.content(mine.id), lambda: b.files.delete(mine.id),
                 lambda: b.batches.retrieve(batch.id), lambda: b.batches.cancel(batch.id),
                 lambda: b.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert wait_done(a, batch.id).status == "completed"
    with pytest.raises(openai.AuthenticationError):
        client(server, "key-c").files.list()


def test_cancel_aborts_the_lines_in_flight_and_keeps_the_results_it_had(server):
    c = client(server)
    lines = [chat_line(i, max_tokens=200, ignore_eos=True) for i in range(40)]
    uploaded = c.files.create(file=("long.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = c.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while c.batches.retrieve(batch.id).request_counts.completed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cancelling = c.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait_done(c, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    out = records(c, batch.output_file_id)
    assert 2 <= len(out) < len(lines) and len({r["custom_id"] for r in out}) == len(out)
    assert batch.request_counts.completed == len(out)
    assert c.batches.cancel(batch.id).status == "cancelled", "a finished batch's cancel answers it as it is"
    gauges = httpx.get(server + "/metrics").text
    deadline = time.monotonic() + 10
    while 'conveyor:num_requests_running{model_name="tiny"} 0.0' not in gauges:
        assert time.monotonic() < deadline, "the cancelled lines were not aborted"
        time.sleep(0.05)
        gauges = httpx.get(server + "/metrics").text


def test_the_store_is_bounded_in_files(tiny_chat_dir, tmp_path):
    app = build_app(make_engine(tiny_chat_dir), "tiny", None, log_stats_interval_s=0.0, shutdown_timeout_s=2.0,
                    batches=BatchAPIConfig(str(tmp_path), StoreLimits(max_files=2), 4, BATCH_PRIORITY))
    with running_server(app) as url:
        c = client(url)
        first = c.files.create(file=("a.jsonl", io.BytesIO(jsonl([chat_line(0)]))), purpose="batch")
        c.files.create(file=("b.jsonl", io.BytesIO(jsonl([chat_line(1)]))), purpose="batch")
        with pytest.raises(openai.BadRequestError) as caught:
            c.files.create(file=("c.jsonl", io.BytesIO(jsonl([chat_line(2)]))), purpose="batch")
        assert caught.value.body["code"] == "storage_full" and "--batch-max-files" in caught.value.body["message"]
        assert c.files.delete(first.id).deleted
        c.files.create(file=("c.jsonl", io.BytesIO(jsonl([chat_line(2)]))), purpose="batch")
        # a second server on the same directory would run every job twice: it serves no Batch API
        second = build_app(make_engine(tiny_chat_dir), "tiny", None, log_stats_interval_s=0.0,
                           batches=BatchAPIConfig(str(tmp_path), StoreLimits(), 4, BATCH_PRIORITY))
        assert not any(getattr(r, "path", "") == "/v1/batches" for r in second.routes)


def test_the_priority_field_is_served_and_an_fcfs_engine_refuses_it(server, tiny_chat_dir):
    c = client(server)
    for endpoint in ("chat", "completions"):
        create = c.chat.completions.create if endpoint == "chat" else c.completions.create
        kwargs = {"messages": [{"role": "user", "content": "w1"}]} if endpoint == "chat" else {"prompt": "w1"}
        assert create(model="tiny", max_tokens=2, extra_body={"priority": -3}, **kwargs).choices
        with pytest.raises(openai.BadRequestError) as caught:
            create(model="tiny", max_tokens=2, extra_body={"priority": 2**31}, **kwargs)
        assert caught.value.body["param"] == "priority"
    app = build_app(make_engine(tiny_chat_dir, scheduling_policy="fcfs"), "tiny", None, log_stats_interval_s=0.0,
                    shutdown_timeout_s=2.0)
    with running_server(app) as url:
        fcfs = client(url)
        with pytest.raises(openai.BadRequestError) as caught:
            fcfs.completions.create(model="tiny", prompt="w1", max_tokens=2, extra_body={"priority": 1})
        assert caught.value.body["param"] == "priority" and "fcfs" in caught.value.body["message"]
        assert fcfs.completions.create(model="tiny", prompt="w1", max_tokens=2, extra_body={"priority": 0}).choices
