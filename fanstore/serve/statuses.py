"""What an answer to a request for blobs says, on the wire, and the one table between those statuses and errors:
a peer rank's reply (peer_messages.py) and the node endpoint's reply to its readers (node_endpoint.py) use the
same statuses, and an asker turns any of them into the same error (docs/SERVE.md, "Peer requests").

    the answerer's error   ->  status        ->  the asker's error
    RequestRefused             REFUSED           ChunkUnavailable  (read the blob elsewhere: DEST)
    ChunkUnavailable           UNAVAILABLE       ChunkUnavailable  (read the blob elsewhere: DEST)
    ChunkCorrupt               CORRUPT           ChunkCorrupt      (the answerer's copy is bad; one with another
                                                                    copy behind it, FallbackChunkSource, reads that)
    (turned away: node only)   TURNED_AWAY       ChunkUnavailable  (node_client.TurnedAway: the reader's connection
                                                                    is closed; its next request opens another)

Imports nothing of MPI: the node's readers (node_client.py) are not MPI processes.
"""

from __future__ import annotations

from enum import IntEnum
from types import MappingProxyType

from ..errors import ChunkCorrupt, ChunkError, ChunkUnavailable, FanstoreError

__all__ = ["RequestRefused", "Status", "status_error", "status_of"]


class Status(IntEnum):
    """One answer's status: a byte per blob in a peer's PARTIAL reply, an int in a reply's header."""

    OK = 0  # the blob (or blobs) follow
    REFUSED = 1  # the request names bytes the answerer does not serve (not a whole blob of the dataset it holds)
    UNAVAILABLE = 2  # the answerer cannot read the blob now
    CORRUPT = 3  # the answerer's copy is not what the index says (a chunk file cut short, a wrong header)
    PARTIAL = 4  # peers only: some blobs of several, a status a blob first (peer_messages.hand_out_reply)
    # The node endpoint's only: the connection is turned away (past the node's limit, out of descriptors) and closed
    # after this reply, its reason, whatever it asked; REFUSED is about the request, and the connection goes on.
    TURNED_AWAY = 5


class RequestRefused(FanstoreError, ValueError):
    """A request names bytes this rank does not serve (a chunk it does not hold, a range that is not one of its
    blobs): refused and logged, never read."""


# Status -> (what the answerer did, for the asker's message; the error the asker raises). Any other status (a
# malformed reply) is unavailable: the asker reads the blob elsewhere.
_ERRORS: MappingProxyType[int, tuple[str, type[ChunkError]]] = MappingProxyType({
    Status.REFUSED: ("refused", ChunkUnavailable),
    Status.UNAVAILABLE: ("could not read", ChunkUnavailable),
    Status.CORRUPT: ("found corrupt", ChunkCorrupt),
})


def status_error(status: int, reason: str, chunk_id: int, answerer: str = "", asked: str = "") -> ChunkError:
    """The error an asker raises for an answer of `status` (not OK) with the answerer's `reason`: ChunkCorrupt for
    CORRUPT, ChunkUnavailable for the rest. `answerer` and `asked` ("rank 1", "chunk 3 at 4096"), when given, open
    its message: "rank 1 found corrupt chunk 3 at 4096: REASON"."""
    verb, error = _ERRORS.get(status, ("could not give", ChunkUnavailable))
    if answerer:
        reason = f"{answerer} {verb} {asked}" + (f": {reason}" if reason else "")
    return error(reason, chunk_id=chunk_id)


def status_of(exc: Exception) -> Status:
    """The status an answerer sends for the error that kept it from giving a blob."""
    if isinstance(exc, RequestRefused):
        return Status.REFUSED
    return Status.CORRUPT if isinstance(exc, ChunkCorrupt) else Status.UNAVAILABLE
