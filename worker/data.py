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
from typing import Any

# the examples a worker's shuffle buffer holds of a streamed source, which ``strata.memory``
# counts in the task's data term
from strata.memory import STREAM_SHUFFLE_EXAMPLES  # noqa: F401
from strata.jobspec import DataSpec, TrainingSpec

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


SYNTHETIC_TOKENS = 100  # integer inputs (token ids) are drawn from [0, SYNTHETIC_TOKENS)


def load_synthetic_splits(input_shape: tuple[int, ...], classes: int, examples: int,
                          integer: bool = False) -> Splits:
    n_train = int(examples) if examples and examples > 0 else SYNTHETIC_DEFAULT_TRAIN
    rng = np.random.default_rng(SYNTHETIC_SEED)
    features = int(np.prod(input_shape))
    teacher = rng.standard_normal((features, classes), dtype=np.float32)
    shape = (n_train + SYNTHETIC_TEST,) + tuple(input_shape)
    if integer:  # token ids for a model that embeds them
        x = rng.integers(0, SYNTHETIC_TOKENS, shape).astype(np.float32)
    else:
        x = rng.standard_normal(shape, dtype=np.float32)
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


def load_splits(data: DataSpec, input_shape: tuple[int, ...], output_shape: tuple[int, ...],
                input_dtype: str = "float32") -> Splits:
    """Loads the full splits for the spec's ``data`` and checks them against the model's shapes."""
    source = data.source
    if source == "digits":
        s = load_digits_splits()
    elif source == "synthetic":
        if len(output_shape) != 1:
            raise DataError("data.source", f"synthetic data needs a model with one output axis "
                                           f"(classes); the model outputs {list(output_shape)}")
        s = load_synthetic_splits(tuple(input_shape), int(output_shape[0]), data.examples,
                                  integer=input_dtype.startswith(("int", "uint")))
    elif source == "npz":
        s = load_npz_splits(data.path)
    elif source in ("tfrecord", "csv", "images"):
        s = load_streamed_splits(data)
    else:
        raise DataError("data.source", f"unknown source {source!r}; use digits, synthetic, npz, "
                                       "tfrecord, csv or images")
    field = "data.source" if source in ("digits", "synthetic") else "data.path"
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


def make_train_dataset(x: np.ndarray, y: np.ndarray, per_replica_batch: int, seed: int,
                       skip: int = 0):
    """An endless tf.data pipeline over one worker's shard: shuffles row indices (reshuffled
    every pass), batches them and gathers the rows from ONE in-memory copy of the shard, so
    the shard is held once (not again in a shuffle buffer). Every worker can draw any number
    of batches, so all workers run exactly the same number of steps. ``skip``: batches to
    leave out first (a task resumed at that step), skipped as index batches before the gather,
    so it costs only the shuffles; the order is a function of ``seed`` alone."""
    import tensorflow as tf

    xt = tf.constant(x)
    yt = tf.constant(y)
    n = int(x.shape[0])
    ds = tf.data.Dataset.range(n).shuffle(n, seed=seed, reshuffle_each_iteration=True).repeat()
    ds = ds.batch(per_replica_batch, drop_remainder=True)
    if skip > 0:
        ds = ds.skip(skip)
    ds = ds.map(lambda i: (tf.gather(xt, i), tf.gather(yt, i)))
    return ds.prefetch(1)


def make_global_dataset(x: np.ndarray, y: np.ndarray, global_batch: int, index: int,
                        pipelines: int, per_replica_batch: int, seed: int, skip: int = 0,
                        trace: str = ""):
    """An elastic job's input for worker ``index`` of ``pipelines``: ONE order of the whole
    training set, the same on every worker (shuffled from ``seed``, reshuffled every pass),
    cut into global batches; each worker takes its contiguous share of each global batch, in
    per-replica batches. The position is a function of the step alone, whatever the width:
    a job resized at step S (``skip``) goes on from example ``S * global_batch`` of the same
    order, so no example of an epoch is seen twice or skipped. Every worker holds the whole
    set (a fixed-width job holds its shard: ``make_train_dataset``). ``trace``: a file that
    gets, for each batch made, ``step worker-of-pipelines index,index,...`` (the examples'
    rows; ``STRATA_TRACE_EXAMPLES``)."""
    import tensorflow as tf

    xt = tf.constant(x)
    yt = tf.constant(y)
    n = int(x.shape[0])
    share = global_batch // pipelines
    ds = tf.data.Dataset.range(n).shuffle(n, seed=seed, reshuffle_each_iteration=True).repeat()
    ds = ds.batch(global_batch, drop_remainder=True)
    if skip > 0:
        ds = ds.skip(skip)
    ds = ds.map(lambda i: i[index * share:(index + 1) * share])
    if trace:
        ds = ds.enumerate(start=skip).map(
            lambda step, i: _traced(tf, trace, step, i, index, pipelines))
    if per_replica_batch != share:
        ds = ds.unbatch().batch(per_replica_batch, drop_remainder=True)
    ds = ds.map(lambda i: (tf.gather(xt, i), tf.gather(yt, i)))
    return ds.prefetch(1)


