"""The multi-node serving layer: one rank per node stores part of a dataset and serves it to the others."""
