"""The COMMAND of test_node_endpoint's serve test, run by every rank of `mpiexec -n 2 fanstore serve DEST ... --
python serve_node_probe.py SRC DEST`: probe the node's socket as a hostile reader would (a plan of 2^24 rows, a READ
at offset 2^64-1, and more), read the serve process's memory (/proc/PPID/status: COMMAND is its child) before and
after, then read every file through the node as a training job's reader would. Prints one JSON line."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np

from fanstore.errors import say_line
from fanstore.core.index import Index
from fanstore.serve.node_client import open_served_dataset
from fanstore.serve.node_endpoint import ENVIRONMENT, unix_address
from fanstore.serve.node_protocol import HELLO, PLAN, PLAN_ROW, READ, REPLY, REQUEST, REQUEST_MAGIC, STATS
from fanstore.serve.placement import place


def rss_kib(pid: int) -> int:
    """The resident memory of process `pid` (VmRSS, KiB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


class Probe:
    """One connection to the node socket, sending exactly what it is told."""

    def __init__(self) -> None:
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with unix_address(Path(os.environ[ENVIRONMENT])) as address:
            self.socket.connect(address)
        self.socket.settimeout(60)

    def send(self, kind: int, chunk: int = 0, offset: int = 0, length: int = 0, payload: bytes = b"",
             magic: bytes = REQUEST_MAGIC) -> None:
        self.socket.sendall(REQUEST.pack(magic, kind, chunk, offset, length) + payload)

    def reply(self) -> tuple[int, str]:
        """The status and the payload, as text (the probes' replies are reasons, JSON or empty)."""
        _magic, status, size = REPLY.unpack(self.exactly(REPLY.size))
        payload = self.exactly(size)
        return status, payload.decode("utf-8", "replace")

    def ask(self, *request, **options) -> tuple[int, str]:
        self.send(*request, **options)
        return self.reply()

    def exactly(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            more = self.socket.recv(size - len(data))
            if not more:
                raise ConnectionError("the node closed the connection")
            data += more
        return bytes(data)

    def closed(self) -> bool:
        try:
            return self.socket.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.socket.close()


def huge_plan(probe: Probe, rows: int) -> None:
    """A plan of `rows` rows, its body sent as the node lets it (it may close the connection at the header)."""
    probe.send(PLAN, length=rows)
    piece = bytes(1 << 20)
    try:
        for _ in range(rows * PLAN_ROW.itemsize // len(piece)):
            probe.socket.sendall(piece)
    except OSError:  # the node closed the connection: what it answered is in the reply
        pass


def main() -> int:
    src = Path(sys.argv[1])
    rank = int(os.environ["FANSTORE_RANK"])
    serve = os.getppid()
    first = Probe()
    node = json.loads(first.ask(HELLO)[1])
    index = Index.load(node["index_dir"])
    placement = place(index, int(node["size"]))
    entries = index.entries[np.fromiter(index.iter_files(), dtype=np.int64)]
    entries = entries[entries["stored_len"] > 0]
    remote = [(int(e["chunk"]), int(e["offset"]), int(e["stored_len"])) for e in entries
              if not placement.is_local(rank, int(e["chunk"]), int(e["offset"]))]
    chunk, offset, length = remote[0]
    rss = {"before": rss_kib(serve)}
    answers: dict[str, object] = {}

    # The two cases of the probe that found this, each on a connection of its own.
    sender = threading.Thread(target=huge_plan, args=(first, 1 << 24))
    sender.start()
    answers["plan of 2^24 rows"] = first.reply()
    sender.join()
    closed = {"plan of 2^24 rows": first.closed()}
    first.close()
    rss["after the 2^24-row plan"] = rss_kib(serve)
    probe = Probe()
    answers["READ at offset 2^64-1"] = probe.ask(READ, chunk, 2**64 - 1, length)
    hello_after = probe.ask(HELLO)[0]
    # More of the kind, on the same connection.
    for name, request in {"READ of chunk 2^32-1": (READ, 2**32 - 1, offset, length),
                          "READ of length 0": (READ, chunk, offset, 0),
                          "READ of length 2^64-1": (READ, chunk, offset, 2**64 - 1),
                          "READ inside a blob": (READ, chunk, offset + 1, length - 1),
                          "HELLO with a chunk": (HELLO, 9, 0, 0),
                          "kind 77": (77, 0, 0, 0)}.items():
        answers[name] = probe.ask(*request)
    bad_rows = np.array([remote[0], (chunk, -(2**63), length), remote[1]], dtype=PLAN_ROW)
    answers["plan with a negative offset"] = probe.ask(PLAN, length=len(bad_rows), payload=bad_rows.tobytes())
    # The largest plan the node takes: as many rows as the dataset has blobs, each a remote blob.
    most = int(node["blobs"])
    maximal = np.array((remote * (most // len(remote) + 1))[:most], dtype=PLAN_ROW)
    maximal_plan = probe.ask(PLAN, length=most, payload=maximal.tobytes())
    time.sleep(0.5)  # its first blobs fetched ahead
    rss["with the maximal plan"] = rss_kib(serve)
    held = json.loads(probe.ask(STATS)[1])["plans"]
    probe.close()
    bad_magic = Probe()
    answers["bad magic"] = bad_magic.ask(HELLO, magic=b"QQQQ")
    closed["bad magic"] = bad_magic.closed()
    bad_magic.close()
    time.sleep(0.2)
    stats_probe = Probe()
    plans_after = json.loads(stats_probe.ask(STATS)[1])["plans"]
    stats_probe.close()
    rss["after"] = rss_kib(serve)

    # The node goes on serving its readers: every file, byte for byte.
    with open_served_dataset() as dataset:
        paths = sorted(dataset.files())
        bad = sum(dataset.read(path) != (src / path).read_bytes() for path in paths)
    say_line(json.dumps({"rank": rank, "answers": answers, "closed": closed, "hello_after": hello_after,
                         "maximal_plan": maximal_plan, "rss_kib": rss,
                         "plan_rows_held": [plan["rows"] for plan in held.values()], "plans_after": plans_after,
                         "blobs": most, "read": len(paths), "bad": bad}), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
