"""How a rank cuts the files it fetches ahead from one peer into requests (fanstore/serve/sources.py). The requests
themselves go over real MPI in tests/test_serve.py."""

from fanstore.core.chunk_source import BlobRead
from fanstore.serve.sources import batches
from fanstore.serve.peer_messages import MAX_BLOBS


def _reads(*lengths: int) -> list[BlobRead]:
    return [BlobRead(1, 100 * number, length, lambda blob, error: None) for number, length in enumerate(lengths)]


def _lengths(cut: list[list[BlobRead]]) -> list[list[int]]:
    return [[read.length for read in batch] for batch in cut]


def test_blobs_go_in_order_within_the_byte_limit():
    assert _lengths(batches(_reads(3, 3, 3, 4, 1), limit=6)) == [[3, 3], [3], [4, 1]]
    assert batches([], limit=6) == []


def test_a_blob_larger_than_the_limit_goes_alone():
    assert _lengths(batches(_reads(2, 10, 2), limit=6)) == [[2], [10], [2]]


def test_no_request_names_more_than_max_blobs():
    cut = batches(_reads(*[1] * (2 * MAX_BLOBS + 1)), limit=1 << 30)
    assert [len(batch) for batch in cut] == [MAX_BLOBS, MAX_BLOBS, 1]
    assert [read.offset for batch in cut for read in batch] == [100 * n for n in range(2 * MAX_BLOBS + 1)]
