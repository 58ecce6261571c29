"""PyTorch Datasets that read a packed dataset without FUSE, and a sampler that lets them decode ahead.

    from fanstore.torch import FileDataset, ImageFolder, EpochSampler

An optional part (`pip install 'fanstore[torch]'`): importing it imports torch; the rest of fanstore never does.
"""

from .datasets import FileDataset, ImageFolder
from .sampler import EpochSampler

__all__ = ["EpochSampler", "FileDataset", "ImageFolder"]
