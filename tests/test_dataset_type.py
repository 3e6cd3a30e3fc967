"""ONE dataset type for every task (seam 2): features of any shape, class ids or float targets.

The generic checks of :class:`meshensemble.data.Dataset` (one line naming the array, its
shape and the expected one), the old names kept as aliases, ``RegressionData`` being the
same type, and the validation split and data identity generic over it while MNIST's stay
bitwise what they were (the pinned values were computed with the code before the change).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import meshensemble as me
from meshensemble.data import DataError, Dataset
from meshensemble.data.split import split_validation, validation_indices
from meshensemble.training import identity


def _tabular(n: int = 12, m: int = 6, classes: int = 3, **kw) -> Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n + m, 4)).astype(np.float32)
    y = np.arange(n + m) % classes
    return Dataset("tab", x[:n], y[:n], x[n:], y[n:], source="arrays", note="t", **kw)


def _floats(n: int = 20, m: int = 5, t: int = 2) -> Dataset:
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(n + m, 3)), rng.normal(size=(n + m, t))
    return Dataset("reg", x[:n], y[:n], x[n:], y[n:], source="arrays")


def _one_line(err: pytest.ExceptionInfo, *parts: str) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    for part in parts:
        assert part in text, (part, text)
    return text


def test_any_features_and_class_ids_with_names_and_the_old_aliases() -> None:
    ds = _tabular(class_names=("a", "b", "c"))
    assert ds.num_classes == 3 and ds.class_names == ("a", "b", "c")
    assert ds.input_shape == ds.image_shape == (4,) and ds.num_targets is None
    assert ds.y_train.dtype == np.int32 and ds.x_train.dtype == np.float32
    assert ds.train_images is ds.x_train and ds.test_labels is ds.y_test
    assert (ds.num_train, ds.num_test) == (12, 6)
    with pytest.raises(AttributeError):
        ds.train_images = ds.x_test  # type: ignore[misc]
    # the old keywords replace the field (dataclasses.replace keeps working with them)
    other = dataclasses.replace(ds, train_labels=ds.y_train[::-1].copy())
    assert other.y_train.tolist() == ds.y_train[::-1].tolist()
    assert other.class_names == ds.class_names
    images = np.zeros((5, 8, 8, 3), np.uint8)
    rgb = Dataset("rgb", images, np.arange(5), images[:2], np.array([0, 4]), source="arrays")
    assert rgb.input_shape == (8, 8, 3) and rgb.num_classes == 5  # from the data: ids 0..4


def test_float_targets_and_regression_data_is_the_same_type() -> None:
    ds = _floats()
    assert ds.num_classes is None and ds.class_names is None and ds.num_targets == 2
    assert ds.y_train.dtype == np.float32
    toy = me.data.toy1d(seed=0)
    assert me.data.RegressionData is Dataset and isinstance(toy, Dataset)
    assert toy.source == "toy1d" and toy.num_classes is None and toy.targets == 1
    assert "20 train / 200 test" in toy.note
    assert set(me.data.standardizer(toy)) == {"x_mean", "x_std", "y_mean", "y_std"}


@pytest.mark.parametrize(
    "change, parts",
    [
        (dict(x_test=np.zeros((6, 5), np.float32)), ["x_test has shape (6, 5)", "expected [N, 4]"]),
        (dict(x_test=np.zeros((6, 4), np.float64)), ["x_test", "float64", "float32"]),
        (dict(y_test=np.arange(5)), ["x_test has 6 examples", "y_test has 5 (shape (5,))"]),
        (dict(x_test=np.zeros((0, 4), np.float32), y_test=np.zeros(0, int)), ["x_test has no"]),
        (dict(y_train=np.zeros((12, 2), int)), ["y_train has shape (12, 2)", "expected [N]"]),
        (dict(y_train=np.full(12, 3)), ["y_train (shape (12,)) has class id 3 at index 0"]),
        (dict(y_train=np.full(12, -1)), ["class id -1 at index 0", "[0, 3)"]),
        (dict(x_train=np.full((12, 4), np.nan)), ["x_train (shape (12, 4)) holds NaN", "index 0"]),
        (dict(x_train=np.array(["a"] * 12)[:, None]), ["x_train has dtype <U1"]),
        (dict(class_names=("a", "b")), ["2 class_names for 3 classes"]),
        (dict(source="web"), ["unknown source 'web'"]),
    ],
)
def test_a_bad_array_is_one_line_naming_it_its_shape_and_the_expected_one(change, parts) -> None:
    ds = _tabular(num_classes=3)
    with pytest.raises(DataError) as err:
        dataclasses.replace(ds, **change)
    _one_line(err, *parts)


@pytest.mark.parametrize(
    "change, parts",
    [
        (dict(y_train=np.zeros(20)), ["y_train has float dtype and shape (20,)", "[N, 1]"]),
        (dict(y_test=np.zeros((5, 3))), ["y_test has shape (5, 3)", "expected [N, 2]"]),
        (dict(y_test=np.arange(5)), ["y_test has dtype int64", "same kind"]),
        (dict(y_train=np.full((20, 2), np.inf)), ["y_train (shape (20, 2)) holds NaN or inf"]),
        (dict(num_classes=2), ["num_classes=2 for float targets of shape (20, 2)"]),
    ],
)
def test_bad_float_targets_are_one_line(change, parts) -> None:
    with pytest.raises(DataError) as err:
        dataclasses.replace(_floats(), **change)
    _one_line(err, *parts)


def test_mnist_names_keep_mnist_s_checks_and_messages() -> None:
    ds = me.data.synthetic(20, 10)
    bad = np.zeros((20, 8, 8, 1), np.uint8)
    with pytest.raises(DataError) as err:
        dataclasses.replace(ds, x_train=bad)
    _one_line(err, "train split: images have shape (20, 8, 8, 1)", "[N, 28, 28, 1]")
    with pytest.raises(DataError) as err:
        Dataset("mnist", ds.x_train, ds.y_train, ds.x_test, ds.y_test, "npz", "x", num_classes=5)
    _one_line(err, "num_classes=5", "10 classes")
    # not an MNIST name: the same images are any 28x28 data, classes from the data
    other = Dataset("mine", ds.x_train, ds.y_train % 4, ds.x_test, ds.y_test % 4, "arrays")
    assert other.num_classes == 4


def test_the_validation_split_of_class_ids_is_bitwise_what_it_was() -> None:
    split = split_validation(me.data.synthetic(200, 20), 50, seed=3)
    assert split.fingerprint == "f02304ac7f7eeb67"  # computed before the type was generic
    assert split.record()["per_class"] == [5] * 10 and split.images is split.x


def test_the_validation_split_of_float_targets_is_seeded_and_random() -> None:
    ds = _floats(n=40)
    a, b = split_validation(ds, 10, seed=0), split_validation(ds, 10, seed=1)
    again = split_validation(ds, 10, seed=0)
    assert np.array_equal(a.indices, again.indices) and not np.array_equal(a.indices, b.indices)
    assert np.array_equal(a.y, ds.y_train[a.indices]) and a.train.num_train == 30
    assert "per_class" not in a.record() and a.record()["count"] == 10
    # not the first rows, not every row of a class: a random subset of all rows
    picked = validation_indices(ds.y_train, 10, seed=0)
    assert picked.tolist() != list(range(10)) and np.all(np.diff(picked) > 0)


def test_the_data_identity_of_mnist_data_is_what_old_runs_recorded() -> None:
    held = identity.data_identity(me.data.synthetic(64, 16), None, validation=16, seed=1)
    assert held["content"] == "218b63dfc9fed21b"  # computed before the type was generic
    assert held["splits"]["test"].startswith("bytes:e9009b3c686fc744")
    assert identity.data_identity(me.data.synthetic(64, 16), None)["content"] == "407a7c73df8c7276"


def test_the_data_identity_of_float_targets_sees_every_target() -> None:
    ds = _floats(n=40)
    held = identity.data_identity(ds, None, validation=10, seed=0)
    assert held["num_train"] == 40 and held["splits"]["validation"].startswith("bytes:")
    y = ds.y_train.copy()
    y[17, 1] += 1e-3  # one target of one example
    now = identity.data_identity(dataclasses.replace(ds, y_train=y), None, validation=10, seed=0)
    assert identity.differing_splits(held, now) in (["train"], ["validation"])
    assert identity.data_identity(ds, None, validation=10, seed=0) == held
