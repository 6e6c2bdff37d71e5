"""vitrain: train Vision Transformers as fast as the hardware allows."""

__version__ = "0.1.0"
