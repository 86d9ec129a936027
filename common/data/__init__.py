"""Data: finding a dataset, reading its pixels, decoding and caching it, splitting it, photos and augmentation."""

from common.moved import getattr_hook

__getattr__ = getattr_hook(__name__)  # 0.4's common.data (now decoded.py) says where its names went
