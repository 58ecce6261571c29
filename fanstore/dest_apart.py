"""Nothing but a pack writes into DEST: the paths other commands write to (a serve's local directory and ready file,
a mount's log) are refused at start when they overlap the dataset.

`fanstore serve DEST MP --local-dir DEST` would truncate DEST's own chunk files as it staged them (and every node
would stage into the one shared directory); a `--ready-file` or `--log` naming DEST's index would replace it or
append to it. On the parallel file system that is the packed dataset itself, lost for every job.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import UsageError
from .format import INDEX_NAME


def _node(path: str) -> tuple[int, int] | None:
    """What `path` is (device, inode), links followed; None where nothing is there (yet) or it cannot be seen."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _shown(path: Path, real: str) -> str:
    return str(path) if os.path.abspath(path) == real else f"{path} (links followed: {real})"


def check_apart_from_dest(dest: Path, paths: dict[str, Path]) -> None:
    """Each of `paths` (by option name) is neither DEST, nor inside it, nor holding it: fanstore writes there.

    Links are followed, and a directory reached by two paths (a bind mount) is seen as one, by device and inode. A
    path not there yet is judged by the directories it would be made in. UsageError, one line naming both paths. A
    DEST that holds no dataset (no index file) is left to the command, which refuses it in its own words.
    """
    real_dest = os.path.realpath(dest)
    dest_node = _node(real_dest)
    if dest_node is None or not os.path.isfile(os.path.join(real_dest, INDEX_NAME)):
        return  # no dataset to harm: the command fails on DEST by itself, in its own words
    dest_above = {_node(str(parent)) for parent in Path(real_dest).parents} - {None}
    for name, path in paths.items():
        real = os.path.realpath(path)
        here = _node(real)
        above = {_node(str(parent)) for parent in Path(real).parents} - {None}
        if here == dest_node:
            where = f"{name} {_shown(path, real)} is DEST {dest}"
        elif dest_node in above:
            where = f"{name} {_shown(path, real)} lies inside DEST {dest}"
        elif here is not None and here in dest_above:
            where = f"DEST {dest} lies inside {name} {_shown(path, real)}"
        else:
            continue
        raise UsageError(f"{where}: fanstore writes there, and only a pack may write into a dataset; choose a path "
                         f"apart from DEST")