def _traced(tf: Any, path: str, step: Any, rows: Any, index: int, pipelines: int) -> Any:
    """``rows`` of global ``step``, appended to ``path`` as they are made (a batch made
    ahead of a stop is written and never trained: readers keep, for each step, the lines of
    the last attempt that made it)."""
    def write(s: Any, r: Any) -> Any:
        with open(path, "a") as f:
            f.write(f"{int(s)} {index}-of-{pipelines} {','.join(str(int(v)) for v in r)}\n")
        return r
    out = tf.numpy_function(write, [step, rows], tf.int64, stateful=True)
    out.set_shape(rows.shape)
    return out


# --------------------------------------------------------------------------------------------
# streamed sources: tfrecord, csv, images (tf.data over the files, never loaded whole)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp")


def data_files(pattern: str, field: str) -> list[str]:
    """The files of ``pattern``: a directory's files, a glob's matches, or one file; sorted."""
    import glob

    if os.path.isdir(pattern):
        found = sorted(os.path.join(pattern, f) for f in os.listdir(pattern)
                       if os.path.isfile(os.path.join(pattern, f)))
    else:
        found = sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
    if not found:
        raise DataError(field, f"no files match {pattern!r}")
    return found


def _image_files(root: str, field: str) -> tuple[list[str], list[int], list[str]]:
    """(files, labels, class names) of a directory per class, as Keras'
    ``image_dataset_from_directory`` reads it (classes in sorted order)."""
    if not os.path.isdir(root):
        raise DataError(field, f"{root!r} is not a directory (one sub-directory per class)")
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not classes:
        raise DataError(field, f"{root!r} has no class sub-directories")
    files, labels = [], []
    for k, c in enumerate(classes):
        for base, _dirs, names in sorted(os.walk(os.path.join(root, c))):
            for n in sorted(names):
                if n.lower().endswith(IMAGE_EXTENSIONS):
                    files.append(os.path.join(base, n))
                    labels.append(k)
    if not files:
        raise DataError(field, f"{root!r} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    return files, labels, classes


def csv_columns(path: str) -> list[str]:
    """The header of a CSV file."""
    import csv

    try:
        with open(path, newline="") as f:
            header = next(csv.reader(f), None)
    except OSError as e:
        raise DataError("data.path", f"cannot read {path}: {e.strerror}") from None
    if not header:
        raise DataError("data.path", f"{path} is empty (a header row of column names is needed)")
    return [h.strip() for h in header]


def check_streamed(data: DataSpec) -> None:
    """What can be checked before TensorFlow is imported: the files exist, the label column."""
    field = "data.path"
    if data.source == "images":
        _image_files(data.path, field)
        if data.test_path:
            _image_files(data.test_path, "data.test_path")
        return
    files = data_files(data.path, field)
    if data.test_path:
        data_files(data.test_path, "data.test_path")
    if data.source == "csv":
        cols = csv_columns(files[0])
        if data.label not in cols:
            raise DataError("data.label", f"{files[0]} has no column {data.label!r} (columns: "
                                          f"{', '.join(cols[:20])})")


def stream(data: DataSpec, split: str, *, shards: int = 1, index: int = 0,
           input_names: tuple[str, ...] = ()):
    """A tf.data dataset of ``(features, label)`` examples (unbatched) of a streamed source's
    ``split`` ("train" or "test"), this worker's ``index``-th of ``shards``: by file when there
    are at least as many files as shards, else by record. Without ``data.test_path`` every
    ``round(1 / test_fraction)``-th record of each file is the test split (the same records
    whatever the sharding). Features: one tensor, or a dict by name for several inputs
    (tfrecord; ``input_names`` are the model's inputs)."""
    import tensorflow as tf

    held_out = not data.test_path
    every = max(2, round(1 / data.test_fraction))
    src_path = data.test_path if (split == "test" and data.test_path) else data.path
    field = "data.test_path" if src_path is data.test_path and data.test_path else "data.path"

    if data.source == "images":
        files, labels, _ = _image_files(src_path, field)
        h, w = data.image_size
        paths = tf.data.Dataset.from_tensor_slices((files, labels))

        def load(p, y):
            img = tf.io.decode_image(tf.io.read_file(p), channels=3, expand_animations=False)
            img = tf.image.resize(img, (h, w))  # float32, 0-255 as Keras reads them
            return img, tf.cast(y, tf.int64)

        ds = paths
        if held_out:
            keep = (lambda i, e: i % every == 0) if split == "test" else (lambda i, e: i % every != 0)
            ds = ds.enumerate().filter(keep).map(lambda i, e: e)
        if split == "train" and shards > 1:
            ds = ds.shard(shards, index)
        return ds.map(load, num_parallel_calls=2, deterministic=True)

    files = data_files(src_path, field)
    by_file = split == "train" and shards > 1 and len(files) >= shards
    if by_file:
        files = files[index::shards]

    if data.source == "tfrecord":
        spec = {n: tf.io.FixedLenFeature(list(f["shape"]), getattr(tf, f["dtype"]))
                for n, f in data.features.items()}
        inputs = [n for n in data.features if n != data.label]
        if input_names and len(inputs) > 1:
            missing = [n for n in input_names if n not in inputs]
            if missing:
                raise DataError("data.features", f"the model's inputs {missing} are not among "
                                                 f"the features {inputs}")

        def read(path):
            return tf.data.TFRecordDataset(path)

        def parse(record):
            ex = tf.io.parse_single_example(record, spec)
            x = ex[inputs[0]] if len(inputs) == 1 else {n: ex[n] for n in inputs}
            return x, ex[data.label]
    else:  # csv
        cols = csv_columns(files[0])
        li = cols.index(data.label)

        def read(path):
            return tf.data.TextLineDataset(path).skip(1)

        def parse(line):
            values = tf.io.decode_csv(line, record_defaults=[[0.0]] * len(cols))
            x = tf.stack([v for i, v in enumerate(values) if i != li])
            return x, values[li]

    def per_file(path):
        ds = read(path)
        if held_out:
            keep = (lambda i, r: i % every == 0) if split == "test" else (lambda i, r: i % every != 0)
            ds = ds.enumerate().filter(keep).map(lambda i, r: r)
        return ds

    ds = tf.data.Dataset.from_tensor_slices(files).interleave(
        per_file, cycle_length=min(4, len(files)), deterministic=True)
    if split == "train" and shards > 1 and not by_file:
        ds = ds.shard(shards, index)
    return ds.map(parse, num_parallel_calls=2, deterministic=True)


def tf_targets(y, loss: str, output_shape: tuple[int, ...]):
    """``prepare_targets`` on a tensor: labels as ``loss`` expects them."""
    import tensorflow as tf

    classes = int(output_shape[-1]) if output_shape else 1
    if loss == "sparse_categorical_crossentropy":
        return tf.cast(tf.reshape(y, []), tf.int64)
    if y.dtype.is_integer or (y.shape.rank == 0 and classes > 1):
        return tf.one_hot(tf.cast(y, tf.int64), classes, dtype=tf.float32)
    return tf.reshape(tf.cast(y, tf.float32), list(output_shape))


def count_examples(data: DataSpec) -> int:
    """Training examples of a streamed source (one pass over the files: only when the job
    gives epochs, not steps)."""
    import tensorflow as tf

    ds = stream(data, "train").map(lambda x, y: 0)
    return int(ds.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))


def load_streamed_splits(data: DataSpec) -> Splits:
    """A streamed source read whole into arrays, for the runners that hold their data set in
    NumPy (parameter-server, pipeline and hybrid drivers; one input only)."""
    import numpy as np_

    out = []
    for split in ("train", "test"):
        xs, ys = [], []
        for x, y in stream(data, split).as_numpy_iterator():
            if isinstance(x, dict):
                raise DataError("data.features", "models with several inputs train "
                                                 "data-parallel only (multi_worker_mirrored)")
            xs.append(x)
            ys.append(y)
        if not xs:
            raise DataError("data.path", f"the {split} split is empty")
        out += [np_.stack(xs), np_.asarray(ys)]
    return Splits(*out)
