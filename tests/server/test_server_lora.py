"""LoRA adapters behind ``conveyor serve --enable-lora`` (issue 53), in the default layout (the engine in its own
process): adapters by name through the ``openai`` and ``anthropic`` SDKs, each answering what peft's merged model
says; ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` with vLLM's shapes; refusals in OpenAI's error
shape; and a short load of many clients across the base model and three adapters (two slots: adapters swapped
under load) with disconnects, after which the server still serves."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest
import torch
from tokenizers import Tokenizer

from tests.helpers.checkpoints import TINY_VOCAB, save_tiny_llama, write_word_tokenizer
from tests.helpers.load import assert_serving, run_clients, start_serve, tail
from tests.helpers.lora import merged_model, save_random_adapter
from tests.helpers.server import CHAT_TEMPLATE

pytestmark = pytest.mark.slow
BASE = "tiny"
PROMPT = "w5 w17 w42 w99 w123"


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    base = save_tiny_llama(root / "base")
    write_word_tokenizer(base, TINY_VOCAB, chat_template=CHAT_TEMPLATE)
    adapters = {f"a{i}": save_random_adapter(base, root / f"a{i}", seed=10 + i, r=4 + 4 * i) for i in range(4)}
    big = save_random_adapter(base, root / "big", seed=9, r=32)
    flags = ("--dtype", "float32", "--enable-lora", "--max-loras", 2, "--max-lora-rank", 16, "--num-kv-blocks", 512,
             "--shutdown-timeout", 3, "--lora-modules", f"a0={adapters['a0']}",
             json.dumps({"name": "a1", "path": str(adapters["a1"]), "base_model_name": BASE}), f"a2={adapters['a2']}")
    served = start_serve(str(base), root / "serve.log", extra=flags, served_model_name=BASE)
    try:
        yield served, base, adapters, big
    finally:
        served.stop()


def _oracle_text(base, adapter, max_tokens: int) -> str:
    """peft's merged model's greedy continuation of PROMPT, as text."""
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    ids = tok.encode(PROMPT).ids
    model = merged_model(base, adapter)
    out = []
    with torch.no_grad():
        for _ in range(max_tokens):
            out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return tok.decode(out)


def test_adapters_by_name_answer_as_peft_merged(lora_server):
    served, base, adapters, _ = lora_server
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {BASE, "a0", "a1", "a2"}
    assert cards["a1"].parent == BASE and cards[BASE].parent is None
    texts = {}
    for name in (BASE, "a0", "a1", "a2"):
        reply = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0,
                                          extra_body={"add_special_tokens": False, "ignore_eos": True})
        assert reply.model == name
        texts[name] = reply.choices[0].text.strip()
        expected = _oracle_text(base, adapters.get(name), 6)
        assert texts[name] == expected, (name, texts[name], expected)
    assert len(set(texts.values())) == 4  # every adapter changes the answer
    # the Anthropic protocol is an adapter over the same path: the adapter's name reaches the engine there too
    message = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0).messages.create(
        model="a0", max_tokens=4, messages=[{"role": "user", "content": "w5 w6"}])
    assert message.model == "a0" and message.content


def test_load_and_unload_endpoints(lora_server):
    served, base, adapters, big = lora_server
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with httpx.Client(base_url=served.url, timeout=60) as http:
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": str(adapters["a3"])})
        assert loaded.status_code == 200 and "added successfully" in loaded.text
        assert "a3" in {m.id for m in client.models.list().data}
        reply = client.completions.create(model="a3", prompt=PROMPT, max_tokens=4, temperature=0,
                                          extra_body={"add_special_tokens": False, "ignore_eos": True})
        assert reply.choices[0].text.strip() == _oracle_text(base, adapters["a3"], 4)
        for body, status, words in (
                ({"lora_name": "a3", "lora_path": str(adapters["a3"])}, 400, "already been loaded"),
                ({"lora_name": "wide", "lora_path": str(big)}, 400, "above --max-lora-rank 16"),
                ({"lora_name": "gone", "lora_path": str(base / "nope")}, 400, "no such directory"),
                ({"lora_name": "nopath"}, 400, "lora_path"),
        ):
            answer = http.post("/v1/load_lora_adapter", json=body)
            assert answer.status_code == status, answer.text
            error = answer.json()["error"]
            assert words in error["message"] and error["type"], error
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"}).status_code == 200
        missing = http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
        assert missing.status_code == 404 and "cannot be found" in missing.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as gone:
        client.completions.create(model="a3", prompt=PROMPT, max_tokens=2)
    assert gone.value.body["code"] == "model_not_found"
    assert_serving(served, BASE)


def test_load_across_adapters_with_disconnects(lora_server):
    """Clients of the base model and three adapters at once (two slots: the engine swaps adapters while
    requests wait for a slot), a quarter of the streams cut after a few chunks: no 5xx, no client failure,
    every stream ends with [DONE]; then an ordinary request is answered."""
    served = lora_server[0]

    async def go():
        return await asyncio.gather(*(run_clients(served.url, name, clients=4, duration_s=8, seed=i,
                                                  disconnect_fraction=0.25, request_timeout_s=120,
                                                  drain_timeout_s=120)
                                      for i, name in enumerate((BASE, "a0", "a1", "a2"))))

    for tally in asyncio.run(go()):
        summary = json.dumps(tally.summary())[:3000]
        assert set(tally.statuses) <= {"200"} and tally.requests > 0, summary + tail(served)
        assert not tally.client_exceptions and tally.in_band_errors == tally.missing_done == 0, summary + tail(served)
    assert_serving(served, "a2")


def test_a_refused_lora_module_stops_the_start_with_the_reason(lora_server):
    """``--lora-modules`` are checked before the server serves (``conveyor serve`` exits with this message)."""
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.server.app import build_app

    _, base, adapters, big = lora_server
    engine = LLMEngine(model=str(base), dtype="float32", enable_lora=True, num_kv_blocks=64)
    with pytest.raises(ValueError, match="--lora-modules big=.*rank 32 is above --max-lora-rank 16"):
        build_app(engine, BASE, lora_modules=[("a0", str(adapters["a0"])), ("big", str(big))])
    bare = LLMEngine(model=str(base), dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        build_app(bare, BASE, lora_modules=[("a0", str(adapters["a0"]))])
