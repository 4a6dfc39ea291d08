"""The waiting queue's bound (``--max-num-queued-reqs``) as a policy object beside the scheduler (as
``AdapterSlots`` and ``KVEvictor`` are): the engine asks whether a request's sequences may join and says why not."""

from __future__ import annotations


class QueueBound:
    """At most ``bound`` sequences wait for a seat: what will not find one of the ``max_num_seqs`` at the next
    step counts against it."""

    def __init__(self, bound: int, max_num_seqs: int) -> None:
        self.bound, self.max_num_seqs = bound, max_num_seqs

    @property
    def max_seqs_per_request(self) -> int:
        """The most sequences (``n`` x prompts) one request can ever bring: every seat plus the bound."""
        return self.bound + self.max_num_seqs

    def never_admits(self, num_seqs: int) -> str | None:
        """Why ``num_seqs`` sequences of one request can never be admitted at once (None: they can)."""
        if num_seqs <= self.max_seqs_per_request:
            return None
        return (f"n is {num_seqs}, more than this server can ever admit at once ({self.max_seqs_per_request}: "
                f"max_num_seqs {self.max_num_seqs} + max_num_queued_reqs {self.bound})")

    def has_room(self, num_seqs: int, num_running: int, num_waiting: int) -> bool:
        """Whether ``num_seqs`` more may join now (``num_waiting``: every sequence already waiting)."""
        free_seats = max(0, self.max_num_seqs - num_running)
        return num_waiting + num_seqs - free_seats <= self.bound
