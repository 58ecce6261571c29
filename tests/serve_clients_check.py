"""Run on every rank by tests/test_serve.py as the job's command: each client of tests/client_files.py reads its
file through this rank's mount, where some of the file's blobs live on other ranks, and must see what it sees in the
original. Prints one line: `rank R: ok, N blobs from peers`, or what differed.

    python serve_clients_check.py SRC
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from client_files import read_like_clients  # noqa: E402
from fanstore.errors import say_line  # noqa: E402


def main() -> int:
    src, mount, rank = Path(sys.argv[1]), Path(os.environ["FANSTORE_MOUNT"]), os.environ["FANSTORE_RANK"]
    expected, seen = read_like_clients(src), read_like_clients(mount)
    problems = [f"{name} differs" for name in expected if seen.get(name) != expected[name]]
    source = json.loads(os.getxattr(mount, "user.fanstore.stats"))["source"]
    from_peers = sum(peer["fetched"] for peer in source["peers"].values())
    if not from_peers:
        problems.append(f"nothing came from a peer: {source}")
    say_line(f"rank {rank}: " + (f"ok, {from_peers} blobs from peers" if not problems else "; ".join(problems)),
             sys.stdout)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
