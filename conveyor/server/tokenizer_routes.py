"""The tokenizer's routes, in vLLM's shapes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``
(what lm-eval's ``tokenizer_backend=remote`` reads: the special tokens and the chat template, then it tokenizes
through the other two)."""

from __future__ import annotations

from fastapi import FastAPI

from conveyor.engine.chat import render_chat
from conveyor.engine.engine_client import EngineInfo
from conveyor.server.chat_plan import generation_prompt, messages_as_dicts
from conveyor.server.errors import bad_request
from conveyor.server.protocol import DetokenizeRequest, TokenizeRequest
from conveyor.server.served_models import ModelRouter


def tokenizer_info(info: EngineInfo) -> dict:
    """vLLM's ``/tokenizer_info``: the tokenizer's configuration as a client rebuilds it (special tokens, the chat
    template, the context length), and its class."""
    tok = info.tokenizer
    specials = [tok.decode([i], skip_special_tokens=False) for i in tok.all_special_ids]
    return {"tokenizer_class": type(tok).__name__, "bos_token": tok.bos_token or None,
            "eos_token": tok.eos_token or None, "pad_token": tok.pad_token,
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "additional_special_tokens": [s for s in specials if s not in (tok.bos_token, tok.eos_token)],
            "vocab_size": tok.vocab_size, "model_max_length": info.max_model_len,
            "chat_template": tok.chat_template}


def install_tokenizer_routes(app: FastAPI, served: ModelRouter) -> None:
    """``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` with the tokenizer of the model a request names
    (none: the server's first model), whatever its task."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ctx = await served.resolve(body.model, None)
        info = ctx.engine.info
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        messages = messages_as_dicts(body.messages) if body.messages is not None else None
        add_generation_prompt = generation_prompt(body)

        def run(e: EngineInfo) -> tuple[list[int], list[str] | None]:
            if messages is not None:
                ids = render_chat(e.tokenizer, messages, add_generation_prompt,
                                  add_special_tokens=bool(body.add_special_tokens),
                                  continue_final_message=body.continue_final_message)
            else:
                add = True if body.add_special_tokens is None else body.add_special_tokens
                ids = e.encode(body.prompt, add_special_tokens=add)
            strs = [e.tokenizer.decode([t], skip_special_tokens=False) for t in ids] if body.return_token_strs else None
            return ids, strs

        ids, strs = await ctx.tokenizer_call(run)
        return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ctx = await served.resolve(body.model, None)
        vocab = ctx.engine.info.model_info.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise bad_request(f"tokens must be integers in [0, {vocab})", "tokens")
        text = await ctx.tokenizer_call(lambda e: e.tokenizer.decode(body.tokens))
        return {"prompt": text}

    @app.get("/tokenizer_info")
    async def get_tokenizer_info():
        return await (await served.resolve(None, None)).tokenizer_call(tokenizer_info)
