"""Nothing but a pack writes into DEST: the paths other commands write to (a serve's local directory and ready file,
a mount's log) are refused at start when they overlap the dataset.

`fanstore serve DEST MP --local-dir DEST` would truncate DEST's own chunk files as it staged them (and every node
would stage into the one shared directory); a `--ready-file` or `--log` naming DEST's index would replace it or
append to it. On the parallel file system that is the packed dataset itself, lost for every job.

`overlap` says how two paths lie against each other, links followed and bind mounts seen through; the mount's
check that MOUNTPOINT hides nothing fanstore reads or writes (mount.check_outside) asks it too.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import UsageError
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


def _forms(path: Path, as_written: bool) -> set[str]:
    real = os.path.realpath(path)
    return {real, os.path.abspath(path)} if as_written else {real}


def _above(forms: set[str]) -> set[str]:
    return {str(parent) for form in forms for parent in Path(form).parents}


def overlap(path: Path, other: Path, as_written: bool = False, look_at_other: bool = True) -> str | None:
    """How `path` lies against `other`: "is" (the same file or directory), "inside" (below it), "holds" (`other`
    lies below it), or None (apart).

    Links are followed, and a directory reached by two paths (a bind mount) is seen as one, by device and inode; a
    path not there yet is judged by the directories it would be made in. `as_written`: each path also counts as
    spelled (made absolute), for a process that opens it so, through whatever lies on the way (a mount hides what
    is below it even where a link below would lead elsewhere). Not `look_at_other`: `other` is compared by name
    alone, never looked up (a FUSE mount whose daemon may hang). Names are compared first, and nothing is looked up
    once they tell.
    """
    mine, theirs = _forms(path, as_written), _forms(other, as_written)
    mine_above, theirs_above = _above(mine), _above(theirs)
    if mine & theirs:
        return "is"
    if theirs & mine_above:
        return "inside"
    if mine & theirs_above:
        return "holds"
    node = _node(os.path.realpath(path))
    other_node = _node(os.path.realpath(other)) if look_at_other else None
    if node is not None and node == other_node:
        return "is"
    if other_node is not None and other_node in {_node(parent) for parent in mine_above}:
        return "inside"
    if node is not None and look_at_other and node in {_node(parent) for parent in theirs_above}:
        return "holds"
    return None


def check_apart_from_dest(dest: Path, paths: dict[str, Path]) -> None:
    """Each of `paths` (by option name) is neither DEST, nor inside it, nor holding it: fanstore writes there.

    Links are followed, and a directory reached by two paths (a bind mount) is seen as one (overlap). UsageError,
    one line naming both paths. A DEST that holds no dataset (no index file) is left to the command, which refuses
    it in its own words.
    """
    real_dest = os.path.realpath(dest)
    if _node(real_dest) is None or not os.path.isfile(os.path.join(real_dest, INDEX_NAME)):
        return  # no dataset to harm: the command fails on DEST by itself, in its own words
    for name, path in paths.items():
        shown = _shown(path, os.path.realpath(path))
        where = {"is": f"{name} {shown} is DEST {dest}", "inside": f"{name} {shown} lies inside DEST {dest}",
                 "holds": f"DEST {dest} lies inside {name} {shown}"}.get(overlap(path, dest) or "")
        if where is not None:
            raise UsageError(f"{where}: fanstore writes there, and only a pack may write into a dataset; choose a "
                             f"path apart from DEST")
