"""Data: sources decoded to uint8 tensors, batched loading and on-device augmentation."""

from vitrain.data.augment import BatchAugment
from vitrain.data.loader import BatchLoader
from vitrain.data.sources import ImageSet, build_datasets

__all__ = ["BatchAugment", "BatchLoader", "ImageSet", "build_datasets"]
