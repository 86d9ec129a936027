"""Data: finding a dataset, reading its pixels, decoding and caching it, splitting it, photos and augmentation."""
