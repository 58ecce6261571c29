"""The polling sleep of the serve layer: short while work flows, backing off when idle, cut short by a wake-up."""

from __future__ import annotations

import threading
import time

from fanstore.serve.polling import Backoff


def idle_rounds(backoff: Backoff, count: int) -> None:
    """`count` idle rounds without sleeping them: what sleep() does to the delay when nothing wakes it."""
    for _ in range(count):
        backoff._delay = min(backoff._delay * 1.5, backoff.longest)


def test_an_idle_poller_backs_off_to_the_longest_sleep_once_the_linger_is_over():
    backoff = Backoff(shortest=20e-6, longest=2e-3, linger=0.2, linger_longest=100e-6)
    assert backoff.next_delay() == 20e-6
    idle_rounds(backoff, 40)
    start = time.monotonic()
    backoff._last_work = start
    assert backoff.next_delay(now=start + 0.1) == 100e-6  # a burst of requests may still be on its way
    assert backoff.next_delay(now=start + 0.3) == 2e-3  # idle: a few percent of a core
    assert backoff.next_delay(longest=500e-6, now=start + 0.3) == 500e-6


def test_work_brings_the_sleep_back_to_the_shortest():
    backoff = Backoff(shortest=20e-6, longest=2e-3)
    idle_rounds(backoff, 40)
    backoff.progressed()
    assert backoff.next_delay() == 20e-6


def test_a_wake_up_cuts_a_long_sleep_short_and_counts_as_work():
    backoff = Backoff(shortest=5.0, longest=5.0, linger=0.0, spin=0.0)
    timer = threading.Timer(0.05, backoff.wake)
    timer.start()
    started = time.monotonic()
    backoff.sleep()
    assert time.monotonic() - started < 4.0
    timer.join()
    backoff.wake()
    backoff.wake()  # a second wake-up before the sleep is one pending wake-up, not an error
    started = time.monotonic()
    backoff.sleep()
    assert time.monotonic() - started < 4.0


def test_one_pending_wake_up_ends_one_sleep_only():
    backoff = Backoff(shortest=0.3, longest=0.3, linger=0.0, spin=0.0)
    backoff.wake()
    backoff.wake()
    backoff.sleep()  # ends at once
    started = time.monotonic()
    backoff.sleep()  # nothing pending: sleeps its full delay
    assert time.monotonic() - started >= 0.2


def test_right_after_work_the_poller_yields_instead_of_sleeping_then_sleeps_again():
    backoff = Backoff(shortest=0.3, longest=0.3, linger=0.0, spin=0.5)
    backoff.progressed()
    started = time.monotonic()
    for _ in range(100):
        backoff.sleep()  # within the spin: each returns at once, the next poll comes right after
    assert time.monotonic() - started < 0.25
    backoff.wake()
    backoff.sleep()  # a wake-up during the spin is taken, and counts as work
    assert backoff._wakeup.locked()
    backoff._last_work = time.monotonic() - 1.0  # the spin is over
    started = time.monotonic()
    backoff.sleep()
    assert time.monotonic() - started >= 0.2
