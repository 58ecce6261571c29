"""fanstore: pack a training dataset into compressed chunks once; read any file of it fast, anywhere.

Reading is what every data-loader worker does, so `import fanstore` loads the read side only; the packer (its
worker processes, the codec selector) is imported the first time `pack`, `PackOptions` or `PackSummary` is used.
Every error fanstore raises on purpose is a `FanstoreError`; each kind a caller may catch is importable from here.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from .core.api import BlobFile, Dataset, EntryStat, open_dataset
from .errors import (
    ChunkCorrupt,
    ChunkError,
    ChunkUnavailable,
    DatasetNotFound,
    DoesNotFit,
    FanstoreError,
    FormatError,
    IsADirectory,
    NotADirectory,
    NotASymlink,
    PackError,
    PathNotFound,
    SymlinkLoop,
    UsageError,
)

if TYPE_CHECKING:
    from .pack.options import PackOptions
    from .pack.packer import PackSummary, pack

__all__ = [
    "BlobFile",
    "ChunkCorrupt",
    "ChunkError",
    "ChunkUnavailable",
    "Dataset",
    "DatasetNotFound",
    "DoesNotFit",
    "EntryStat",
    "FanstoreError",
    "FormatError",
    "IsADirectory",
    "NotADirectory",
    "NotASymlink",
    "PackError",
    "PackOptions",
    "PackSummary",
    "PathNotFound",
    "SymlinkLoop",
    "UsageError",
    "open_dataset",
    "pack",
]

_PACK_MODULE = f"{__name__}.pack.packer"
_FROM_PACK_MODULE = ("PackOptions", "PackSummary", "pack")


def __getattr__(name: str) -> Any:
    """`fanstore.pack` and its option and summary types, imported on first use (PEP 562)."""
    if name not in _FROM_PACK_MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    pack_module = importlib.import_module(_PACK_MODULE)
    globals().update({attr: getattr(pack_module, attr) for attr in _FROM_PACK_MODULE})
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FROM_PACK_MODULE))


class _Package(types.ModuleType):
    """Keeps `fanstore.pack` the function: importing the subpackage `fanstore.pack` (the packer's package) binds it
    to that name in the package (the import system does it, whoever imports it first). That binding is dropped, so
    the name stays the function, or is looked up by `__getattr__` above, which imports the packer then."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "pack" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
