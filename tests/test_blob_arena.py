"""The node's shared arena for remote blobs (fanstore/serve/blob_arena.py): slots given back exactly when nothing
refers to them, a reader's read-only mapping, and READS_SHARED over a real Unix socket, including a reader process
that dies holding blobs it was lent. A real `mpiexec -n 2 fanstore serve` job reading through the arena is
test_torch.py's test_a_few_training_steps_under_mpiexec_fanstore_serve."""

from __future__ import annotations

import errno
import gc
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import REPO
from fanstore.serve import node_endpoint
from fanstore.serve.blob_arena import SLOT_ALIGN, ArenaView, BlobArena
from fanstore.serve.blobs_ahead import BlobsAhead
from fanstore.serve.node_client import NodeConnection, NodeServeSource
from fanstore.serve.node_endpoint import NodeEndpoint
from fanstore.serve.node_protocol import (ARENA, OK, READS_SHARED, REFUSED, REPLY, REPLY_MAGIC, REQUEST,
                                          REQUEST_MAGIC, SHARED_ROW, TOKEN, BlobLookup)
from fanstore.serve.placement import BlobTable
from test_node_endpoint import (HalfRemote, Reader, blobs_of, dataset, endpoint, plan_bytes,  # noqa: F401
                                wait_until_true)


# --- the arena alone ------------------------------------------------------------------------------------------------

def test_a_slot_comes_back_when_its_last_view_goes_and_free_ranges_join_again():
    arena = BlobArena(64 * SLOT_ALIGN)
    first, second, third = arena.slot(100), arena.slot(SLOT_ALIGN), arena.slot(1)
    assert [arena.place(slot) for slot in (first, second, third)] == [0, 2 * SLOT_ALIGN, 3 * SLOT_ALIGN]
    assert arena.stats()["arena_used"] == 4 * SLOT_ALIGN
    piece = memoryview(first)[10:20]  # a view of a view keeps the slot
    del first
    gc.collect()
    assert arena.stats()["arena_slots"] == 3
    assert arena.place(piece) == 10
    del piece, third
    assert arena.stats() == {"arena_bytes": 64 * SLOT_ALIGN, "arena_used": SLOT_ALIGN, "arena_slots": 1,
                             "arena_full": 0}
    # First fit: the range the first slot left is taken again before the arena's end.
    again = arena.slot(2 * SLOT_ALIGN)
    assert arena.place(again) == 0
    del again, second
    assert arena.slot(64 * SLOT_ALIGN) is not None  # every range joined into one: the whole arena fits
    assert arena.place(b"elsewhere") == -1 and arena.place(np.zeros(8, np.uint8)) == -1
    arena.close()


def test_a_full_arena_says_so_and_counts_it():
    arena = BlobArena(4 * SLOT_ALIGN)
    held = arena.slot(3 * SLOT_ALIGN)
    assert arena.slot(2 * SLOT_ALIGN) is None and arena.stats()["arena_full"] == 1
    assert arena.slot(SLOT_ALIGN) is not None
    del held
    arena.close()


def test_slots_dropped_in_any_thread_come_back():
    arena = BlobArena(1 << 20)
    slots = [arena.slot(1000 + number) for number in range(200)]
    thread = threading.Thread(target=slots.clear)
    thread.start()
    thread.join()
    assert arena.stats()["arena_used"] == 0
    assert arena.slot(1 << 20) is not None
    arena.close()


def test_a_readers_mapping_sees_what_the_owner_wrote_and_cannot_write():
    arena = BlobArena(1 << 16)
    slot = arena.slot(5)
    slot[:] = np.frombuffer(b"hello", np.uint8)
    view = ArenaView(arena.reader_fd, arena.size)
    given_back: list[int] = []
    lent = view.lend(7, given_back.append)
    blob = lent[arena.place(slot) : arena.place(slot) + 5]
    assert bytes(blob) == b"hello" and blob.readonly
    with pytest.raises(TypeError):
        lent[0] = 1
    as_array = np.frombuffer(blob[1:], np.uint8)  # what a decoder may make of it keeps it too
    del lent, blob
    assert given_back == []
    assert bytes(as_array) == b"ello"
    del as_array
    assert given_back == [7]
    arena.close()


# --- READS_SHARED over the node socket --------------------------------------------------------------------------

class ArenaRemote(HalfRemote):
    """HalfRemote whose remote blobs arrive in slots of the arena, as the transport's replies do."""

    def __init__(self, dataset, arena: BlobArena) -> None:
        super().__init__(dataset)
        self.arena = arena

    def _answer(self, reads) -> None:
        for read in reads:
            data = self.chunks.read(read.chunk_id, read.offset, read.length)
            slot = self.arena.slot(len(data))
            slot[:] = np.frombuffer(data, np.uint8)
            read.done(memoryview(slot), None)


