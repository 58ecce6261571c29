"""The COMMAND of test_torch's test of several training processes on a node, run by every rank of `mpiexec -n 2
fanstore serve DEST ... -- python serve_torch_processes.py SRC DEST`: two training processes on the rank (as one per
GPU would be), each with its own DataLoader (two workers) and its own DistributedSampler share, each announcing its
own order through EpochSampler. Both announce before either reads, so a node that kept one plan would have fetched
ahead for the last alone. Each compares every file with the source and reports its plan's counters from the node
(STATS, by its pid). Prints one JSON line."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

from torch.utils.data import DataLoader, DistributedSampler

from fanstore.errors import say_line
from fanstore.serve.node_client import NodeConnection
from fanstore.serve.node_endpoint import ENVIRONMENT
from fanstore.serve.node_protocol import OK, STATS
from fanstore.torch import EpochSampler, FileDataset

PROCESSES = 2
PATHS = [f"files/d{i % 3}/f{i:03d}.bin" for i in range(60)]


class AnnouncedTogether(EpochSampler):
    """EpochSampler that, once it has announced its order, waits until every training process of the rank has."""

    def __init__(self, sampler, dataset: FileDataset, announced) -> None:
        super().__init__(sampler, dataset)
        self.announced = announced

    def __iter__(self):
        order = super().__iter__()
        self.announced.wait()
        time.sleep(0.3)  # the node starts fetching ahead for both
        return order


def train(number: int, src: str, together, results) -> None:
    rank, size = int(os.environ["FANSTORE_RANK"]), int(os.environ["FANSTORE_SIZE"])
    dataset = FileDataset(None, paths=PATHS)
    share = DistributedSampler(dataset, num_replicas=PROCESSES * size, rank=PROCESSES * rank + number, shuffle=True,
                               seed=5)
    sampler = AnnouncedTogether(share, dataset, together)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=2, collate_fn=list)
    order = list(iter(share))
    got = [data for batch in loader for data in batch]
    bad = sum(data != (Path(src) / PATHS[item]).read_bytes() for item, data in zip(order, got))
    together.wait()  # both have read: both plans are still held (each goes with its process's connections)
    status, payload = NodeConnection(os.environ[ENVIRONMENT]).ask(STATS)
    plans = json.loads(payload)["plans"] if status == OK else {}
    together.wait()
    results.put({"number": number, "read": len(got), "expected": len(order), "bad": bad,
                 "plan": plans.get(str(os.getpid()), {}), "plans": len(plans)})
    dataset.close()


def main() -> int:
    src = sys.argv[1]
    context = multiprocessing.get_context("spawn")
    together = context.Barrier(PROCESSES)  # (cyclic) the trainers announce, then read, then ask STATS together
    results = context.Queue()
    trainers = [context.Process(target=train, args=(number, src, together, results)) for number in range(PROCESSES)]
    for trainer in trainers:
        trainer.start()
    reports = sorted((results.get(timeout=120) for _ in trainers), key=lambda report: report["number"])
    for trainer in trainers:
        trainer.join()
    status, payload = NodeConnection(os.environ[ENVIRONMENT]).ask(STATS)
    node = json.loads(payload) if status == OK else {}
    say_line(json.dumps({"rank": int(os.environ["FANSTORE_RANK"]), "trainers": reports,
                         "exit_codes": [trainer.exitcode for trainer in trainers],
                         "node": {key: node.get(key) for key in ("asked", "fetched_ahead", "ahead_hits", "plans")}}),
             sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
