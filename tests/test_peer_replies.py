"""How a rank reads a peer's reply to a request for blobs (fanstore/serve/peer_messages.py, hand_out_reply): each read
gets its blob, or why it did not come, and a blob the peer could not give costs that blob alone. The replies
themselves go over real MPI in tests/serve_remote_blobs.py and tests/test_serve.py."""

from __future__ import annotations

import pytest

from fanstore.core.chunk_source import BlobRead
from fanstore.errors import ChunkCorrupt, ChunkUnavailable
from fanstore.serve.peer_messages import (MAX_BLOBS, REPLY_HEADER, REPLY_MAGIC, PeerCounters, error_reply,
                                          hand_out_reply, partial_reply, reply_room)
from fanstore.serve.statuses import RequestRefused, Status, status_error, status_of

OK, REFUSED, UNAVAILABLE, CORRUPT, PARTIAL = (Status.OK, Status.REFUSED, Status.UNAVAILABLE, Status.CORRUPT,
                                             Status.PARTIAL)


class Outcomes:
    """Reads of blobs of `lengths` bytes (chunk 1, offsets 0, 100, ...), and what each one was given."""

    def __init__(self, *lengths: int) -> None:
        self.got: dict[int, object] = {}
        self.reads = [BlobRead(1, 100 * number, length, self._done_for(number))
                      for number, length in enumerate(lengths)]

        self.kinds: dict[int, type] = {}  # the error's class, for each read that got one

    def _done_for(self, number: int):
        def done(blob, error) -> None:
            self.got[number] = bytes(blob) if error is None else str(error)
            if error is not None:
                self.kinds[number] = type(error)
        return done


def receive(reply: bytes, reads: list[BlobRead]) -> tuple[bytearray, int]:
    """The asker's receive buffer, as posted for `reads`, holding `reply`."""
    buffer = bytearray(reply_room(sum(read.length for read in reads), len(reads)))
    assert len(reply) <= len(buffer), "a reply longer than the receive fails in MPI itself"
    buffer[: len(reply)] = reply
    return buffer, len(reply)


def test_every_blob_comes_one_after_the_other():
    asked, counters = Outcomes(3, 2), PeerCounters()
    hand_out_reply(1, asked.reads, *receive(REPLY_HEADER.pack(REPLY_MAGIC, OK) + b"abcde", asked.reads), counters)
    assert asked.got == {0: b"abc", 1: b"de"}
    assert (counters.fetched, counters.fetched_bytes, counters.failed) == (2, 5, 0)


def test_a_blob_the_peer_could_not_give_costs_that_blob_alone():
    asked, counters = Outcomes(3, 4, 2, 5), PeerCounters()
    statuses = bytes([OK, CORRUPT, OK, UNAVAILABLE])
    reply = partial_reply(statuses, [b"abc", b"de"], "chunk 1 at 100: fails its checksum", 14)
    hand_out_reply(1, asked.reads, *receive(reply, asked.reads), counters)
    assert asked.got[0] == b"abc" and asked.got[2] == b"de"
    assert asked.got[1] == "rank 1 found corrupt chunk 1 at 100: chunk 1 at 100: fails its checksum"
    assert asked.got[3] == "rank 1 could not read chunk 1 at 300"  # the reason is the first failed blob's
    assert asked.kinds == {1: ChunkCorrupt, 3: ChunkUnavailable}  # one table: a peer's CORRUPT is corrupt
    assert (counters.fetched, counters.fetched_bytes, counters.failed) == (2, 5, 2)


def test_the_reason_is_cut_to_what_the_receive_still_holds():
    lengths = [2000] * (MAX_BLOBS - 1) + [1]
    asked = Outcomes(*lengths)
    statuses = bytes([OK] * (MAX_BLOBS - 1) + [CORRUPT])
    reply = partial_reply(statuses, [b"x" * 2000] * (MAX_BLOBS - 1), "a reason far longer than one byte", sum(lengths))
    hand_out_reply(1, asked.reads, *receive(reply, asked.reads), PeerCounters())
    assert all(asked.got[number] == b"x" * 2000 for number in range(MAX_BLOBS - 1))
    assert asked.got[MAX_BLOBS - 1] == f"rank 1 found corrupt chunk 1 at {100 * (MAX_BLOBS - 1)}: a"


