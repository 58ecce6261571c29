"""The COMMAND of test_torch's serve test, run by every rank of `mpiexec -n 2 fanstore serve ... --`: read this
rank's share through fanstore.torch (no FUSE), compare each file with the source, train a few steps, and poke the
node's socket with a request for bytes that are not a blob and a plan of such rows. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from fanstore.errors import say_line
from fanstore.serve.node_client import NodeConnection
from fanstore.serve.node_endpoint import ENVIRONMENT, OK, PLAN, PLAN_ROW, READ, REFUSED, STATS
from fanstore.torch import EpochSampler, FileDataset


def features(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data[:64]), dtype=torch.uint8).float() / 8.0


def main() -> int:
    src = Path(sys.argv[1])
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

    connection = NodeConnection(os.environ[ENVIRONMENT])
    status, _ = connection.ask(READ, 0, 1, 5)  # inside a blob, not one
    refused = "refused" if status == REFUSED else f"status {status}"
    # A plan whose rows are not blobs: inside one in every chunk (some stored on the other rank), no chunk, a
    # negative offset. The node takes the plan and fetches none of them (no peer is asked, so none refuses).
    bogus = np.array([(chunk, 33, 1) for chunk in range(64)] + [(-1, 0, 10), (0, -5, 10)], dtype=PLAN_ROW)
    status, _ = connection.ask(PLAN, length=len(bogus), payload=bogus.tobytes())
    bogus_plan = "taken" if status == OK else f"status {status}"
    time.sleep(0.3)  # what the node would fetch for it has come by now
    status, payload = connection.ask(STATS)
    stats = json.loads(payload) if status == OK else {}
    say_line(json.dumps({"rank": rank, "read": len(got), "expected": len(order), "bad": bad, "steps": steps,
                         "loss": loss, "refused": refused, "remote_ahead": stats.get("ahead_hits", 0),
                         "bogus_plan": bogus_plan}), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
