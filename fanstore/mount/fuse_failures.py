"""Any failure of a FUSE request handler answers that one request with an errno, and never ends the mount.

pyfuse3 replies with an errno only for a FUSEError; any other exception leaves its main loop and ends the mount,
and the training job then sees an empty directory (see answers_every_failure).
"""

from __future__ import annotations

import functools
from typing import Any, Awaitable, Callable, TypeVar

import pyfuse3

_Operations = TypeVar("_Operations", bound=type)
# Handlers whose first argument is the file handle open() or opendir() returned (an entry number), not an inode.
HANDLE_FIRST = frozenset({"read", "readdir", "release", "releasedir", "flush", "fsync", "fsyncdir", "write"})


def answers_every_failure(cls: _Operations) -> _Operations:
    """Wrap every request handler `cls` defines so that any failure answers that one request with an errno.

    pyfuse3 replies with an errno only for a FUSEError; any other exception leaves its main loop and ends the
    mount, and the training job then sees an empty directory. A damaged chunk, a disk answering EIO, a closed
    descriptor, MemoryError or a bug must cost one request, not the mount (the errno each maps to is
    errors.fuse_errno_of's). The handler's object reports the failure (`report_failure`).
    """
    handler_names = {name for name in vars(pyfuse3.Operations) if not name.startswith("_")} - {"init"}
    for name, handler in list(vars(cls).items()):
        if name in handler_names:
            setattr(cls, name, _answering_errno(handler))
    return cls


def _answering_errno(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(handler)
    async def guarded(self: Any, *args: Any) -> Any:
        try:
            return await handler(self, *args)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:  # noqa: BLE001 - see answers_every_failure; trio's Cancelled is not an Exception
            raise pyfuse3.FUSEError(self.report_failure(handler.__name__, args, exc)) from None

    guarded.answers_errno = True  # type: ignore[attr-defined]
    return guarded
