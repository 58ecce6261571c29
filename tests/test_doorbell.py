"""Doorbells: a UDP datagram that wakes a rank's polling thread, checked at start-up, never needed for correctness."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from fanstore.serve.doorbell import LOOPBACK, RECORD, Doorbell, addresses_of, bell_host
from fanstore.serve.polling import Backoff


@pytest.fixture
def bells():
    """Two bells on this host, each knowing both addresses (ranks 0 and 1)."""
    pair = [Doorbell.bind("127.0.0.1"), Doorbell.bind("127.0.0.1")]
    for bell in pair:
        bell.connect([other.address for other in pair])
    yield pair
    for bell in pair:
        bell.close()


def test_a_ring_from_a_peer_cuts_a_long_sleep_short(bells):
    sleeper, ringer = bells
    backoff = Backoff(shortest=5.0, longest=5.0, linger=0.0, spin=0.0, bell=sleeper)
    timer = threading.Timer(0.05, ringer.ring, (0,))
    timer.start()
    started = time.monotonic()
    backoff.sleep()
    assert time.monotonic() - started < 4.0
    timer.join()
    assert backoff.next_delay() == 5.0  # rung: counted as work


def test_a_wake_up_from_another_thread_rings_the_own_bell_and_ends_one_sleep_only(bells):
    backoff = Backoff(shortest=0.3, longest=0.3, linger=0.0, spin=0.0, bell=bells[0])
    backoff.wake()
    backoff.wake()
    started = time.monotonic()
    backoff.sleep()  # ends at once, and takes every ring so far
    assert time.monotonic() - started < 0.2
    started = time.monotonic()
    backoff.sleep()  # nothing rang since: sleeps its full delay
    assert time.monotonic() - started >= 0.2


def test_wake_ups_before_the_sleeper_takes_them_send_one_datagram_and_a_later_one_rings_again(bells):
    """A reader hands the MPI thread work once a file: while one ring is on its way, more would only be syscalls.
    Once the sleeper has taken the rings, the next wake-up must ring again, or it would be lost."""
    backoff = Backoff(shortest=0.3, longest=0.3, linger=0.0, spin=0.0, bell=bells[0])
    for _ in range(5):
        backoff.wake()
    assert len(bells[0]._drain()) == 1
    bells[0].ring_self()  # stands for the ring just taken: the sleep ends at once and clears what was pending
    backoff.sleep()
    backoff.wake()
    started = time.monotonic()
    backoff.sleep()
    assert time.monotonic() - started < 0.2


def test_without_a_ring_the_sleep_ends_on_time(bells):
    backoff = Backoff(shortest=0.05, longest=0.05, linger=0.0, spin=0.0, bell=bells[0])
    started = time.monotonic()
    backoff.sleep()
    assert 0.04 <= time.monotonic() - started < 1.0


def test_a_rung_poller_has_no_linger_and_a_long_first_sleep(bells):
    plain, rung = Backoff.rung_by(None), Backoff.rung_by(bells[0])
    assert plain.bell is None and plain.linger > 0
    assert rung.bell is bells[0] and rung.linger == 0 and rung.next_delay() > plain.next_delay()


def test_the_start_up_check_hears_every_peer(bells):
    results: list[bool] = []
    threads = [threading.Thread(target=lambda rank=rank: results.append(bells[rank].check(rank, 2, seconds=5.0)))
               for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [True, True]


def test_the_start_up_check_fails_in_time_when_a_peer_never_rings(bells):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:  # bound, never rings, never reads
        silent.bind(("127.0.0.1", 0))
        bells[0].connect([bells[0].address, silent.getsockname()])
        started = time.monotonic()
        assert not bells[0].check(0, 2, seconds=0.3)
        assert time.monotonic() - started < 2.0


def test_a_ring_to_a_peer_that_is_gone_neither_blocks_nor_raises(bells):
    bells[0].connect([bells[0].address, ("127.0.0.1", 9)])  # nobody there: the kernel may report it later
    for _ in range(1000):
        bells[0].ring(1)
    assert not bells[0].wait(0.01)  # an error reported on the socket is not a ring


def record(address: str, port: int, host: bytes, bound: int = 1) -> bytes:
    import ipaddress

    ip = ipaddress.ip_address(address)
    return RECORD.pack(bound, ip.version, port, ip.packed, host)


def test_addresses_are_agreed_only_when_every_rank_can_be_rung():
    one_host = [record("127.0.1.1", 4000 + r, b"hostAAAA") for r in range(3)]
    assert addresses_of(one_host) == [("127.0.1.1", 4000), ("127.0.1.1", 4001), ("127.0.1.1", 4002)]
    spread = [record("10.0.0.1", 4000, b"hostAAAA"), record("fd00::2", 4001, b"hostBBBB")]
    assert addresses_of(spread) == [("10.0.0.1", 4000), ("fd00::2", 4001)]
    # A loopback address on a job spanning hosts would ring the wrong host: no bells for anyone.
    assert addresses_of([record("127.0.1.1", 4000, b"hostAAAA"), record("10.0.0.2", 4001, b"hostBBBB")]) is None
    # A rank that could not bind one.
    assert addresses_of([one_host[0], bytes(RECORD.size)]) is None


def test_a_job_on_one_host_rings_over_loopback_and_one_spanning_hosts_on_each_hosts_address():
    assert bell_host([b"hostAAAA"] * 3) == LOOPBACK
    assert bell_host([b"hostAAAA", b"hostAAAA", b"hostBBBB"]) is None
    bell = Doorbell.bind(bell_host([b"hostAAAA"] * 2))
    try:
        assert bell.address[0] == LOOPBACK
    finally:
        bell.close()
