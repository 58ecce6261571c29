"""Project errors: each names the file, path or option at fault, so the CLI can print it in one line.

Errors that refine a builtin also subclass it (a missing path is a FileNotFoundError, a corrupt blob an
OSError), so callers that already handle the builtin keep working.
"""

from __future__ import annotations


class FanstoreError(Exception):
    """Base of every error fanstore raises on purpose; the CLI prints its message and exits non-zero."""


class UsageError(FanstoreError, ValueError):
    """A command-line option or API argument has a value fanstore cannot use."""


class FormatError(FanstoreError, OSError):
    """A dataset file is not in a format this version can read (bad magic, unknown version, truncated)."""


class DatasetNotFound(FanstoreError, FileNotFoundError):
    """The directory given as a dataset holds no complete fanstore index."""


class PathNotFound(FanstoreError, FileNotFoundError):
    """A path asked of a dataset is not in it."""


class ChunkCorrupt(FanstoreError, OSError):
    """A stored blob failed its checksum or could not be decoded; only the named file is affected."""

    def __init__(self, message: str, path: str = "", chunk_id: int = -1) -> None:
        super().__init__(message)
        self.path = path
        self.chunk_id = chunk_id

    def __str__(self) -> str:
        return self.args[0]


class PackError(FanstoreError):
    """The pack cannot go on (disk full, DEST unusable, SRC changed); what is done stays resumable."""
