"""What identifies a pack's inputs, so that DEST can tell whose it is: a resume must see the same tree and options as
the pack it continues (the journal holds their fingerprint), and a second run of a finished pack finds it finished
(the index holds the listing's digest)."""

from __future__ import annotations

import json
from typing import Any

import xxhash

from .walk import SourceTree


def pack_fingerprint(tree: SourceTree, output_defining: dict[str, Any], ctimes: bool = True) -> str:
    """Identifies a pack's inputs: a resume must see the same tree and the same output-defining options
    (`output_defining`), down to each entry's ctime (a file rewritten with its mtime put back is not resumed over).
    Without `ctimes`, the
    digest the index records as `listing_digest`: the index holds no time of SRC's files but their mtimes (packs of
    a copy of SRC stay byte-identical), and a second run finds the pack finished when every path, mode, size, mtime
    and link target is as packed, as make and rsync judge a file unchanged."""
    digest = xxhash.xxh3_128()
    digest.update(json.dumps(output_defining, sort_keys=True).encode())
    if ctimes:  # archives: who each archive file is (its members have no ctime of their own)
        for identity in tree.identity:
            digest.update(f"@{identity}\n".encode("utf-8", "surrogateescape"))
    for e in tree.entries:
        ctime = f"{e.ctime_ns}\0" if ctimes else ""
        digest.update(f"{e.path}\0{e.mode}\0{e.size}\0{e.mtime_ns}\0{ctime}{e.link_target}\n".encode("utf-8"))
    for p in tree.problems:
        digest.update(f"!{p.path}\0{p.reason}\n".encode("utf-8"))
    return digest.hexdigest()
