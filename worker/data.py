"""Training data for task processes: loading, labels, sharding and the per-worker tf.data input.

Sources (``spec["data"]["source"]``):

- ``digits``: scikit-learn's 1,797 real 8x8 digit images (shipped offline with scikit-learn),
  features / 16.0 as float32, split 80/20 by a fixed permutation (seed 0, independent of
  ``training.seed``): 1,437 train and 360 test rows.
- ``synthetic``: standard-normal float32 inputs of the model's input shape with labels from a
  fixed random linear teacher (argmax of x @ W), so a model can actually learn; ``examples``
  train rows (0 means 4,096) plus 1,024 test rows. Fixed seed, so every worker (and every
  rerun) sees the same data.
- ``npz``: arrays ``x_train``, ``y_train``, ``x_test``, ``y_test`` from ``data.path``.

The loading functions use only NumPy; TensorFlow is imported inside ``make_train_dataset``.
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import os
from dataclasses import dataclass

from strata.spec import DataSpec, TrainingSpec

import numpy as np

DIGITS_SPLIT_SEED = 0
SYNTHETIC_SEED = 1234
SYNTHETIC_DEFAULT_TRAIN = 4096
SYNTHETIC_TEST = 1024

CLASSIFICATION_LOSSES = ("sparse_categorical_crossentropy", "categorical_crossentropy")


class DataError(Exception):
    """The data section cannot be used; ``field`` names the spec field (e.g. ``data.path``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass
class Splits:
    """The full training and test splits as NumPy arrays. ``y_*`` hold integer class labels
    (shape ``(n,)``) for class data, or float targets for regression npz data."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def n_train(self) -> int:
        return int(self.x_train.shape[0])


# --------------------------------------------------------------------------------------------
# loading


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``sklearn.datasets.load_digits()`` data and target. Reads scikit-learn's bundled
    ``digits.csv.gz`` directly (the same file load_digits parses) to skip the ~1.8 s import of
    sklearn.datasets in every task process; falls back to load_digits if the file moved."""
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            path = os.path.join(base, "datasets", "data", "digits.csv.gz")
            if os.path.exists(path):
                with gzip.open(path, "rt") as f:
                    raw = np.loadtxt(f, delimiter=",")
                return raw[:, :-1], raw[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # pragma: no cover - fallback

    d = load_digits()
    return d.data, d.target.astype(np.int64)


def load_digits_splits() -> Splits:
    x, y = _digits_arrays()
    x = (x / 16.0).astype(np.float32)
    n = x.shape[0]
    perm = np.random.RandomState(DIGITS_SPLIT_SEED).permutation(n)
    n_test = int(math.ceil(0.2 * n))
    test, train = perm[:n_test], perm[n_test:]
    return Splits(x[train], y[train], x[test], y[test])


def load_synthetic_splits(input_shape: tuple[int, ...], classes: int, examples: int) -> Splits:
    n_train = int(examples) if examples and examples > 0 else SYNTHETIC_DEFAULT_TRAIN
    rng = np.random.default_rng(SYNTHETIC_SEED)
    features = int(np.prod(input_shape))
    teacher = rng.standard_normal((features, classes), dtype=np.float32)
    x = rng.standard_normal((n_train + SYNTHETIC_TEST,) + tuple(input_shape), dtype=np.float32)
    y = np.argmax(x.reshape(x.shape[0], features) @ teacher, axis=1).astype(np.int64)
    return Splits(x[:n_train], y[:n_train], x[n_train:], y[n_train:])


NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


def _open_npz(path: str):
    if not path:
        raise DataError("data.path", "data.source npz needs data.path (an .npz file with x_train, "
                                     "y_train, x_test, y_test)")
    try:
        f = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise DataError("data.path", f"cannot read {path} as .npz: {e}") from None
    if not hasattr(f, "files"):
        raise DataError("data.path", f"{path} is a single .npy array, not an .npz archive with "
                                     f"{', '.join(NPZ_KEYS)}")
    missing = [k for k in NPZ_KEYS if k not in f.files]
    if missing:
        f.close()
        raise DataError("data.path", f"{path} lacks the arrays {', '.join(missing)} "
                                     f"(it has {', '.join(f.files) or 'none'})")
    return f


def load_npz_keys(path: str) -> list[str]:
    """Checks that ``path`` is a readable .npz with the four arrays (reads only its index)."""
    with _open_npz(path) as f:
        return list(f.files)


def load_npz_splits(path: str) -> Splits:
    f = _open_npz(path)
    try:
        with f:
            arrays = {k: f[k] for k in NPZ_KEYS}
    except (OSError, ValueError, EOFError) as e:
        raise DataError("data.path", f"cannot read {path} as .npz: {e}") from None
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim < 2 or y.ndim < 1 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
            raise DataError("data.path", f"{path}: x_{split} {x.shape} and y_{split} {y.shape} "
                                         "must be non-empty with one row per example")
    out = []
    for k in ("x_train", "y_train", "x_test", "y_test"):
        a = arrays[k]
        if k.startswith("x"):
            a = a.astype(np.float32, copy=False)
        elif np.issubdtype(a.dtype, np.integer):
            a = a.astype(np.int64, copy=False)
        else:
            a = a.astype(np.float32, copy=False)
        out.append(np.ascontiguousarray(a))
    return Splits(*out)


def load_splits(data: DataSpec, input_shape: tuple[int, ...], output_shape: tuple[int, ...]) -> Splits:
    """Loads the full splits for the spec's ``data`` and checks them against the model's shapes."""
    source = data.source
    if source == "digits":
        s = load_digits_splits()
    elif source == "synthetic":
        if len(output_shape) != 1:
            raise DataError("data.source", f"synthetic data needs a model with one output axis "
                                           f"(classes); the model outputs {list(output_shape)}")
        s = load_synthetic_splits(tuple(input_shape), int(output_shape[0]), data.examples)
    elif source == "npz":
        s = load_npz_splits(data.path)
    else:
        raise DataError("data.source", f"unknown source {source!r}; use digits, synthetic or npz")
    field = "data.path" if source == "npz" else "data.source"
    feats_model = int(np.prod(input_shape))
    for name, x in (("x_train", s.x_train), ("x_test", s.x_test)):
        if tuple(x.shape[1:]) != tuple(input_shape):
            if int(np.prod(x.shape[1:])) == feats_model:
                x = x.reshape((x.shape[0],) + tuple(input_shape))
                setattr(s, name, x)
            else:
                raise DataError(field, f"{name} rows have shape {list(x.shape[1:])}, the model "
                                       f"takes {list(input_shape)}")
    return s


# --------------------------------------------------------------------------------------------
# labels, shards


def prepare_targets(y: np.ndarray, loss: str, output_shape: tuple[int, ...], field: str) -> np.ndarray:
    """Converts labels to what ``loss`` expects: int class ids for sparse categorical
    crossentropy, one-hot float32 for categorical crossentropy, float32 targets (one-hot for
    integer class labels) for mean squared error."""
    classes = int(output_shape[-1]) if output_shape else 1
    is_int = np.issubdtype(y.dtype, np.integer)
    if loss == "sparse_categorical_crossentropy":
        if y.ndim == 2 and y.shape[1] == classes and classes > 1 and not is_int:
            y = np.argmax(y, axis=1)  # one-hot given
        elif y.ndim == 2 and y.shape[1] == 1:
            y = y[:, 0]
        if y.ndim != 1:
            raise DataError(field, f"sparse_categorical_crossentropy needs one class id per "
                                   f"example; labels have shape {list(y.shape)}")
        y = y.astype(np.int64)
        if y.size and (y.min() < 0 or y.max() >= classes):
            raise DataError(field, f"labels run from {y.min()} to {y.max()}; the model has "
                                   f"{classes} classes")
        return y
    if y.ndim == 1 and is_int:
        if y.size and (y.min() < 0 or y.max() >= classes):
            raise DataError(field, f"labels run from {y.min()} to {y.max()}; the model has "
                                   f"{classes} outputs")
        return np.eye(classes, dtype=np.float32)[y]
    y = y.astype(np.float32)
    if y.ndim == 1:
        y = y[:, None]
    if tuple(y.shape[1:]) != tuple(output_shape):
        raise DataError(field, f"targets have shape {list(y.shape[1:])}, the model outputs "
                               f"{list(output_shape)}")
    return y


def shard(x: np.ndarray, y: np.ndarray, index: int, num_workers: int) -> tuple[np.ndarray, np.ndarray]:
    """This worker's rows of the training set: ``index::num_workers``."""
    return np.ascontiguousarray(x[index::num_workers]), np.ascontiguousarray(y[index::num_workers])


def steps_per_epoch(n_train: int, global_batch: int) -> int:
    return max(1, n_train // global_batch)


def total_steps(training: TrainingSpec, n_train: int, global_batch: int) -> int:
    if training.steps > 0:
        return training.steps
    return max(1, training.epochs) * steps_per_epoch(n_train, global_batch)


def make_train_dataset(x: np.ndarray, y: np.ndarray, per_replica_batch: int, seed: int):
    """An endless tf.data pipeline over one worker's shard: shuffles row indices (reshuffled
    every pass), batches them and gathers the rows from ONE in-memory copy of the shard, so
    the shard is held once (not again in a shuffle buffer). Every worker can draw any number
    of batches, so all workers run exactly the same number of steps."""
    import tensorflow as tf

    xt = tf.constant(x)
    yt = tf.constant(y)
    n = int(x.shape[0])
    ds = tf.data.Dataset.range(n).shuffle(n, seed=seed, reshuffle_each_iteration=True).repeat()
    ds = ds.batch(per_replica_batch, drop_remainder=True)
    ds = ds.map(lambda i: (tf.gather(xt, i), tf.gather(yt, i)))
    return ds.prefetch(1)
