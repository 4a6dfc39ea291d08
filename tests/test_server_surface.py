"""Parts of the OpenAI surface that clients send (issue #25 item 4): ``GET /v1/models/{id}``, CORS, chat's
``continue_final_message`` / ``add_generation_prompt`` / ``echo``, and ``stream_options.continuous_usage_stats``,
over real HTTP (uvicorn on 127.0.0.1) with the official ``openai`` client.

Two servers: the tiny Llama with its one-line template, served under a name with a slash (as HF names are), and
the embedded random-weights model, whose byte tokenizer and built-in ``DEFAULT_CHAT_TEMPLATE`` make every prompt
token one byte of the rendered text, so token counts say exactly what the template rendered.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers.server import serve_model

pytestmark = pytest.mark.slow  # a real model, engine or server: run by CI, skipped by -m "not slow"

TINY = "org/tiny"  # a slash, as in "HuggingFaceTB/SmolLM2-135M-Instruct": the route must take it


@pytest.fixture(scope="module")
def tiny(tiny_chat_dir):
    with serve_model(tiny_chat_dir, served_model_name=TINY) as (url, _):
        yield url


@pytest.fixture(scope="module")
def tiny_client(tiny):
    return openai.OpenAI(base_url=tiny + "/v1", api_key="none", max_retries=0)


# ---- GET /v1/models/{model} -------------------------------------------------------------------------------
def test_retrieve_a_model_returns_the_card_models_lists(tiny, tiny_client):
    (listed,) = tiny_client.models.list().data
    card = tiny_client.models.retrieve(TINY)  # sent as /v1/models/org%2Ftiny
    assert card.id == TINY and card.object == "model"
    assert card.model_dump() == listed.model_dump()  # the same object, max_model_len and all
    assert httpx.get(f"{tiny}/v1/models/{TINY}").json() == httpx.get(tiny + "/v1/models").json()["data"][0]


def test_retrieve_an_unknown_model_is_404_in_openai_shape(tiny, tiny_client):
    with pytest.raises(openai.NotFoundError) as info:
        tiny_client.models.retrieve("gpt-4o")
    assert info.value.code == "model_not_found" and "gpt-4o" in info.value.message
    for name in ("org", "org/tiny/extra", "ORG/TINY"):  # a prefix, a longer path, another case: not the model
        resp = httpx.get(f"{tiny}/v1/models/{name}")
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found", name
