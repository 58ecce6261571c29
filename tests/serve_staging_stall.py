"""Run by tests/test_serve.py under `mpiexec -n 2`: the rank that reads a replicated chunk from DEST stalls (its
first read takes STALL seconds, as a hung parallel file system client would), and the rank waiting for that chunk
says which rank it waits on, then both finish staging. Then both stage again, and rank 1 ends STALL seconds after
rank 0, which names it. Prints one JSON line a rank.

    mpiexec -n 2 python serve_staging_stall.py DEST WORKDIR
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from mpi4py import MPI

from fanstore.errors import say_line
from fanstore.core.index import Index
from fanstore.serve.placement import place
from fanstore.serve.staging import Stager

STALL = 1.5
REPORT_AFTER = 0.3


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(dest: Path, workdir: Path) -> None:
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    index = Index.load(dest)
    placement = place(index, comm.Get_size())
    stalling = placement.replicated_reader(placement.replicated_chunks[0])
    kept = Kept()
    logging.getLogger("fanstore.serve").addHandler(kept)
    stager = Stager(comm, index, placement, dest, workdir / f"local{rank}", stall_report=REPORT_AFTER)
    if rank == stalling:
        read = stager._read_replicated

        def stalled_once(span):
            if not getattr(stalled_once, "done", False):
                stalled_once.done = True
                time.sleep(STALL)
            return read(span)

        stager._read_replicated = stalled_once  # type: ignore[method-assign]
    report = stager.run()
    seen = {"rank": rank, "stalling": stalling, "warnings": kept.lines, "unverified": report.unverified_chunks}
    # Then rank 1 finishes its own staging STALL seconds after rank 0 (its read of its own pieces hung, say): rank 0,
    # which hears from every rank that it is done, names it.
    kept.lines = []
    late = Stager(comm, index, placement, dest, workdir / f"again{rank}", stall_report=REPORT_AFTER)
    if rank == 1:
        tell = late._hear_every_rank_staged

        def told_late() -> None:
            time.sleep(STALL)
            tell()

        late._hear_every_rank_staged = told_late  # type: ignore[method-assign]
    late.run()
    seen["late warnings"] = kept.lines
    say_line(json.dumps(seen), sys.stdout)
    comm.Free()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
