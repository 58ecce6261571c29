"""fanstore: pack a training dataset into compressed chunks once; read any file of it fast, anywhere."""

from .api import BlobFile, Dataset, EntryStat, open_dataset
from .errors import (
    ChunkCorrupt,
    DatasetNotFound,
    FanstoreError,
    FormatError,
    PackError,
    PathNotFound,
    UsageError,
)
from .pack import PackOptions, PackSummary, pack

__all__ = [
    "BlobFile",
    "ChunkCorrupt",
    "Dataset",
    "DatasetNotFound",
    "EntryStat",
    "FanstoreError",
    "FormatError",
    "PackError",
    "PackOptions",
    "PackSummary",
    "PathNotFound",
    "UsageError",
    "open_dataset",
    "pack",
]
