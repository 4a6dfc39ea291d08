"""A batch input file: JSONL, one request per line, in OpenAI's form
``{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}``.

``check_input_file`` reads a whole file once and refuses it, naming the line, when a line is not a JSON object of
that form, names an endpoint the Batch API does not serve here, repeats a ``custom_id``, asks for a stream, or the
file holds no request or too many; ``read_lines`` reads it again, line by line, for the runner. A line's ``body`` is
checked by its endpoint when it runs (a bad body is that line's error, as on OpenAI's Batch API).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_CUSTOM_ID_CHARS = 512


class InputFileError(ValueError):
    """A batch input file that cannot run; ``line`` (1-based) where the first problem is, None for the file."""

    def __init__(self, message: str, line: int | None = None, code: str = "invalid_input_file") -> None:
        super().__init__(message if line is None else f"line {line}: {message}")
        self.line = line
        self.code = code


@dataclass(frozen=True)
class BatchLine:
    index: int  # 0-based among the file's requests (blank lines are not counted)
    custom_id: str
    url: str
    body: dict


def read_lines(path: str) -> Iterator[BatchLine]:
    """The requests of a file that ``check_input_file`` accepted, in order."""
    with open(path, "rb") as f:
        index = 0
        for raw in f:
            if raw.strip():
                item = json.loads(raw)
                yield BatchLine(index, item["custom_id"], item["url"], item["body"])
                index += 1


def check_input_file(path: str, max_lines: int) -> tuple[str, int]:
    """(the endpoint every line names, the number of requests) of a valid input file; InputFileError otherwise."""
    seen: set[str] = set()
    endpoint = None
    count = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            url = _check_line(raw, number, seen)
            if endpoint is None:
                endpoint = url
            elif url != endpoint:
                raise InputFileError(f"url is {url!r} but earlier lines name {endpoint!r}: a batch runs one endpoint",
                                     number, "mismatched_endpoint")
            count += 1
            if count > max_lines:
                raise InputFileError(f"the file holds more than {max_lines} requests, this server's limit per batch "
                                     "(--batch-max-lines)", number, "too_many_requests")
    if count == 0:
        raise InputFileError("the file holds no request (one JSON object per line)", None, "empty_file")
    return endpoint, count


def _check_line(raw: bytes, number: int, seen: set[str]) -> str:
    try:
        item = json.loads(raw)
    except UnicodeDecodeError:
        raise InputFileError("not UTF-8 text", number, "invalid_json_line") from None
    except json.JSONDecodeError as exc:
        raise InputFileError(f"not valid JSON ({exc.msg} at column {exc.colno})", number, "invalid_json_line") \
            from None
    if not isinstance(item, dict):
        raise InputFileError(f"must be a JSON object, got {type(item).__name__}", number, "invalid_json_line")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise InputFileError(f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID_CHARS} characters",
                             number, "missing_custom_id")
    if custom_id in seen:
        raise InputFileError(f"custom_id {custom_id[:80]!r} appears twice: each request needs its own",
                             number, "duplicate_custom_id")
    seen.add(custom_id)
    if item.get("method") != "POST":
        raise InputFileError(f"method must be \"POST\", got {str(item.get('method'))[:40]!r}", number,
                             "invalid_method")
    url = item.get("url")
    if url not in BATCH_ENDPOINTS:
        raise InputFileError(f"url {str(url)[:80]!r} is not an endpoint the Batch API serves here (one of "
                             f"{', '.join(BATCH_ENDPOINTS)})", number, "invalid_url")
    body = item.get("body")
    if not isinstance(body, dict):
        raise InputFileError("body must be a JSON object (the request to the endpoint)", number, "invalid_body")
    if body.get("stream") not in (None, False):
        raise InputFileError("body.stream must be false or absent: a batch request's answer is written whole",
                             number, "invalid_body")
    return url
