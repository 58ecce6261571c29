"""A real node endpoint (fanstore/serve/node_endpoint.py) in a process out of file descriptors, for
tests/test_node_endpoint.py: every descriptor its limit allows is taken once the endpoint listens, with the endpoint's
spare one (`spare`), or before it could take one (`none`). Prints one JSON line once listening ({"socket"}), then
answers each line on stdin: `free` gives one descriptor back, `stats` prints the endpoint's counters and the
process's CPU seconds (`cpu`) as one JSON line. Ends at EOF.

    python serve_starved_endpoint.py DATASET DIR spare|none
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
from pathlib import Path

from fanstore import open_dataset
from fanstore.core.chunk_source import LocalChunkSource
from fanstore.serve.blobs_ahead import BlobsAhead
from fanstore.serve.node_endpoint import NodeEndpoint
from fanstore.serve.node_protocol import BlobLookup
from fanstore.serve.placement import BlobTable

LIMIT = 64  # the soft open file limit: a few dozen descriptors to take, not thousands


def take_every_descriptor() -> list[int]:
    taken = []
    while True:
        try:
            taken.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            return taken


def main() -> int:
    dataset, directory, spare = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "spare"
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    with open_dataset(dataset) as ds:
        source = LocalChunkSource(ds.path, ds.index.chunks["size"])
        lookup = BlobLookup(BlobTable.of(ds.index), len(ds.index.chunks))
        ahead = BlobsAhead(source.start_reads, lookup.locate)
        taken = [] if spare else take_every_descriptor()
        if taken:
            os.close(taken.pop())  # the listening socket's, and no more
        node = NodeEndpoint(directory, {"rank": 0}, source, lookup, ahead, max_connections=64)
        taken += take_every_descriptor()
        print(json.dumps({"socket": str(node.path)}), flush=True)
        for line in sys.stdin:
            if line.strip() == "free":
                os.close(taken.pop())
            elif line.strip() == "stats":
                times = os.times()
                print(json.dumps({**node.stats(), "cpu": times.user + times.system}), flush=True)
        node.close()
        ahead.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
