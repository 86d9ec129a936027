"""The fast data path and on-device augmentation."""

from __future__ import annotations

import torch

from common.data.augment import BatchTransform, batch_generator, random_flip, random_translate
from common.data.decoded import ImageSplit, TensorImages, make_loader


def split(n=50):
    g = torch.Generator().manual_seed(0)
    return ImageSplit(torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=g), torch.arange(n) % 7)


def test_batched_gather_yields_exactly_the_reference_samples():
    s = split()
    ds = TensorImages(s)
    idx = [3, 17, 0, 49, 17]
    images, labels = ds.__getitems__(idx)
    ref = [ds[i] for i in idx]  # the per-sample reference path
    assert torch.equal(images, torch.stack([r[0] for r in ref]))
    assert torch.equal(labels, torch.stack([r[1] for r in ref]))
    loader = make_loader(s, batch_size=16, train=False)
    got = torch.cat([b[0] for b in loader])
    assert got.dtype == torch.uint8 and torch.equal(got, s.images)


def test_augmentation_shapes_ranges_and_determinism():
    s = split()
    t = BatchTransform([0.5] * 3, [0.25] * 3, translate=2, flip=True)
    a = t.train(s.images, batch_generator(1, 0, 0, 0))
    b = t.train(s.images, batch_generator(1, 0, 0, 0))
    assert a.shape == (50, 3, 8, 8) and a.dtype == torch.float32
    assert torch.equal(a, b)  # same seed, epoch, step, rank -> same pixels
    assert a.min() >= (0 - 0.5) / 0.25 - 1e-6 and a.max() <= (1 - 0.5) / 0.25 + 1e-6
    for other in (batch_generator(1, 1, 0, 0), batch_generator(1, 0, 0, 1), batch_generator(1, 0, 1, 0)):
        assert not torch.equal(a, t.train(s.images, other))  # differs across epochs, ranks and steps


def test_flip_and_translate_move_pixels_as_expected():
    img = torch.zeros(1, 1, 5, 5)
    img[0, 0, 2, 0] = 1.0  # a dot on the left edge, middle row
    flipped = None
    for seed in range(20):  # find a draw that flips
        out = random_flip(img, torch.Generator().manual_seed(seed))
        if not torch.equal(out, img):
            flipped = out
            break
    assert flipped is not None and flipped[0, 0, 2, 4] == 1.0 and flipped.sum() == 1.0
    img = torch.zeros(64, 1, 5, 5)
    img[:, 0, 2, 2] = 1.0  # a dot in the centre of every image
    out = random_translate(img, 1, torch.Generator().manual_seed(0))
    pos = [tuple((o[0] == 1).nonzero()[0].tolist()) for o in out]
    assert all(abs(r - 2) <= 1 and abs(c - 2) <= 1 for r, c in pos)  # moved by at most 1 pixel
    assert len(set(pos)) > 3  # each image draws its own shift
