"""A tiny learnable fake dataset for tests and benchmarks: one bright bar per class."""

from __future__ import annotations

import numpy as np

from meshensemble.data.dataset import IMAGE_SHAPE, NUM_CLASSES, Dataset, split_counts


def synthetic(num_train: int = 256, num_test: int = 64, seed: int = 0) -> Dataset:
    """Makes a tiny, learnable fake dataset: one bright bar per class, on noise.

    Classes 0..4 are horizontal bars (3 px thick) at rows 3, 8, 13, 18, 23; classes 5..9
    vertical bars at the same columns. Each image shifts its bar by -1..1 px in each
    direction, scales its brightness to 160..255 and adds uniform noise 0..63. Labels
    cycle through the classes in a random order, so each split is balanced within one.

    Args:
      num_train: number of training examples (>= 1).
      num_test: number of test examples (>= 1).
      seed: seed of ``np.random.default_rng``; the same seed gives the same data.

    Returns:
      A :class:`Dataset` named ``"synthetic"`` with ``source="synthetic"``: uint8 images
      ``[num_train, 28, 28, 1]``, ``[num_test, 28, 28, 1]`` and int32 labels.

    Raises:
      ValueError: if ``num_train`` or ``num_test`` is smaller than 1.

    Example:
      >>> ds = synthetic(num_train=100, num_test=20, seed=1)
      >>> ds.train_images.shape, ds.test_labels.shape
      ((100, 28, 28, 1), (20,))
    """
    if num_train < 1 or num_test < 1:
        raise ValueError(f"synthetic: num_train={num_train} and num_test={num_test} must be >= 1")
    rng = np.random.default_rng(seed)
    h, w, _ = IMAGE_SHAPE
    templates = np.zeros((NUM_CLASSES, h, w), np.float32)
    for k in range(NUM_CLASSES):
        at = 3 + 5 * (k % 5)
        if k < 5:
            templates[k, at - 1 : at + 2, 2:-2] = 1.0
        else:
            templates[k, 2:-2, at - 1 : at + 2] = 1.0

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.permutation(np.arange(n) % NUM_CLASSES)
        dy, dx = rng.integers(-1, 2, size=(2, n))
        rows = (np.arange(h)[None, :] - dy[:, None]) % h
        cols = (np.arange(w)[None, :] - dx[:, None]) % w
        bars = templates[labels[:, None, None], rows[:, :, None], cols[:, None, :]]
        bright = rng.uniform(160, 255, size=(n, 1, 1))
        noise = rng.uniform(0, 64, size=(n, h, w))
        images = np.clip(bars * bright + noise, 0, 255).astype(np.uint8)
        return images[..., None], labels.astype(np.int32)

    train, test = split(num_train), split(num_test)
    note = f"synthetic bars (seed {seed}, {split_counts(train[1], test[1])})"
    return Dataset("synthetic", *train, *test, source="synthetic", note=note)
