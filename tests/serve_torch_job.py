"""The COMMAND of test_torch's serve test, run by every rank of `mpiexec -n 2 fanstore serve DEST ... -- python
serve_torch_job.py SRC DEST`: read this rank's share through fanstore.torch (no FUSE), compare each file with the
source, train a few steps, and poke the node's socket with a request for bytes that are not a blob, a plan of such
rows, and a plan with rows out of range. It also says where its processes (DataLoader workers too) loaded the index from, and whether anything
opened DEST's index meanwhile: the node's readers must take it from the local directory. Prints one JSON line."""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from fanstore.errors import say_line
from fanstore.core.format import INDEX_NAME
from fanstore.serve.node_client import NodeConnection
from fanstore.serve.node_endpoint import ENVIRONMENT
from fanstore.serve.node_protocol import OK, PLAN, PLAN_ROW, READ, REFUSED, STATS
from fanstore.torch import EpochSampler, FileDataset


IN_OPEN = 0x20  # inotify: the file was opened


class IndexWhere(FileDataset):
    """Item i is the index file the process that read it loaded (a DataLoader worker opens its own dataset)."""

    def _item(self, data: bytes, item: int) -> str:
        return str(self.dataset.index.path)


def watch_opens(path: Path) -> int:
    """An inotify descriptor that hears every open of `path` from now on, by any process."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0 or libc.inotify_add_watch(fd, os.fsencode(path), IN_OPEN) < 0:
        raise OSError(ctypes.get_errno(), f"{path}: cannot watch it with inotify")
    return fd


def opened(watch: int) -> bool:
    """Whether the watched file was opened (inotify merges like events in a row: a count would be a lower bound)."""
    try:
        return bool(os.read(watch, 4096))
    except BlockingIOError:
        return False


def features(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data[:64]), dtype=torch.uint8).float() / 8.0


def main() -> int:
    src, dest = Path(sys.argv[1]), Path(sys.argv[2])
    dest_index = watch_opens(dest / INDEX_NAME)  # every rank is mounted: their node processes are done with it
    rank, size = int(os.environ["FANSTORE_RANK"]), int(os.environ["FANSTORE_SIZE"])
    paths = [f"files/d{i % 3}/f{i:03d}.bin" for i in range(60)]
    dataset = FileDataset(None, paths=paths)
    sampler = EpochSampler(DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=True, seed=3), dataset)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2, collate_fn=list)
    order = list(iter(sampler.sampler))
    got = [data for batch in loader for data in batch]
    bad = sum(data != (src / paths[item]).read_bytes() for item, data in zip(order, got))

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps, loss = 0, float("nan")
    for batch_items in [order[i:i + 4] for i in range(0, 12, 4)]:
        x = torch.stack([features(dataset[item]) for item in batch_items])
        y = torch.tensor([int(paths[item].split("/")[1][1]) for item in batch_items])
        optimizer.zero_grad()
        loss_tensor = torch.nn.functional.cross_entropy(model(x), y)
        loss_tensor.backward()
        optimizer.step()
        steps, loss = steps + 1, float(loss_tensor)

    probe = DataLoader(IndexWhere(None, paths=paths), batch_size=2, sampler=range(8), num_workers=2, collate_fn=list)
    index_paths = sorted({path for batch in probe for path in batch} | {str(dataset.dataset.index.path)})

    connection = NodeConnection(os.environ[ENVIRONMENT])
    status, _ = connection.ask(READ, 0, 1, 5)  # inside a blob, not one
    refused = "refused" if status == REFUSED else f"status {status}"
    # A plan whose rows are in range but no blob: inside one in every chunk (some stored on the other rank). The
    # node takes the plan and fetches none of them (no peer is asked, so none refuses).
    chunks = len(dataset.dataset.index.chunks)
    bogus = np.array([(chunk, 33, 1) for chunk in range(chunks)], dtype=PLAN_ROW)
    status, _ = connection.ask(PLAN, length=len(bogus), payload=bogus.tobytes())
    bogus_plan = "taken" if status == OK else f"status {status}"
    # Rows out of range (no such chunk, a negative offset) refuse the whole plan, naming the row and the field.
    out_of_range = np.array([(0, 33, 1), (-1, 0, 10), (0, -5, 10)], dtype=PLAN_ROW)
    status, reason = connection.ask(PLAN, length=len(out_of_range), payload=out_of_range.tobytes())
    bad_plan = reason.decode() if status == REFUSED else f"status {status}"
    time.sleep(0.3)  # what the node would fetch for it has come by now
    status, payload = connection.ask(STATS)
    stats = json.loads(payload) if status == OK else {}
    say_line(json.dumps({"rank": rank, "read": len(got), "expected": len(order), "bad": bad, "steps": steps,
                         "loss": loss, "refused": refused, "remote_ahead": stats.get("ahead_hits", 0),
                         "lent": stats.get("lent", 0), "not_lent": stats.get("not_lent", 0),
                         "readers_local": stats.get("readers_local", 0),
                         "bogus_plan": bogus_plan, "bad_plan": bad_plan, "index_paths": index_paths,
                         "dest_index_opened": opened(dest_index)}), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
