"""router.replicas: the circuit breaker, a replica's view of its engine count."""

from __future__ import annotations

from router.replicas import CircuitBreaker, Replica


def test_breaker_opens_then_lets_one_probe_through():
    b = CircuitBreaker(failures=2, cooldown_s=10)
    b.on_failure(now=0)
    assert b.state == "closed" and b.allows(now=0)
    b.on_failure(now=1)
    assert b.state == "open" and not b.allows(now=5)
    assert b.allows(now=11)
    b.on_send(now=11)
    assert b.state == "half_open" and not b.allows(now=11)  # one probe at a time
    b.on_failure(now=12)
    assert b.state == "open" and not b.allows(now=15)
    b.on_send(now=23)
    b.on_success()
    assert b.state == "closed" and b.failures == 0 and b.allows(now=23)


def test_breaker_probe_abandoned_by_the_client_frees_the_slot():
    b = CircuitBreaker(failures=1, cooldown_s=10)
    b.on_failure(now=0)
    b.on_send(now=11)
    assert not b.allows(now=11)
    b.on_abandon()  # the probing client disconnected: no verdict
    assert b.state == "half_open" and b.allows(now=12)


def test_calls_finished_after_a_scrape_leave_the_engine_count():
    """A stale scrape must not make a finished call look like load, or bounded-load affinity
    places a session away from its home (where its prefix may already be)."""
    from router.scheduling.session_affinity import ring_scores

    reps = [Replica(f"http://r{i}") for i in range(4)]
    for r in reps:
        r.running, r.waiting = 0.0, 0.0
    idle = ring_scores("sess", [r.view() for r in reps], 1.25)
    home = next(r for r in reps if idle.get(r.name) == 1.0)  # where the session is placed
    home.running = 1.0  # scraped while a previous call was running there
    stale = ring_scores("sess", [r.view() for r in reps], 1.25)
    assert stale.get(home.name, 0.0) < 1.0  # the stale count pushes the placement away

    home.finished += 1  # the router saw that call end after the scrape
    assert home.view().running == 0.0 and home.view().load == 0.0
    fresh = ring_scores("sess", [r.view() for r in reps], 1.25)
    assert fresh[home.name] == 1.0

    home.finished_at_scrape = home.finished  # a new scrape starts from the engine's own count
    home.running = 3.0
    assert home.view().running == 3.0


def test_only_the_half_open_probe_is_marked_as_the_probe():
    from router.replicas import CircuitBreaker

    b = CircuitBreaker(failures=1, cooldown_s=5.0)
    assert b.on_send(now=0.0) is False  # closed: an ordinary call
    b.on_failure(now=0.0)  # opens
    assert not b.allows(now=1.0)
    assert b.allows(now=6.0) and b.on_send(now=6.0) is True  # the one probe
    assert not b.allows(now=6.1)  # a second call must wait for the probe's verdict
