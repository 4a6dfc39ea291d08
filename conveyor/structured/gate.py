"""``GrammarGate``: constrained requests wait here, outside the scheduler, until their grammar has compiled.

Grammars compile on a thread of their own (``StructuredOutputs.compile`` returns a future), so a request with a
new schema never stalls the step loop. vLLM keeps the same wait inside its scheduler (``WAITING_FOR_FSM``);
here it is a queue of its own, which keeps futures out of the pure-Python core: the engine asks the gate, between
steps, which requests may enter the scheduler now.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future

from conveyor.core.request import Request


class GrammarGate:
    """Requests whose grammar is still compiling, in arrival order."""

    def __init__(self) -> None:
        self._waiting: list[tuple[Future, Request]] = []

    def hold(self, grammar: Future, request: Request) -> None:
        """Keep ``request`` until ``grammar`` (its compiled constraint) is done."""
        self._waiting.append((grammar, request))

    def admit_ready(self, admit: Callable[[Request], None]) -> dict[str, str]:
        """Pass every request whose grammar compiled to ``admit`` (the scheduler's ``add_request``), in arrival
        order; returns those whose grammar failed to compile (request id -> why), which never enter it."""
        if not self._waiting:
            return {}
        failed: dict[str, str] = {}
        still = []
        for grammar, request in self._waiting:
            if not grammar.done():
                still.append((grammar, request))
            elif grammar.exception() is not None:
                failed[request.request_id] = str(grammar.exception())
            else:
                admit(request)
        self._waiting = still
        return failed

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget these requests (aborted, or finished from outside before they ever ran)."""
        if self._waiting:
            ending = set(request_ids)
            self._waiting = [(g, r) for g, r in self._waiting if r.request_id not in ending]

    def __contains__(self, request_id: str) -> bool:
        return any(r.request_id == request_id for _, r in self._waiting)

    def __len__(self) -> int:
        return len(self._waiting)
