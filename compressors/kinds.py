"""What kind of data a file holds, from its name and first bytes: codecs are chosen per kind.

The packer calls this on every file it compresses and the selector on every sampled file, so both always agree.
It lives here, below both: the selector knows nothing of fanstore, and the read side never imports the selector.
"""

from __future__ import annotations

import posixpath

JPEG, PNG, NPY, TEXT, COMPRESSED, OTHER = "jpeg", "png", "npy", "text", "compressed", "other"
KINDS = (JPEG, PNG, NPY, TEXT, COMPRESSED, OTHER)

_BY_EXTENSION = {
    ".jpg": JPEG, ".jpeg": JPEG,
    ".png": PNG,
    ".npy": NPY,
    ".txt": TEXT, ".csv": TEXT, ".tsv": TEXT, ".json": TEXT, ".jsonl": TEXT, ".xml": TEXT, ".yaml": TEXT,
    ".yml": TEXT, ".md": TEXT, ".html": TEXT, ".py": TEXT, ".log": TEXT,
    ".gz": COMPRESSED, ".bz2": COMPRESSED, ".xz": COMPRESSED, ".zst": COMPRESSED, ".zip": COMPRESSED,
    ".webp": COMPRESSED, ".mp4": COMPRESSED, ".mp3": COMPRESSED,
}
_MAGICS = (
    (b"\xff\xd8\xff", JPEG),
    (b"\x89PNG\r\n\x1a\n", PNG),
    (b"\x93NUMPY", NPY),
    (b"\x1f\x8b", COMPRESSED),
    (b"\x28\xb5\x2f\xfd", COMPRESSED),
    (b"PK\x03\x04", COMPRESSED),
    (b"\xfd7zXZ\x00", COMPRESSED),
    (b"BZh", COMPRESSED),
)
HEAD_BYTES = 512  # how much of a file the sniff looks at


def file_kind(path: str, head: bytes) -> str:
    """The kind of a file: the content's magic number wins over the extension, which wins over a text guess."""
    for magic, kind in _MAGICS:
        if head.startswith(magic):
            return kind
    by_name = _BY_EXTENSION.get(posixpath.splitext(path)[1].lower())
    if by_name is not None:
        return by_name
    return TEXT if _looks_like_text(head[:HEAD_BYTES]) else OTHER


def _looks_like_text(head: bytes) -> bool:
    if not head or b"\x00" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        # A multi-byte character cut at the end of the head is still text.
        return exc.start >= len(head) - 3
    return True
