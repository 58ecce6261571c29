"""The read core: the format, the index, chunk sources, the reader, the decoded cache and the Python API; and what
every command over a dataset shares (sizes, durable writes, verify, info, the DEST overlap check, pause points).
It never imports pyfuse3, mpi4py, the packer or the serving layer. The package imports none of its modules."""
