"""A batch job survives ``kill -9`` of ``conveyor serve`` in the middle of it: started again on the same
``--data-dir``, the server resumes the job, which completes with exactly one output line per input line, and no
line that had its result before the kill runs again."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import time

import openai
import pytest

from tests.helpers.load import counter, start_serve, tail

pytestmark = pytest.mark.slow
LINES = 48


def test_kill_9_mid_batch_then_restart_completes_each_line_exactly_once(tiny_chat_dir, tmp_path):
    data_dir = tmp_path / "state"
    flags = ("--data-dir", data_dir, "--dtype", "float32", "--num-kv-blocks", "256", "--batch-concurrency", "4")
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "tiny", "messages": [{"role": "user", "content": f"w{i % 9} w1"}],
                       "max_tokens": 48, "ignore_eos": True}} for i in range(LINES)]
    first = start_serve(str(tiny_chat_dir), tmp_path / "first.log", extra=flags)
    try:
        c = openai.OpenAI(base_url=first.url + "/v1", api_key="none", max_retries=0)
        uploaded = c.files.create(file=("in.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())),
                                  purpose="batch")
        batch = c.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 120
        while c.batches.retrieve(batch.id).request_counts.completed < 6:
            assert time.monotonic() < deadline, tail(first)
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)
        first.proc.wait(30)
    finally:
        first.stop(timeout_s=10)
    with sqlite3.connect(data_dir / "batches.sqlite3") as db:
        done_before = db.execute("SELECT COUNT(*) FROM results WHERE batch_id = ?", (batch.id,)).fetchone()[0]
        status = json.loads(db.execute("SELECT body FROM batches WHERE id = ?", (batch.id,)).fetchone()[0])["status"]
    assert 6 <= done_before < LINES and status == "in_progress", (done_before, status)

    second = start_serve(str(tiny_chat_dir), tmp_path / "second.log", extra=flags)
    try:
        c = openai.OpenAI(base_url=second.url + "/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 240
        while (resumed := c.batches.retrieve(batch.id)).status != "completed":
            assert resumed.status in ("in_progress", "finalizing") and time.monotonic() < deadline, tail(second)
            time.sleep(0.1)
        assert resumed.request_counts.completed == LINES and resumed.request_counts.failed == 0
        out = [json.loads(x) for x in c.files.content(resumed.output_file_id).text.splitlines()]
        assert [r["custom_id"] for r in out] == [line["custom_id"] for line in lines], "one line each, in order"
        assert all(len(r["response"]["body"]["choices"][0]["message"]["content"].split()) > 0 for r in out)
        # the restarted server ran exactly the lines that had no result: none ran twice
        ran_again = counter(second.url, "conveyor:request_success_total", finished_reason="length")
        assert ran_again == LINES - done_before, (ran_again, done_before)
        assert c.files.retrieve(uploaded.id).id == uploaded.id, "the input file survived too"
    finally:
        code, left = second.stop()
    assert not left, f"processes outlived conveyor serve: {left}"
