"""``conveyor chat``: a terminal chat that streams the reply as it is generated and keeps the conversation.

It talks to an engine in this process (``--model``, default SmolLM2-135M-Instruct) or to a running
OpenAI-compatible server (``--url http://127.0.0.1:8000``, conveyor's or any other). Each line you type is a user
turn; ``/reset`` starts a new conversation, ``/exit`` (or end of input) quits. With input from a pipe, each line
is one turn and the replies are printed in order, so ``echo "Hi" | conveyor chat`` works in scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator


class EngineChat:
    """Replies from an ``LLMEngine`` in this process, token by token."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.name = engine.model_info.name

    def stream(self, messages: list[dict], params: dict) -> Iterator[str]:
        from conveyor.core.sampling_params import SamplingParams
        from conveyor.engine.chat import render_chat

        ids = render_chat(self.engine.tokenizer, messages)
        request_id = self.engine.add_request(None, {"prompt_token_ids": ids}, SamplingParams(**params))
        sent = 0
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    text = out.outputs[0].text
                    yield text[sent:]
                    sent = len(text)
                    if out.finished:
                        return
        finally:  # an interrupted reply (Ctrl-C) frees its KV blocks
            if self.engine.has_unfinished_requests():
                self.engine.abort_request(request_id)


class HTTPChat:
    """Replies from an OpenAI-compatible server's streaming ``/v1/chat/completions``."""

    def __init__(self, url: str, model: str | None, api_key: str | None, timeout: float) -> None:
        import httpx

        self.url = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self.name = model or self._first_model()

    def _first_model(self) -> str:
        resp = self.client.get("/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]

    def stream(self, messages: list[dict], params: dict) -> Iterator[str]:
        import httpx

        try:
            yield from self._stream(messages, params)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"{self.url}: {exc}") from exc

    def _stream(self, messages: list[dict], params: dict) -> Iterator[str]:
        body = {"model": self.name, "messages": messages, "stream": True, **params}
        with self.client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text}")
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", str(chunk["error"])))
                for choice in chunk.get("choices", []):
                    yield choice.get("delta", {}).get("content") or ""


def add_chat_parser(sub) -> None:
    from conveyor.engine.args import EngineArgs

    p = sub.add_parser("chat", help="chat in the terminal with the model (in this process, or with --url a server)")
    p.add_argument("--url", default=None, help="an OpenAI-compatible server to talk to instead of a local engine")
    p.add_argument("--api-key", default=None, help="with --url: the server's API key")
    p.add_argument("--served-model", default=None, help="with --url: the model name to ask for (default: the "
                   "server's first model)")
    p.add_argument("--system", default=None, help="a system message to start every conversation with")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=600.0, help="with --url: seconds to wait for a reply")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_chat)


def run_chat(ns: argparse.Namespace) -> int:
    if ns.url:
        import httpx

        try:
            backend = HTTPChat(ns.url, ns.served_model, ns.api_key, ns.timeout)
        except httpx.HTTPError as exc:
            print(f"[conveyor chat] cannot reach {ns.url}: {exc}", file=sys.stderr)
            return 1
    else:
        from conveyor.engine.args import EngineArgs
        from conveyor.engine.llm_engine import LLMEngine
        from conveyor.models.embedded import warn_if_random

        backend = EngineChat(LLMEngine(EngineArgs.from_cli_args(ns)))
        warn_if_random(backend.name)
    interactive = sys.stdin.isatty()
    params = {"max_tokens": ns.max_tokens, "temperature": ns.temperature, "top_p": ns.top_p}
    first = [{"role": "system", "content": ns.system}] if ns.system else []
    messages = list(first)
    if interactive:
        print(f"chatting with {backend.name}; /reset starts over, /exit quits", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", flush=True, file=sys.stderr)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            messages = list(first)
            continue
        messages.append({"role": "user", "content": text})
        reply = []
        try:
            for piece in backend.stream(messages, params):
                reply.append(piece)
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print(" [interrupted]", end="")
        except (RuntimeError, ValueError, OSError) as exc:  # a refused or failed turn: say why, keep chatting
            messages.pop()
            print(f"[error] {exc}", file=sys.stderr)
            if not interactive:
                return 1
            continue
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
