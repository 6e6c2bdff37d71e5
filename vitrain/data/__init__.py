"""Data: sources decoded to uint8 tensors or prepared memory maps, batched loading and on-device augmentation."""

from vitrain.data.augment import BatchAugment
from vitrain.data.loader import BatchLoader
from vitrain.data.pipeline import build_loaders
from vitrain.data.prepared import PreparedSet, open_prepared
from vitrain.data.sources import ImageSet, build_datasets

__all__ = ["BatchAugment", "BatchLoader", "ImageSet", "PreparedSet", "build_datasets", "build_loaders", "open_prepared"]
