"""Exclusive flocks taken without waiting, the one way fanstore holds a path against another process of its own (a
pack's DEST, a serve rank's local directory, a mount point): the kernel drops an flock when its holder ends, however
it ends, so a killed holder leaves nothing to clean up. A file system without flock (Lustre mounted noflock, NFS for
a directory) is no error: there the path is not held, as before these locks.
"""

from __future__ import annotations

import errno
import fcntl

# What flock answers where the file system cannot lock (NFS emulates flock with a write lock, which a directory
# opened to read cannot take: EBADF).
NO_FLOCK = frozenset((errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOLCK, errno.EBADF))


def lock_now(fd: int) -> bool:
    """An exclusive flock on `fd`: True once held, False where the file system has none. BlockingIOError where
    another process holds it; any other OSError as flock raised it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise
    except OSError as exc:
        if exc.errno in NO_FLOCK:
            return False
        raise
    return True
