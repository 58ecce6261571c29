"""A datagram that wakes a rank's MPI thread when a message has been sent to it.

MPI offers no wait that sleeps until a message comes without spinning a core, so the MPI thread polls between
sleeps (polling.Backoff). On these VMs each wake from a timed sleep costs 30-50 us of CPU: a rank either wakes
often, and burns a tenth of a core while it lingers after work, or answers a request late. With doorbells, a rank
that sends a request or a reply also sends an empty UDP datagram to the receiver's bell, and a rank with nothing to
do sleeps in poll() on its own bell until it rings. The message itself still goes over MPI. The datagram carries
nothing, so a lost one (UDP promises nothing) only costs the receiver's next timed wake.

Bells are on for the whole job or for no rank: each rank binds one on its host's address (the loopback address
when every rank runs on this one host), the ranks exchange addresses (a non-blocking allgather), every rank rings
every other, and the bells stay on only if every rank heard every other within CHECK_SECONDS. Otherwise (no
address, a firewall, a loopback address on a job spanning hosts) every rank polls as before. A rank rings again,
every RING_AGAIN seconds, each rank that has not acknowledged its ring, and acknowledges every ring it hears until
every rank is done: rung once, a single datagram lost on a lossy link (1-10% of them, every node reading at once)
turned the bells off for the whole job.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import select
import socket
import struct
import time
from typing import Any, Sequence

log = logging.getLogger("fanstore.serve")

# What each rank tells the others: bound (1) or not (0), address family (4 or 6), port, address, host digest.
RECORD = struct.Struct("<BBH16s8s")
CHECK = struct.Struct("<4sI")  # the start-up ring, and its acknowledgement: magic, the ringing rank
CHECK_MAGIC, HEARD_MAGIC = b"FSBL", b"FSBA"
CHECK_SECONDS = 2.0
RING_AGAIN = 0.05  # seconds between start-up rings of a rank that has not acknowledged
LOOPBACK = "127.0.0.1"
_PROBE_ADDRESS = ("192.0.2.1", 9)  # TEST-NET-1: connecting a UDP socket to it sends nothing, only picks a route


class Doorbell:
    """This rank's bell (a non-blocking UDP socket) and the addresses of the others'."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._own = sock.getsockname()[:2]
        self._peers: list[Any] = []
        # The start-up check's: this rank, the ranks heard from and those that acknowledged its ring.
        self._check_rank = -1
        self._heard: set[int] = set()
        self._acknowledged: set[int] = set()
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)

    @classmethod
    def bind(cls, host: str | None = None) -> "Doorbell":
        """A bell on `host`'s address (default: this host's, as other hosts would reach it); OSError if none."""
        family, address = _reachable_address(host)
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.bind((address, 0))
        except OSError:
            sock.close()
            raise
        return cls(sock)

    @property
    def address(self) -> tuple[str, int]:
        return self._own

    def record(self) -> bytes:
        """This bell's address, packed for the exchange."""
        address = ipaddress.ip_address(self._own[0])
        return RECORD.pack(1, address.version, self._own[1], address.packed, host_digest())

    def connect(self, addresses: Sequence[tuple[str, int]]) -> None:
        """The bell of each rank, by rank (this rank's own among them)."""
        self._peers = list(addresses)

    def ring(self, peer: int) -> None:
        """Wake `peer`; never blocks and never fails (a full buffer means the peer has rings to read already)."""
        try:
            self._sock.sendto(b"", self._peers[peer])
        except OSError:
            pass

    def ring_self(self) -> None:
        """Wake this rank's own sleeping thread (another thread handed it work)."""
        try:
            self._sock.sendto(b"", self._own)
        except OSError:
            pass

    def wait(self, seconds: float) -> bool:
        """Sleep until the bell rings or `seconds` pass; True if it rang (every ring so far is taken).

        poll() takes whole milliseconds, rounded up, so a shorter wait lasts about 1.1 ms: a rung poller's shortest
        sleeps (polling.py) are really 1 ms. select() would keep microseconds; measured with 3 ranks reading 128 KiB
        files from each other, it gained nothing with a CPU per rank (the spin after work covers the short waits)
        and cost 3-4% of remote files/s with every rank on one CPU, where shorter sleeps wake the serving ranks
        more often."""
        if not self._poller.poll(seconds * 1e3):
            return False
        self._drain()
        return True

    def _drain(self) -> list[bytes]:
        rings = []
        while True:
            try:
                rings.append(self._sock.recv(64))
            except (BlockingIOError, InterruptedError):
                return rings
            except OSError:  # an ICMP error from an earlier send, reported here: not a ring
                continue

    def check(self, rank: int, size: int, seconds: float = CHECK_SECONDS) -> bool:
        """Ring every other rank with this rank's number, again every RING_AGAIN seconds until it acknowledges;
        True once each other rank has been heard and has acknowledged. Then `answer_checks` until every rank is done:
        a rank that is may still be rung by one whose acknowledgement was lost."""
        self._check_rank, self._heard, self._acknowledged = rank, set(), set()
        others = set(range(size)) - {rank}
        deadline = time.monotonic() + seconds
        while self._heard != others or self._acknowledged != others:
            now = time.monotonic()
            if now >= deadline:
                return False
            for peer in others - self._acknowledged:
                if not self._send_check(CHECK_MAGIC, peer):
                    return False
            self._poller.poll(min(RING_AGAIN, deadline - now) * 1e3)
            self.answer_checks()
        return True

    def answer_checks(self) -> None:
        """Take the start-up rings and acknowledgements that came, acknowledging each ring."""
        for ring in self._drain():
            if len(ring) != CHECK.size:
                continue
            magic, sender = CHECK.unpack(ring)
            if sender == self._check_rank or sender >= len(self._peers):
                continue
            if magic == CHECK_MAGIC:
                self._heard.add(sender)
                self._send_check(HEARD_MAGIC, sender)
            elif magic == HEARD_MAGIC:  # its answer came: each way works
                self._heard.add(sender)
                self._acknowledged.add(sender)

    def _send_check(self, magic: bytes, peer: int) -> bool:
        try:
            self._sock.sendto(CHECK.pack(magic, self._check_rank), self._peers[peer])
            return True
        except OSError:
            return False

    def close(self) -> None:
        self._sock.close()