def test_a_reply_with_no_blob_fails_every_read_with_its_reason():
    asked, counters = Outcomes(3, 2), PeerCounters()
    hand_out_reply(1, asked.reads, *receive(error_reply(1, "chunk 9 at 0 is not a blob of this rank"), asked.reads),
                   counters)
    assert asked.got == {number: "rank 1 refused a request for 2 blobs: chunk 9 at 0 is not a blob of this rank"
                         for number in (0, 1)}
    assert asked.kinds == {0: ChunkUnavailable, 1: ChunkUnavailable}
    assert (counters.fetched, counters.failed) == (0, 2)
    corrupt = Outcomes(3)
    hand_out_reply(2, corrupt.reads, *receive(error_reply(CORRUPT, "its copy is cut short"), corrupt.reads),
                   PeerCounters())
    assert corrupt.got == {0: "rank 2 found corrupt chunk 1 at 0: its copy is cut short"}
    assert corrupt.kinds == {0: ChunkCorrupt}


def test_malformed_replies_fail_every_read_and_hand_out_nothing():
    header = REPLY_HEADER.pack(REPLY_MAGIC, OK)
    partial = REPLY_HEADER.pack(REPLY_MAGIC, PARTIAL)
    for reply, lengths in [
        (header + b"abcd", (3, 2)),  # a blob short
        (header + b"abcdef", (3, 2)),  # a byte too many
        (partial + bytes([OK, CORRUPT]) + b"ab", (3, 2)),  # says blob 0 came, carries 2 of its 3 bytes
        (partial + bytes([OK]), (3, 2)),  # shorter than its statuses
        (partial + bytes([CORRUPT]), (3,)),  # PARTIAL answers only a request for several blobs
        (b"FSRQ" + bytes(4) + b"abcde", (3, 2)),  # not a reply
        (b"FS", (3, 2)),
    ]:
        asked, counters = Outcomes(*lengths), PeerCounters()
        hand_out_reply(1, asked.reads, *receive(reply, asked.reads), counters)
        assert all("sent a malformed reply" in str(got) for got in asked.got.values()), (reply, asked.got)
        assert set(asked.kinds.values()) == {ChunkUnavailable}, reply
        assert len(asked.got) == len(lengths) and (counters.fetched, counters.failed) == (0, len(lengths))


@pytest.mark.parametrize("status, error", [(REFUSED, ChunkUnavailable), (UNAVAILABLE, ChunkUnavailable),
                                           (CORRUPT, ChunkCorrupt), (99, ChunkUnavailable)])
def test_one_table_from_statuses_to_errors(status, error):
    """What a peer's reply and the node endpoint's reply say map to the same errors, each naming the chunk; and
    the errors an answerer meets map to the statuses that come back to them."""
    made = status_error(status, "the reason", 7)
    assert type(made) is error and made.chunk_id == 7 and str(made) == "the reason"
    assert str(status_error(status, "", 7, "rank 3", "chunk 7 at 0")).startswith("rank 3 ")
    if status != 99:
        back = RequestRefused("not a blob") if status == REFUSED else made
        assert status_of(back) == status
    assert isinstance(RequestRefused("x"), ValueError)  # a request naming bytes that are not served is bad input


@pytest.mark.parametrize(("retries", "seconds"), [(15, 924.6), (3, 3.0), (9, 204.6), (0, 0.2)])
def test_tcp_give_up_time_follows_the_kernels_model(tmp_path, retries, seconds) -> None:
    """A peer is lost for good at half of what TCP waits before it gives a connection up (remote_blobs.py): the
    kernel's model for net.ipv4.tcp_retries2, from 200 ms doubling up to 120 s; an unreadable setting is the
    default, 15."""
    from fanstore.serve.options import PeerOptions, tcp_give_up_seconds

    setting = tmp_path / "tcp_retries2"
    setting.write_text(f"{retries}\n")
    assert tcp_give_up_seconds(str(setting)) == pytest.approx(seconds)
    assert tcp_give_up_seconds(str(tmp_path / "missing")) == pytest.approx(924.6)
    assert PeerOptions(lost_after=7.0).lost_after_seconds() == 7.0
