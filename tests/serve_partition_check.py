"""A rank's COMMAND in the partition test (test_separate_nodes.py): read the dataset in three phases, each when the
test says go, and say how each phase's reads went.

Usage: serve_partition_check.py SRC SHARED
Phase k reads files[k::3] of the sorted regular files (none read before on this node, so the mount asks its
sources, not the kernel's page cache) when SHARED/go-PHASE exists, compares each with SRC byte for byte, and writes
SHARED/done-PHASE-RANK: the mount's source counters' change over the phase and the files that differed or failed.
"""

from __future__ import annotations

import json
import os
import sys
import time

PHASES = ("before", "cut", "after")
WAIT = 300.0


def counters(mount: str) -> dict:
    return json.loads(os.getxattr(mount, "user.fanstore.stats"))["source"]


def change(before: dict, after: dict) -> dict:
    peers = {peer: {key: after["peers"][peer][key] - before["peers"][peer][key] for key in ("fetched", "failed")}
             for peer in after["peers"]}
    return {"local": after["local"] - before["local"], "fallback": after["fallback"] - before["fallback"],
            "peers": peers}


def main() -> int:
    src, shared = sys.argv[1], sys.argv[2]
    mount, rank = os.environ["FANSTORE_MOUNT"], os.environ["FANSTORE_RANK"]
    files = sorted(os.path.relpath(os.path.join(folder, name), src) for folder, _, names in os.walk(src)
                   for name in names if not os.path.islink(os.path.join(folder, name)))
    for number, phase in enumerate(PHASES):
        deadline = time.monotonic() + WAIT
        while not os.path.exists(os.path.join(shared, f"go-{phase}")):
            if time.monotonic() > deadline:
                return 2
            time.sleep(0.05)
        before, problems = counters(mount), []
        for rel in files[number::len(PHASES)]:
            try:
                with open(os.path.join(src, rel), "rb") as original, open(os.path.join(mount, rel), "rb") as served:
                    if original.read() != served.read():
                        problems.append(f"differs: {rel}")
            except OSError as exc:
                problems.append(f"{rel}: {exc}")
        result = {"change": change(before, counters(mount)), "problems": problems[:5]}
        done = os.path.join(shared, f"done-{phase}-{rank}")
        with open(done + ".partial", "w") as out:
            json.dump(result, out)
        os.replace(done + ".partial", done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