def host_digest() -> bytes:
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=8).digest()


def addresses_of(records: Sequence[bytes]) -> list[tuple[str, int]] | None:
    """Every rank's bell address from the gathered records, or None when bells cannot work for this job: a rank
    without one, or a loopback address while the ranks are on more than one host."""
    unpacked = [RECORD.unpack(record) for record in records]
    if not all(bound for bound, *_ in unpacked):
        return None
    addresses = []
    for _, version, port, packed, _ in unpacked:
        address = ipaddress.ip_address(packed[:4] if version == 4 else packed)
        if address.is_loopback and len({digest for *_, digest in unpacked}) > 1:
            return None
        addresses.append((str(address), port))
    return addresses


def bell_host(digests: Any) -> str | None:
    """Where to bind the bell, given every rank's host digest: the loopback address when the whole job is on this
    one host (a laptop, a test), so its rings never leave the loopback interface; else this host's own address."""
    return LOOPBACK if len({bytes(digest) for digest in digests}) == 1 else None


def _reachable_address(host: str | None) -> tuple[socket.AddressFamily, str]:
    """The address other hosts reach this one at: the host name's, unless that is a loopback address (Debian maps
    the host name to 127.0.1.1), then the one the routing table gives for outgoing traffic."""
    name = socket.gethostname() if host is None else host
    found = socket.getaddrinfo(name, None, type=socket.SOCK_DGRAM)
    for family, _, _, _, sockaddr in found:
        if not ipaddress.ip_address(sockaddr[0]).is_loopback:
            return family, sockaddr[0]
    if host is None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(_PROBE_ADDRESS)
                return socket.AF_INET, probe.getsockname()[0]
            except OSError:
                pass
    family, _, _, _, sockaddr = found[0]
    return family, sockaddr[0]


def open_doorbell(comm: Any, enabled: bool = True) -> Doorbell | None:
    """Every rank's bell, agreed across the job (a collective: every rank calls it, at start-up, from the thread
    that owns MPI then); None on every rank when any rank's bell cannot ring the others."""
    import numpy as np
    from mpi4py import MPI

    from .polling import first_failed_rank, wait_all

    rank, size = comm.Get_rank(), comm.Get_size()
    bell: Doorbell | None = None
    mine = bytes(RECORD.size)
    # Every rank takes part in every collective here, whatever its own `enabled` says.
    own_digest = np.frombuffer(host_digest(), dtype=np.uint8)
    digests = np.zeros(size * len(own_digest), dtype=np.uint8)
    wait_all([comm.Iallgather([own_digest, MPI.BYTE], [digests, MPI.BYTE])])
    if enabled:
        try:
            bell = Doorbell.bind(bell_host(digests.reshape(size, -1)))
            mine = bell.record()
        except OSError as exc:
            log.info("rank %d: no doorbell (%s); polling without one", rank, exc)
    gathered = np.zeros(size * RECORD.size, dtype=np.uint8)
    wait_all([comm.Iallgather([np.frombuffer(mine, dtype=np.uint8), MPI.BYTE], [gathered, MPI.BYTE])])
    raw = gathered.tobytes()
    addresses = addresses_of([raw[r * RECORD.size : (r + 1) * RECORD.size] for r in range(size)])
    if addresses is None or bell is None:  # every rank sees the same records, so every rank stops here
        if bell is not None:
            bell.close()
        return None
    bell.connect(addresses)
    heard = bell.check(rank, size)
    failed = first_failed_rank(comm, not heard, on_idle=bell.answer_checks)
    if failed is not None:
        if rank == 0:
            log.warning("doorbells off: rank %d did not hear every other rank's within %g s (a firewall on UDP?); "
                        "polling without them", failed, CHECK_SECONDS)
        bell.close()
        return None
    bell._drain()  # rings of the check that came after this rank had heard enough
    return bell
