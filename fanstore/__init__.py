"""fanstore: pack a training dataset into compressed chunks once; read any file of it fast, anywhere.

`import fanstore` loads the errors alone: the read API (numpy and the codecs) is imported the first time one of its
names is used, and the packer (its worker processes, the codec selector) the first time `pack`, `PackOptions` or
`PackSummary` is. So a data-loader worker loads the read side only, and the command line's entry points
(`__main__.py`) start in milliseconds, ready to end a Ctrl-C with one line.
Every error fanstore raises on purpose is a `FanstoreError`; each kind a caller may catch is importable from here.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

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
    from .core.api import BlobFile, Dataset, EntryStat, open_dataset
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

# The names imported on first use (PEP 562), by the module that holds them.
_LAZY = {
    f"{__name__}.core.api": ("BlobFile", "Dataset", "EntryStat", "open_dataset"),
    f"{__name__}.pack.packer": ("PackOptions", "PackSummary", "pack"),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    """The read API, and `fanstore.pack` with its option and summary types, imported on first use."""
    module_name = _MODULE_OF.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(module_name)
    globals().update({attr: getattr(module, attr) for attr in _LAZY[module_name]})
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


class _Package(types.ModuleType):
    """Keeps `fanstore.pack` the function: importing the subpackage `fanstore.pack` (the packer's package) binds it
    to that name in the package (the import system does it, whoever imports it first). That binding is dropped, so
    the name stays the function, or is looked up by `__getattr__` above, which imports the packer then."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "pack" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
