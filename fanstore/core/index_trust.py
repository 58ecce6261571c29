"""Which index files this node has already checked in full, so the pass over every entry runs once per node.

The full check of an index (index_check.check_arrays) reads every entry and path: seconds at ten million files, and
a private copy of columns in every process that runs it. A node's processes (the mount, serve ranks, each
DataLoader worker, a second training process) map the same file; the first to check it leaves a stamp here, the
others find the stamp and skip that pass. Every process still verifies the body checksum and the header, TOC and
section layout, which cost one read of pages the node shares.

A stamp names the file's identity as the kernel keeps it (device, inode, size, mtime and ctime: no user can set a
ctime, and any write changes it), the body's checksum and the revision of the checks; a file replaced, rewritten
or touched is checked afresh. Stamps live in a directory of this user only (0700, owned, not a link), on tmpfs when
there is one: where that cannot be had, every process checks, as before.

Besides Index.load, two writers stamp the file they write, having run the same full check on its bytes: the
packer (index.write_packed_index) and a serve process's local copy (index_file.mark_copy_checked).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

# Raise when the full check grows stricter: stamps of the earlier checks then no longer count.
CHECK_REVISION = 2
_KEEP_STAMPS = 4096  # beyond this many, the oldest half are removed when a stamp is added
_SHM = Path("/dev/shm")


def _stamp_dir() -> Path | None:
    """This user's stamp directory, made if missing; None if it cannot be had safely."""
    base = _SHM if _SHM.is_dir() and os.access(_SHM, os.W_OK) else Path(tempfile.gettempdir())
    folder = base / f"fanstore-checked-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        return None  # someone else's, or open to others: a stamp there proves nothing
    return folder


def _stamp_name(info: os.stat_result, body_hash: int) -> str:
    return (f"r{CHECK_REVISION}-{body_hash:016x}-{info.st_dev:x}-{info.st_ino:x}-{info.st_size:x}-"
            f"{info.st_mtime_ns:x}-{info.st_ctime_ns:x}")


def is_checked(info: os.stat_result, body_hash: int) -> bool:
    """Whether a process of this node checked in full the index file of this identity and body checksum."""
    folder = _stamp_dir()
    return folder is not None and (folder / _stamp_name(info, body_hash)).exists()


def mark_checked(info: os.stat_result, body_hash: int) -> None:
    """Record that the index file of this identity passed the full check (best effort: a stamp not written only
    means the next process checks again)."""
    folder = _stamp_dir()
    if folder is None:
        return
    try:
        (folder / _stamp_name(info, body_hash)).touch()
        stamps = list(folder.iterdir())
        if len(stamps) > _KEEP_STAMPS:
            stamps.sort(key=lambda stamp: stamp.stat().st_mtime_ns)
            for stamp in stamps[: len(stamps) // 2]:
                stamp.unlink(missing_ok=True)
    except OSError:
        pass
