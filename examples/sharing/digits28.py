"""scikit-learn's load_digits (1,797 real 8x8 digits) as a Keras-layout npz of 28x28x1 uint8.

Each pixel becomes a 3x3 block (24x24), padded by 2 to MNIST's 28x28 frame; a seeded
shuffle, then 1,500 training and 297 test images. The backbone of docs/sharing.md's LoRA
row is trained on it: digits the MNIST rows never see, drawn and scanned otherwise.

Run: ``python examples/sharing/digits28.py runs/digits28.npz``
"""

import sys

import numpy as np
from sklearn.datasets import load_digits


def main(path: str) -> None:
    d = load_digits()
    big = np.kron(d.images / 16.0, np.ones((3, 3)))  # [N, 24, 24] in [0, 1]
    big = np.pad(big, ((0, 0), (2, 2), (2, 2)))[..., None]  # [N, 28, 28, 1]
    x, y = np.round(big * 255).astype(np.uint8), d.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    np.savez(path, x_train=x[:1500], y_train=y[:1500], x_test=x[1500:], y_test=y[1500:])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "digits28.npz")
