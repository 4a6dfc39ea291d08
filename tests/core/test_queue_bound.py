"""``QueueBound`` (``--max-num-queued-reqs``): what waits is what will not find a free seat at the next step; a
request bigger than every seat plus the bound is refused with its reason."""

from __future__ import annotations

from conveyor.core.policies.queue_bound import QueueBound


def test_room_counts_only_what_will_not_find_a_seat():
    bound = QueueBound(bound=2, max_num_seqs=4)
    assert bound.max_seqs_per_request == 6
    assert bound.has_room(num_seqs=6, num_running=0, num_waiting=0)  # 4 seats + 2 waiting
    assert not bound.has_room(num_seqs=7, num_running=0, num_waiting=0)
    assert bound.has_room(num_seqs=2, num_running=4, num_waiting=0)  # no seat free: both wait
    assert not bound.has_room(num_seqs=1, num_running=4, num_waiting=2)
    assert bound.has_room(num_seqs=1, num_running=3, num_waiting=2)  # the free seat takes one of the three


def test_a_request_no_batch_can_hold_names_why():
    bound = QueueBound(bound=2, max_num_seqs=4)
    assert bound.never_admits(6) is None
    assert bound.never_admits(7) == "n is 7, more than this server can ever admit at once (6: max_num_seqs 4 + " \
                                    "max_num_queued_reqs 2)"
