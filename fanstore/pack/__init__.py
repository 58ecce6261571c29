"""The packer: walk SRC (a tree or archives), plan groups and codecs, compress in worker processes, write chunk
files and the index (last, atomically) into DEST, resumable through the journal. `packer` runs it all.

The package imports none of its modules, and `fanstore.pack` stays the function `fanstore.pack.packer.pack`: see
fanstore/__init__.py."""
