"""``SyncLoadsInFlight``: a same-step load is in flight until every worker has reported its event;
one failure on any worker makes its requests broken (recomputed), never landed."""

from __future__ import annotations

from kvtriton.sync_loads import SyncLoadsInFlight


def test_a_load_lands_once_every_worker_reported_it():
    flight = SyncLoadsInFlight(world_size=2)
    flight.issued(7, ["a", "b"])
    flight.issued(8, ["c"])
    assert "a" in flight and "c" in flight and len(flight) == 2
    assert flight.reported({7: 1}, {}) == ([], [])  # one worker of two
    assert "a" in flight
    assert flight.reported({7: 1, 8: 1, 99: 2}, {}) == (["a", "b"], [])  # 99: not in flight
    assert "a" not in flight and "b" not in flight and "c" in flight


def test_a_failure_on_one_worker_makes_the_requests_broken():
    flight = SyncLoadsInFlight(world_size=2)
    flight.issued(3, ["r"])
    assert flight.reported({3: 1}, {3: 1}) == ([], ["r"])
    assert "r" not in flight and len(flight) == 0
    assert flight.reported({3: 1}, {}) == ([], [])  # a late report of a finished event
