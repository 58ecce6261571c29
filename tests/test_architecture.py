"""docs/ARCHITECTURE.md against the code: each `a -> b` step of its read paths is an import of b by a, each module
it names exists, and scripts/architecture.py draws the picture from the code (tests/test_imports.py keeps the
layering the picture shows)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_every_step_of_the_documented_paths_is_in_the_code():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "architecture.py"), "--check"], capture_output=True,
                          text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr


def test_the_picture_is_drawn_from_the_code(tmp_path):
    out = tmp_path / "architecture.png"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "architecture.py"), "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_step_that_is_not_an_import_is_named(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import architecture
    finally:
        sys.path.remove(str(REPO / "scripts"))
    doc = tmp_path / "PATHS.md"
    doc.write_text("`fanstore/core/cache.py` -> `fanstore/core/reader.py` ~> `fanstore/core/gone.py`, and "
                   "`fanstore/core/api.py` -> `fanstore/core/reader.py`")
    assert architecture.check_paths(architecture.read_modules(), doc) == [
        "PATHS.md: `fanstore/core/cache.py` -> `fanstore/core/reader.py`: fanstore.core.cache does not import "
        "fanstore.core.reader",
        "PATHS.md: `fanstore/core/reader.py` ~> `fanstore/core/gone.py`: no module fanstore.core.gone"]
