"""The load suite's view of each protocol conveyor serves: how a chat request is written in it (``as_protocol``),
how its stream reads line by line (``read_line``) and how its whole answer ends (``finishes_of``). Finish reasons
are told in OpenAI's words ("stop", "length"), so one tally counts every protocol.

Nothing here imports conveyor (tests/helpers/load.py's rule: a script can drive a server of any checkout).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

ANTHROPIC_STOPS = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "stop", "max_tokens": "length"}
PROTOCOL_PATHS = ("/v1/messages", "/v1/responses", "/api/chat", "/api/generate")


@dataclass
class Line:
    """What one line of a stream says: an event (``data``), an in-band error, the end; finish reasons by choice;
    the completion tokens when it tells them."""

    event: dict | None = None
    error: dict | None = None
    done: bool = False
    finishes: dict[int, str] = field(default_factory=dict)
    completion_tokens: int | None = None


def read_line(path: str, line: str) -> Line | None:
    """One line of a stream of ``path`` (None: nothing to count: an SSE ``event:`` line, a blank line)."""
    if path.startswith("/api/"):  # NDJSON
        if not line.strip():
            return None
        data = json.loads(line)
        if "error" in data:
            return Line(error={"message": data["error"]})
        if data.get("done"):
            return Line(event=data, done=True, finishes={0: data.get("done_reason", "stop")},
                        completion_tokens=data.get("eval_count"))
        return Line(event=data)
    if not line.startswith("data: "):
        return None
    if line[6:] == "[DONE]":
        return Line(done=True)
    data = json.loads(line[6:])
    if path == "/v1/messages":
        return _anthropic(data)
    if path == "/v1/responses":
        return _responses(data)
    if "error" in data:
        return Line(error=data["error"])
    finishes = {c["index"]: c["finish_reason"] for c in data.get("choices") or [] if c.get("finish_reason")}
    usage = data.get("usage") or {}
    return Line(event=data, finishes=finishes, completion_tokens=usage.get("completion_tokens"))


def _anthropic(data: dict) -> Line:
    kind = data.get("type")
    if kind == "error":
        return Line(error=data["error"])
    if kind == "message_delta":
        return Line(event=data, finishes={0: ANTHROPIC_STOPS.get(data["delta"]["stop_reason"], "?")},
                    completion_tokens=data["usage"]["output_tokens"])
    return Line(event=data, done=kind == "message_stop")


def _responses(data: dict) -> Line:
    kind = data.get("type")
    if kind == "error":
        return Line(error=data)
    if kind in ("response.completed", "response.incomplete"):
        response = data["response"]
        return Line(event=data, done=True, finishes={0: "stop" if kind == "response.completed" else "length"},
                    completion_tokens=response["usage"]["output_tokens"])
    return Line(event=data)


def finishes_of(path: str, data: dict) -> tuple[list[tuple[int, str]], int]:
    """A whole answer's (index, finish reason) per choice and its completion tokens."""
    if path == "/v1/messages":
        return [(0, ANTHROPIC_STOPS.get(data["stop_reason"], "?"))], data["usage"]["output_tokens"]
    if path == "/v1/responses":
        return [(0, "stop" if data["status"] == "completed" else "length")], data["usage"]["output_tokens"]
    if path.startswith("/api/"):
        return [(0, data["done_reason"])], data["eval_count"]
    return [(c["index"], c["finish_reason"]) for c in data["choices"]], (data.get("usage") or {}).get(
        "completion_tokens", 0)


def as_protocol(path: str, chat: dict) -> dict:
    """A chat-completions body (one choice) written in the protocol of ``path``, with the same prompt, limit
    and sampling fields (each in that protocol's range and spelling)."""
    prompt = chat["messages"][-1]["content"]
    stream = chat.get("stream", False)
    if path == "/v1/messages":
        body = {"model": chat["model"], "max_tokens": chat["max_tokens"], "messages": chat["messages"],
                "stream": stream, "stop_sequences": chat.get("stop"), "top_p": chat.get("top_p"),
                "temperature": min(chat["temperature"], 1.0) if "temperature" in chat else None,
                "top_k": chat["top_k"] if chat.get("top_k", -1) >= 0 else None}
    elif path == "/v1/responses":
        body = {"model": chat["model"], "input": prompt, "max_output_tokens": chat["max_tokens"], "stream": stream,
                "temperature": chat.get("temperature"), "top_p": chat.get("top_p"), "store": stream}
    else:
        options = {"num_predict": chat["max_tokens"], "temperature": chat.get("temperature"),
                   "top_p": chat.get("top_p"), "top_k": chat.get("top_k"), "seed": chat.get("seed"),
                   "stop": chat.get("stop"), "repeat_penalty": chat.get("repetition_penalty"),
                   "presence_penalty": chat.get("presence_penalty"),
                   "frequency_penalty": chat.get("frequency_penalty")}
        body = {"model": chat["model"], "stream": stream, "options": {k: v for k, v in options.items()
                                                                     if v is not None}}
        body.update({"messages": chat["messages"]} if path == "/api/chat" else {"prompt": prompt})
    return {k: v for k, v in body.items() if v is not None}
