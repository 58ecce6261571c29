"""core/durable.py, and the packer's chunk files, which follow its rule: a file appears under its name only whole,
and writing it never writes through what stands at its temporary name."""

from __future__ import annotations

import os

import pytest

from fanstore.core.durable import partial_of, write_atomically


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_link_at_the_temporary_name_is_replaced_not_written_through(tmp_path, link):
    """A link left or put at `name.partial` (to DEST's index, say) had its target truncated and rewritten."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"another file's bytes")
    path = tmp_path / "fanstore.index"
    if link == "symbolic":
        partial_of(path).symlink_to(victim)
    else:
        os.link(victim, partial_of(path))
    write_atomically(path, b"the new index")
    assert path.read_bytes() == b"the new index" and not partial_of(path).exists()
    assert victim.read_bytes() == b"another file's bytes"


def test_a_write_left_by_a_killed_run_is_written_over_and_one_that_fails_leaves_nothing(tmp_path):
    path = tmp_path / "ready"
    partial_of(path).write_bytes(b"half of an old wri")
    write_atomically(path, [b"one ", b"two"])
    assert path.read_bytes() == b"one two" and not partial_of(path).exists()

    def failing():
        yield b"a piece"
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError) as failed:
        write_atomically(tmp_path / "other", failing())
    assert failed.value.filename == str(partial_of(tmp_path / "other"))
    assert not partial_of(tmp_path / "other").exists() and not (tmp_path / "other").exists()


def test_a_chunk_written_at_a_name_a_link_stands_at_replaces_the_link(tmp_path):
    """The packer's chunk files follow write_atomically's rule: a link at `N.fsc.partial` (another file, SRC's say)
    was opened with O_TRUNC and written through."""
    from fanstore.core.format import chunk_file_name
    from fanstore.pack.chunk_writer import ChunkWriter

    victim = tmp_path / "a source file"
    victim.write_bytes(b"not the packer's to write")
    final = tmp_path / chunk_file_name(3)
    final.parent.mkdir(parents=True, exist_ok=True)
    partial_of(final).symlink_to(victim)
    writer = ChunkWriter(tmp_path, 3, 0)
    writer.append(b"a blob")
    size = writer.finish()
    assert final.stat().st_size == size and not final.is_symlink() and not partial_of(final).exists()
    assert victim.read_bytes() == b"not the packer's to write"