@pytest.fixture
def shared(dataset, tmp_path):
    arena = BlobArena(1 << 20)
    source = ArenaRemote(dataset, arena)
    lookup = BlobLookup(BlobTable.of(dataset.index), len(dataset.index.chunks))
    ahead = BlobsAhead(source.start_reads, lookup.locate)
    (tmp_path / "shared").mkdir()  # beside test_node_endpoint's `endpoint`, which binds in tmp_path
    node = NodeEndpoint(tmp_path / "shared", {"rank": 0}, source, lookup, ahead, arena)
    node.source, node.arena = source, arena
    yield node
    node.close()
    ahead.close()
    arena.close()


def ask_shared(reader: Reader, rows, tokens=()) -> tuple[int, bytes]:
    return reader.ask(READS_SHARED, chunk=len(tokens), length=len(rows),
                      payload=plan_bytes(rows) + np.array(tokens, dtype="<u8").tobytes())


def shared_reply(payload: bytes, count: int) -> tuple[int, np.ndarray, bytes]:
    token = TOKEN.unpack_from(payload)[0]
    end = TOKEN.size + count * SHARED_ROW.itemsize
    return token, np.frombuffer(payload[TOKEN.size:end], dtype=SHARED_ROW), payload[end:]


def map_arena(reader: Reader) -> ArenaView:
    reader.socket.sendall(REQUEST.pack(REQUEST_MAGIC, ARENA, 0, 0, 0))
    header, fds, _, _ = socket.recv_fds(reader.socket, REPLY.size, 1)
    magic, status, size = REPLY.unpack(header)
    assert (magic, status, len(fds)) == (REPLY_MAGIC, OK, 1)
    arena_size = json.loads(reader.exactly(size))["size"]
    with pytest.raises(PermissionError):  # a reader cannot map it writable: it can change no blob
        mmap.mmap(fds[0], arena_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view = ArenaView(fds[0], arena_size)
    os.close(fds[0])
    return view


def test_reads_shared_lends_remote_blobs_in_the_arena_until_given_back(dataset, shared):
    """The remote blobs of a READS_SHARED are lent (a place in the arena, the reader reads them through its own
    mapping), this node's own come in the reply; the slots stay lent until the token comes back, then come back."""
    blobs = blobs_of(dataset)[:12]
    remote = [row[0] % 2 == 1 for row in blobs]
    assert any(remote) and not all(remote)
    reader = Reader(shared.path)
    try:
        view = map_arena(reader)
        status, payload = ask_shared(reader, blobs)
        assert status == OK
        token, table, inline = shared_reply(payload, len(blobs))
        assert token > 0 and list(table["place"] >= 0) == remote
        start = 0
        for row, (blob_status, _, length, place) in zip(blobs, table.tolist()):
            assert blob_status == OK and length == row[2]
            if place >= 0:
                got = bytes(view.lend(0, lambda _: None)[place : place + length])  # noqa: E203
            else:
                got, start = inline[start : start + length], start + length
            assert got == shared.source.read(*row)
        assert start == len(inline)
        lent_bytes = sum(-(-row[2] // 64) * 64 for row, is_remote in zip(blobs, remote) if is_remote)
        assert shared.arena.stats()["arena_used"] == lent_bytes
        assert shared.stats()["lent"] == sum(remote) and shared.stats()["not_lent"] == len(blobs) - sum(remote)
        status, payload = ask_shared(reader, blobs[:1], [token])  # given back with the next request
        assert status == OK
        assert shared.arena.stats()["arena_used"] == 0  # blobs[0] is this node's own: nothing lent now
        # A token given back twice, or never lent: refused by name, and the connection goes on.
        status, reason = ask_shared(reader, blobs[:1], [token])
        assert (status, reason.decode()) == (REFUSED, f"token {token}: not lent on this connection (given back "
                                                      f"twice, or never lent)")
        assert ask_shared(reader, blobs[:1])[0] == OK
    finally:
        reader.close()


def test_a_connection_lends_at_most_its_bound_and_the_rest_comes_in_the_reply(dataset, shared, monkeypatch):
    blobs = [row for row in blobs_of(dataset) if row[0] % 2 == 1][:6]
    monkeypatch.setattr(node_endpoint, "LENT_MAX_BYTES", blobs[0][2] + blobs[1][2])
    reader = Reader(shared.path)
    try:
        status, payload = ask_shared(reader, blobs)
        _, table, inline = shared_reply(payload, len(blobs))
        assert list(table["place"] >= 0) == [True, True, False, False, False, False]
        assert inline == b"".join(shared.source.read(*row) for row in blobs[2:])
    finally:
        reader.close()


def test_reads_shared_out_of_bounds_is_refused_by_name(dataset, shared, endpoint):
    """A header whose rows and tokens cannot be told any more is refused by field and its connection closed."""
    blobs = blobs_of(dataset)[:2]
    for fields, reason in (
            ({"chunk": node_endpoint.MAX_RETURNED + 1, "length": 1},
             f"chunk {node_endpoint.MAX_RETURNED + 1}: a READS_SHARED gives back 0 to {node_endpoint.MAX_RETURNED} "
             f"tokens"),
            ({"length": 0}, f"length 0: a READS_SHARED asks for 1 to {node_endpoint.READS_MAX_BLOBS} blobs"),
            ({"offset": 3, "length": 1}, "offset 3: READS_SHARED takes 0 there")):
        reader = Reader(shared.path)
        try:
            status, payload = reader.ask(READS_SHARED, **fields)
            assert (status, payload.decode()) == (REFUSED, reason)
            assert reader.closed()
        finally:
            reader.close()
    reader = Reader(endpoint.path)  # a node without an arena
    try:
        assert reader.ask(ARENA) == (REFUSED, b"this node has no shared arena: ask READS")
        status, reason = ask_shared(reader, blobs)
        assert (status, reason) == (REFUSED, b"this node has no shared arena: ask READS")
    finally:
        reader.close()


def test_a_node_source_reads_lent_blobs_and_gives_them_back_once_their_views_are_gone(dataset, shared):
    blobs = [row for row in blobs_of(dataset) if row[0] % 2 == 1][:8]
    source = NodeServeSource(NodeConnection(str(shared.path)))
    try:
        got = source.read_many(blobs)
        assert [bytes(blob) for blob in got] == [shared.source.read(*row) for row in blobs]
        assert all(isinstance(blob, memoryview) and blob.readonly for blob in got)
        used = shared.arena.stats()["arena_used"]
        assert used >= sum(row[2] for row in blobs)
        kept = got[0]
        del got
        source.read_many(blobs[:1])  # one view of the first reply lives: its slots stay lent
        assert shared.arena.stats()["arena_used"] >= used
        del kept
        source.read_many(blobs[:1])  # now its token went back, with this request
        assert shared.arena.stats()["arena_used"] <= -(-blobs[0][2] // 64) * 64
    finally:
        source.close()


_HOLDER = """
import os, sys, signal
sys.path.insert(0, {repo!r})
from fanstore.serve.node_client import NodeConnection, NodeServeSource
rows = {rows!r}
source = NodeServeSource(NodeConnection({path!r}))
held = source.read_many(rows)
assert all(isinstance(blob, memoryview) for blob in held)
print("holding", flush=True)
signal.pause()
"""


def test_a_reader_that_dies_holding_lent_blobs_gives_them_all_back(dataset, shared):
    """A DataLoader worker killed with blobs lent to it: its connection closes with its process, and every slot
    it held comes back to the arena."""
    blobs = [row for row in blobs_of(dataset) if row[0] % 2 == 1][:10]
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER.format(repo=str(REPO), rows=blobs,
                                                                    path=str(shared.path))],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        assert shared.arena.stats()["arena_used"] >= sum(row[2] for row in blobs)
        assert shared.stats()["lent"] == len(blobs)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    wait_until_true(lambda: shared.arena.stats()["arena_used"] == 0, "the dead reader's slots came back")


def test_a_connection_closed_while_its_lent_blobs_are_in_use_stays_open_until_they_are_gone(dataset, shared):
    """The serve process gives a closed connection's slots back, to receive other blobs into: a reader that closes
    its dataset while a decoder still reads a lent blob keeps that socket open until the blob's views are gone."""
    blobs = [row for row in blobs_of(dataset) if row[0] % 2 == 1][:4]
    connection = NodeConnection(str(shared.path))
    got = NodeServeSource(connection).read_many(blobs)
    connection.close()
    gc.collect()
    assert shared.arena.stats()["arena_used"] >= sum(row[2] for row in blobs)
    assert [bytes(blob) for blob in got] == [shared.source.read(*row) for row in blobs]
    del got
    wait_until_true(lambda: shared.arena.stats()["arena_used"] == 0, "the slots came back once the views went")


def test_an_arena_this_process_cannot_map_leaves_its_blobs_to_the_socket(dataset, shared, monkeypatch):
    """A mapping refused here (ENOMEM: an address-space limit) is no arena, not an unreachable serve process: the
    blobs come through the socket, none from DEST."""
    from fanstore.serve import node_client

    def refused(fd: int, size: int) -> ArenaView:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(node_client, "ArenaView", refused)
    blobs = [row for row in blobs_of(dataset) if row[0] % 2 == 1][:4]
    source = NodeServeSource(NodeConnection(str(shared.path)))
    try:
        got = source.read_many(blobs)
        assert [bytes(blob) for blob in got] == [shared.source.read(*row) for row in blobs]
        assert shared.stats()["lent"] == 0
    finally:
        source.close()
