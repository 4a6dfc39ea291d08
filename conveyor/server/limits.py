"""Bounds at the edge of the server, their values and checks: the request body's size (enforced by
``body_limit.BodyLimitMiddleware``).

Plain Python: ``conveyor serve --help`` reads the defaults from here.
"""

from __future__ import annotations

# The largest request body the server reads (--max-request-body-bytes). The largest legitimate bodies are
# long-context prompts: 8K tokens of text are ~40 KB, 128K tokens ~600 KB as text or ~900 KB as token ids
# ("12345, " per token). 4 MiB holds several of those and stops a body of gigabytes after 4 MiB.
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
