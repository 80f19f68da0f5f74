"""Users' own models, with real processes: a .keras file uploaded with the job (a residual CNN,
trained data-parallel and as a pipeline cut only between its blocks), an Embedding text
classifier on a corpus made here, and the outputs fetched back with `strata download`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from strata.types import JobState

pytestmark = pytest.mark.integration  # starts coordinator, agent and TensorFlow processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 300


def _residual_cnn(path: str) -> None:
    """Digits as 8x8x1 images through two residual blocks (functional, Add), saved as .keras."""
    import keras
    from keras import layers as L

    keras.utils.set_random_seed(1)
    i = keras.Input((8, 8, 1), name="img")
    x = L.Conv2D(16, 3, padding="same", activation="relu", name="stem")(i)
    for b in range(2):
        y = L.Conv2D(16, 3, padding="same", name=f"b{b}_conv1")(x)
        # momentum 0.9: the moving statistics catch up within a short training run
        y = L.BatchNormalization(momentum=0.9, name=f"b{b}_bn")(y)
        y = L.ReLU(name=f"b{b}_relu")(y)
        y = L.Conv2D(16, 3, padding="same", name=f"b{b}_conv2")(y)
        x = L.Add(name=f"b{b}_add")([x, y])
    x = L.GlobalAveragePooling2D(name="gap")(x)
    keras.Model(i, L.Dense(10, name="logits")(x), name="resnet_digits").save(path)


@pytest.fixture(scope="module")
def resnet_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("models") / "resnet.keras")
    _residual_cnn(path)
    return path


def _job_file(tmp_path, body: dict) -> str:
    import yaml

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(body))
    return str(path)


def test_keras_file_residual_cnn_trains_and_downloads(cluster, client, resnet_file, tmp_path):
    # the job file names the model relative to itself
    os.symlink(resnet_file, tmp_path / "resnet.keras")
    job_yaml = _job_file(tmp_path, {
        "name": "resnet-file", "strategy": "multi_worker_mirrored", "workers": 2,
        "model": {"keras_file": "resnet.keras"},
        "data": {"source": "digits", "batch_size": 64},
        "training": {"epochs": 6, "optimizer": {"name": "adam", "learning_rate": 0.003}},
        "memory": {"profile": "false"}})
    job = client.submit(job_yaml)
    final = client.wait(job.id, timeout=TIMEOUT_S)
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.test_accuracy >= 0.85, final.metrics
    outputs = client.get(job.id).outputs
    assert [o for o in outputs if not o.startswith("tensorboard/")] == ["metrics.json",
                                                                        "model.keras"]
    # each worker's TensorBoard scalars come with them (both wrote to the shared directory)
    assert {o.split("/")[1] for o in outputs if o.startswith("tensorboard/")} == {
        "worker-0", "worker-1"}
    # `strata status` names the outputs; `strata download` fetches them
    env = dict(os.environ, PYTHONPATH=ROOT)
    status = subprocess.run([sys.executable, "-m", "strata.cli", "status", job.id,
                             "--coordinator", cluster.address],
                            capture_output=True, text=True, timeout=60, env=env)
    assert "outputs:" in status.stdout and "strata download" in status.stdout, status.stdout
    dest = tmp_path / "out"
    got = subprocess.run([sys.executable, "-m", "strata.cli", "download", job.id, str(dest),
                          "--coordinator", cluster.address],
                         capture_output=True, text=True, timeout=120, env=env)
    assert got.returncode == 0, got.stderr
    metrics = json.loads((dest / "metrics.json").read_text())
    assert metrics["test_accuracy"] == pytest.approx(final.metrics.test_accuracy)
    # the downloaded model loads and classifies the test split as the job reported
    import keras

    from strata.worker.data import load_digits_splits

    model = keras.saving.load_model(str(dest / "model.keras"), safe_mode=True)
    s = load_digits_splits()
    pred = model.predict(s.x_test.reshape(-1, 8, 8, 1), verbose=0).argmax(axis=1)
    assert float((pred == s.y_test).mean()) == pytest.approx(final.metrics.test_accuracy, abs=0.02)


def test_accumulated_slices_of_a_synchronized_batchnorm_model(client, resnet_file, tmp_path):
    # two replicas make its BatchNormalization layers synchronized, which TensorFlow cannot
    # run inside the slices' loop: the slices are written out instead
    os.symlink(resnet_file, tmp_path / "resnet.keras")
    job_yaml = _job_file(tmp_path, {
        "name": "resnet-slices", "strategy": "multi_worker_mirrored", "workers": 2,
        "model": {"keras_file": "resnet.keras"}, "gradients": {"accumulate": 2},
        "data": {"source": "digits", "batch_size": 64},
        "training": {"epochs": 6, "optimizer": {"name": "adam", "learning_rate": 0.003}},
        "memory": {"profile": "false"}})
    final = client.wait(client.submit(job_yaml).id, timeout=TIMEOUT_S)
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.test_accuracy >= 0.85, final.metrics
    assert all(0 < t.peak_memory_bytes <= t.memory_budget_bytes for t in final.tasks), final.tasks
    logs = b"".join(d for _, _, d in client.logs(final.id)).decode()
    assert "2 slices are written out" in logs, logs[-3000:]


def test_keras_file_residual_cnn_pipeline_cuts_only_between_blocks(cluster, client, resnet_file,
                                                                  tmp_path):
    spec = {"name": "resnet-pipe", "strategy": "pipeline", "stages": 2, "microbatches": 2,
            "model": {"keras_file": resnet_file},
            "data": {"source": "digits", "batch_size": 64},
            "training": {"epochs": 4, "optimizer": {"name": "adam", "learning_rate": 0.003}},
            "memory": {"profile": "false"}}
    plan = client.plan(spec)
    assert plan.feasible, plan.reason
    allowed = {"stem", "b0_add", "b1_add", "gap"}
    firsts = sorted({t.layers[0] for t in plan.tasks if t.layers})
    for t in plan.tasks:
        assert t.layers[-1] in allowed | {"logits"}, [list(x.layers) for x in plan.tasks]
    assert len(firsts) == 2
    job = client.submit(spec)
    final = client.wait(job.id, timeout=TIMEOUT_S)
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.test_accuracy >= 0.8, final.metrics
    # the model comes back whole, assembled from the stages, and classifies as reported
    files = client.download(job.id, str(tmp_path / "out"))
    assert sorted(os.path.basename(f) for f in files
                  if "tensorboard" not in f) == ["metrics.json", "model.keras"]
    import keras

    from strata.worker.data import load_digits_splits

    model = keras.saving.load_model(str(tmp_path / "out" / "model.keras"), safe_mode=True)
    s = load_digits_splits()
    pred = model.predict(s.x_test.reshape(-1, 8, 8, 1), verbose=0).argmax(axis=1)
    assert float((pred == s.y_test).mean()) == pytest.approx(final.metrics.test_accuracy, abs=0.02)
    # too many stages for its cut points: the reason says where it can be cut
    bad = client.plan(dict(spec, stages=6))
    assert not bad.feasible and "at most 5 stages" in bad.reason, bad.reason


def _corpus(path: str, n: int = 1200, length: int = 24, vocab: int = 200) -> None:
    """Two classes of token sequences: class 1 uses 'positive' words (100-199) more often."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, size=n)
    p_pos = np.where(y == 1, 0.35, 0.05)
    pos = rng.random((n, length)) < p_pos[:, None]
    x = np.where(pos, rng.integers(100, vocab, (n, length)), rng.integers(1, 100, (n, length)))
    k = n * 4 // 5
    np.savez(path, x_train=x[:k].astype(np.int32), y_train=y[:k], x_test=x[k:].astype(np.int32),
             y_test=y[k:])


def test_embedding_text_classifier_on_a_made_corpus(client, tmp_path):
    import keras
    from keras import layers as L

    data = str(tmp_path / "corpus.npz")
    _corpus(data)
    i = keras.Input((24,), dtype="int32", name="tokens")
    x = L.Embedding(200, 16, name="emb")(i)
    x = L.GlobalAveragePooling1D(name="pool")(x)
    x = L.Dense(16, activation="relu")(x)
    model = keras.Model(i, L.Dense(2, activation="softmax")(x))
    job = client.submit({
        "name": "text-clf", "strategy": "multi_worker_mirrored", "workers": 2,
        "model": {"keras_json": model.to_json()},
        "data": {"source": "npz", "path": data, "batch_size": 64},
        "training": {"epochs": 8, "optimizer": {"name": "adam", "learning_rate": 0.01}}})
    final = client.wait(job.id, timeout=TIMEOUT_S)
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.test_accuracy >= 0.9, final.metrics
    # Embedding is not among the calibrated kinds: memory.profile auto measured it first
    events = " ".join(e.message for e in client.watch(job.id, timeout=10))
    assert "memory probe" in events, events[:2000]


# --------------------------------------------------------------------------------------------
# users' own code


TRAIN_PY = '''
import glob
import os

import keras
import tensorflow as tf

from settings import DATA_DIR, GLOBAL_BATCH


def build_model():
    return keras.Sequential([keras.Input((64,), name="pixels"),
                             keras.layers.Dense(128, activation="relu"),
                             keras.layers.Dense(10)])


def _parse(record):
    f = tf.io.parse_single_example(record, {
        "x": tf.io.FixedLenFeature([64], tf.float32), "y": tf.io.FixedLenFeature([], tf.int64)})
    return f["x"], f["y"]


def make_dataset(input_context, split):
    files = sorted(glob.glob(os.path.join(DATA_DIR, f"{split}-*.tfrecord")))
    ds = tf.data.Dataset.from_tensor_slices(files)
    if split == "train":
        ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        batch = input_context.get_per_replica_batch_size(GLOBAL_BATCH)
    else:
        batch = 128
    ds = ds.interleave(tf.data.TFRecordDataset).map(_parse)
    if split == "train":
        ds = ds.shuffle(512, seed=input_context.input_pipeline_id)
    return ds.batch(batch)


def compiled_sgd():
    # compiled as TensorFlow's multi-worker Keras tutorial compiles its model
    model = build_model()
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.SGD(learning_rate=0.001),
                  metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(
                      k=3, name="top3")])
    return model


def unbatched():
    # no argument, single examples: the whole input, batched and sharded by Strata and the
    # strategy (tf.distribute's experimental_distribute_dataset)
    files = sorted(glob.glob(os.path.join(DATA_DIR, "train-*.tfrecord")))
    return tf.data.TFRecordDataset(files).map(_parse)


def unsharded(input_context, split):
    # each replica's batches, but every worker reads all of the data
    files = sorted(glob.glob(os.path.join(DATA_DIR, f"{split}-*.tfrecord")))
    return tf.data.TFRecordDataset(files).map(_parse).batch(
        input_context.get_per_replica_batch_size(GLOBAL_BATCH))


def compiled_batch_mean_loss():
    # a loss that averages the batch itself: a distributed step cannot honour it
    model = build_model()
    model.compile(optimizer="sgd", loss=lambda y, p: tf.reduce_mean(
        keras.losses.sparse_categorical_crossentropy(y, p, from_logits=True)))
    return model


class TwoLayers(keras.Model):
    """A subclassed model: no declared inputs, no variables until its first call."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(128, activation="relu")
        self.out = keras.layers.Dense(10)

    def call(self, x, training=False):
        return self.out(self.hidden(x))


def subclassed_model():
    return TwoLayers()


def two_outputs():
    i = keras.Input((64,), name="pixels")
    h = keras.layers.Dense(32, activation="relu")(i)
    return keras.Model(i, [keras.layers.Dense(10)(h), keras.layers.Dense(1)(h)])


def weighted(input_context, split):
    # class 0 does not count in training; in the test split only class 0 counts
    ds = make_dataset(input_context, split)
    zero = tf.constant(1.0 if split == "test" else 0.0)
    return ds.map(lambda x, y: (x, y, tf.where(tf.equal(y, 0), zero, 1.0 - zero)))


def pixels_only(input_context, split):
    return make_dataset(input_context, split).map(lambda x, y: x)


def onehot(input_context, split):
    return make_dataset(input_context, split).map(lambda x, y: (x, tf.one_hot(y, 10)))


def global_batches(input_context, split, drop_remainder=False):
    # batched by the global batch, not the replica's share: twice the rows planned for
    ds = make_dataset(input_context, split).unbatch()
    return ds.batch(GLOBAL_BATCH, drop_remainder=drop_remainder)


def global_batches_typed(input_context, split):
    return global_batches(input_context, split, drop_remainder=True)


def sequences():
    # variable-length sequences: the first three batches of each replica are 48 steps long,
    # every later one 64 (tf.function traces the step again for the new shape): the run's
    # peak grows after the probe's three steps
    b = 32
    def element(i):
        n = tf.where(i < 3 * b, 48, 64)
        x = tf.random.stateless_uniform([n, 32], seed=tf.stack([i, 0]))
        return x, tf.cast(i % 10, tf.int64)
    return tf.data.Dataset.range(1 << 30).map(element).padded_batch(b)


def sequence_model():
    i = keras.Input((None, 32))
    x = keras.layers.Dense(512, activation="relu")(i)
    x = keras.layers.Dense(512, activation="relu")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(i, keras.layers.Dense(10)(x))


def large_to_build():
    # building it takes a 300 MiB temporary: more than a first probe's 256 MiB
    scratch = tf.zeros([300 << 18])
    del scratch
    return build_model()


def broken_model():
    return _helper()


def _helper():
    raise ValueError("the layer sizes are wrong on purpose")
'''


def _write_tfrecords(data_dir) -> None:
    import tensorflow as tf

    from strata.worker.data import load_digits_splits

    s = load_digits_splits()
    data_dir.mkdir()
    for split, x, y, shards in (("train", s.x_train, s.y_train, 4), ("test", s.x_test, s.y_test, 1)):
        for k in range(shards):
            with tf.io.TFRecordWriter(str(data_dir / f"{split}-{k}.tfrecord")) as w:
                for xi, yi in zip(x[k::shards], y[k::shards]):
                    ex = tf.train.Example(features=tf.train.Features(feature={
                        "x": tf.train.Feature(float_list=tf.train.FloatList(value=xi.tolist())),
                        "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(yi)]))}))
                    w.write(ex.SerializeToString())


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("user")
    _write_tfrecords(root / "data")
    proj = root / "my_project"
    proj.mkdir()
    (proj / "train.py").write_text(TRAIN_PY)
    (proj / "settings.py").write_text(f"DATA_DIR = {str(root / 'data')!r}\nGLOBAL_BATCH = 64\n")
    (proj / "__pycache__").mkdir()  # left out of the upload
    return proj


def _short_code_job(client, project, name: str, model: str, dataset: str = "",
                    workers: int = 1):
    """A 5-step code job on the project at a fixed budget (no probe), to its end: the jobs
    whose failure a test reads. Without ``dataset`` it reads the built-in digits."""
    code = {"dir": "my_project", "model": f"train:{model}"}
    if dataset:
        code["dataset"] = f"train:{dataset}"
    job_yaml = _job_file(project.parent, {
        "name": name, "strategy": "multi_worker_mirrored", "workers": workers, "code": code,
        "data": {"batch_size": 64} if dataset else {"source": "digits", "batch_size": 64},
        "training": {"steps": 5}, "memory": {"per_task_budget": "256MiB"}})
    return client.wait(client.submit(job_yaml).id, timeout=TIMEOUT_S)


def test_code_job_with_its_own_model_and_tfrecord_dataset(client, project, tmp_path):
    job_yaml = _job_file(project.parent, {
        "name": "code-tfrecord", "strategy": "multi_worker_mirrored", "workers": 2,
        "code": {"dir": "my_project", "model": "train:build_model",
                 "dataset": "train:make_dataset"},
        "data": {"batch_size": 64},
        "training": {"steps": 150, "optimizer": {"name": "adam", "learning_rate": 0.003}}})
    job = client.submit(job_yaml)
    final = client.wait(job.id, timeout=TIMEOUT_S)
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.test_accuracy >= 0.9, final.metrics
    # the code's model was measured first, then planned on what it measured
    events = " ".join(e.message for e in client.watch(job.id, timeout=10))
    assert "memory probe" in events and "measured" in events, events[:3000]
    assert "model.keras" in client.get(job.id).outputs


def test_a_compiled_code_model_trains_with_its_own_compile_as_plain_keras_does(client, project):
    """The user's compile is the job's: its optimizer, loss and metrics, said in the job; the
    result is what plain Keras' fit gives on the same data, seed and steps."""
    import keras
    import tensorflow as tf

    steps = 150
    job_yaml = _job_file(project.parent, {
        "name": "compiled", "strategy": "multi_worker_mirrored", "workers": 1,
        "code": {"dir": "my_project", "model": "train:compiled_sgd",
                 "dataset": "train:make_dataset"},
        "data": {"batch_size": 64}, "training": {"steps": steps},
        "memory": {"per_task_budget": "256MiB"}})
    final = client.wait(client.submit(job_yaml).id, timeout=TIMEOUT_S)
    assert final.state == JobState.SUCCEEDED, final.message
    job = client.get(final.id)
    assert job.training == ("optimizer SGD(learning_rate=0.001) from code.model; loss "
                            "SparseCategoricalCrossentropy(from_logits=True) from code.model")
    assert set(job.metrics.test_metrics) == {"accuracy", "top3"}
    assert job.metrics.test_metrics["accuracy"] == pytest.approx(job.metrics.test_accuracy,
                                                                 abs=1e-6)
    # plain Keras, here: the same functions, seed and steps
    sys.path.insert(0, str(project))
    try:
        import train

        keras.utils.set_random_seed(0)
        model = train.compiled_sgd()
        ctx = tf.distribute.InputContext(1, 0, 1)
        model.fit(train.make_dataset(ctx, "train").repeat(), steps_per_epoch=steps, epochs=1,
                  verbose=0)
        _, plain = model.evaluate(train.make_dataset(ctx, "test"), verbose=0)[:2]
    finally:
        sys.path.remove(str(project))
        sys.modules.pop("train", None)
        sys.modules.pop("settings", None)
    assert abs(job.metrics.test_accuracy - plain) <= 0.02, (job.metrics.test_accuracy, plain)
    # what the job gives overrides the compile, and says so
    job_yaml = _job_file(project.parent, {
        "name": "overridden", "strategy": "multi_worker_mirrored", "workers": 1,
        "code": {"dir": "my_project", "model": "train:compiled_sgd",
                 "dataset": "train:make_dataset"},
        "data": {"batch_size": 64},
        "training": {"steps": 5, "optimizer": {"name": "adam", "learning_rate": 0.003}},
        "memory": {"per_task_budget": "256MiB"}})
    other = client.wait(client.submit(job_yaml).id, timeout=TIMEOUT_S)
    assert other.state == JobState.SUCCEEDED, other.message
    assert client.get(other.id).training.startswith(
        "optimizer Adam(learning_rate=0.003) from training.optimizer; loss "
        "SparseCategoricalCrossentropy(from_logits=True) from code.model")
    r = subprocess.run([sys.executable, "-m", "strata.cli", "status", other.id, "--coordinator",
                        client.address], capture_output=True, text=True, timeout=60)
    assert "training with optimizer Adam" in r.stdout, r.stdout


def test_subclassed_code_model_is_built_on_the_dataset_and_trains(client, project):
    job_yaml = _job_file(project.parent, {
        "name": "code-subclassed", "strategy": "multi_worker_mirrored", "workers": 2,
        "code": {"dir": "my_project", "model": "train:subclassed_model",
                 "dataset": "train:make_dataset"},
        "data": {"batch_size": 64}, "memory": {"per_task_budget": "256MiB"},
        "training": {"steps": 150, "optimizer": {"name": "adam", "learning_rate": 0.003}}})
    final = client.wait(client.submit(job_yaml).id, timeout=TIMEOUT_S)
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.test_accuracy >= 0.85, final.metrics
    # without code.dataset nothing says its input's shape: refused, naming the field
    final = _short_code_job(client, project, "code-subclassed-source", "subclassed_model")
    assert final.state == JobState.FAILED
    assert "code.model: train:subclassed_model returned a subclassed TwoLayers" in \
        final.message and "give code.dataset" in final.message, final.message
    # nor does a model of two outputs, which one loss cannot train
    final = _short_code_job(client, project, "code-two-outputs", "two_outputs", "make_dataset")
    assert final.state == JobState.FAILED
    assert "code.model: train:two_outputs returned a model with 2 outputs" in final.message, \
        final.message


def test_code_dataset_with_sample_weights_and_uneven_batches_in_slices(client, project):
    # make_dataset batches without drop_remainder, so each epoch ends on a batch that does not
    # split into 4 equal slices; the weights leave class 0 out of training and count only it
    # in the test split
    job_yaml = _job_file(project.parent, {
        "name": "code-weighted", "strategy": "multi_worker_mirrored", "workers": 2,
        "code": {"dir": "my_project", "model": "train:build_model", "dataset": "train:weighted"},
        "data": {"batch_size": 64}, "gradients": {"accumulate": 4},
        "training": {"steps": 100, "optimizer": {"name": "adam", "learning_rate": 0.003}},
        "memory": {"per_task_budget": "256MiB"}})
    final = client.wait(client.submit(job_yaml).id, timeout=TIMEOUT_S)
    assert final.state == JobState.SUCCEEDED, final.message
    # a model that never learned class 0, judged on class 0 alone (unweighted: about 0.9)
    assert final.metrics.test_accuracy < 0.2, final.metrics


def test_tensorflows_multi_worker_tutorial_runs_as_it_is_written(client):
    """examples/tutorial: the tutorial's mnist_setup.py (data loading changed) with its
    global-batch dataset function and its compiled model, on two workers."""
    job = client.submit(os.path.join(ROOT, "examples", "tutorial", "tutorial.yaml"),
                        overrides=["training.steps=40", "memory.per_task_budget=256MiB"])
    final = client.wait(job.id, timeout=TIMEOUT_S)
    assert final.state == JobState.SUCCEEDED, final.message
    got = client.get(job.id)
    assert got.training.startswith("optimizer SGD(learning_rate=0.001) from code.model; loss "
                                   "SparseCategoricalCrossentropy(from_logits=True)"), got.training
    assert got.metrics.test_accuracy is None  # the tutorial's dataset has no test split
    events = " ".join(e.message for e in client.watch(job.id, timeout=10))
    assert "does not shard" not in events and "auto-sharding off" not in events


def test_datasets_of_single_examples_and_unsharded_ones(client, project):
    final = _short_code_job(client, project, "unbatched", "build_model", "unbatched",
                            workers=2)
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.test_accuracy is None
    final = _short_code_job(client, project, "unsharded", "build_model", "unsharded",
                            workers=2)
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.test_accuracy is not None  # it has a test split
    events = " ".join(e.message for e in client.watch(final.id, timeout=10))
    assert "does not shard by input_context" in events, events[-2000:]


def test_a_compiled_loss_that_reduces_the_batch_is_refused_naming_it(client, project):
    from strata.types import FailureKind

    final = _short_code_job(client, project, "batch-loss", "compiled_batch_mean_loss",
                            "make_dataset")
    assert final.state == JobState.FAILED
    assert {t.failure for t in final.tasks} == {FailureKind.BAD_CONFIG}, final.message
    assert "code.model" in final.message and "one number for a batch" in final.message, \
        final.message


@pytest.mark.parametrize("dataset,kind,words", [
    ("pixels_only", "BAD_CONFIG", "not (features, labels)"),
    ("global_batches_typed", "BAD_CONFIG", "yields batches of 64 rows"),
    ("global_batches", "BAD_CONFIG", "yielded a batch of more rows than planned"),
    ("onehot", "BAD_CONFIG", "one-hot rows, but sparse_categorical_crossentropy")])
def test_code_dataset_of_the_wrong_elements_names_the_field(client, project, dataset, kind,
                                                            words):
    from strata.types import FailureKind

    final = _short_code_job(client, project, "code-wrong", "build_model", dataset, workers=2)
    assert final.state == JobState.FAILED
    # (the other worker may fail first on its own, or be stopped)
    assert FailureKind[kind] in {t.failure for t in final.tasks}, (
        [t.failure for t in final.tasks], final.message)
    field = "training.loss" if dataset == "onehot" else "code.dataset"
    assert f"{field}: train:{dataset}" in final.message and words in final.message, \
        final.message


def test_user_exception_is_its_own_failure_with_its_traceback(client, project):
    from strata.types import FailureKind

    final = _short_code_job(client, project, "code-broken", "broken_model")
    assert final.state == JobState.FAILED
    t = final.tasks[0]
    assert t.failure == FailureKind.USER_CODE, (t.failure, final.message)
    assert "train:broken_model raised ValueError: the layer sizes are wrong on purpose" \
        in final.message, final.message
    assert "train.py" in final.message and "_helper" in final.message, final.message
    logs = b"".join(d for _, _, d in client.logs(final.id)).decode()
    assert "Traceback" not in logs or "raise ValueError" in logs
    assert "raise ValueError(\"the layer sizes are wrong on purpose\")" in logs, logs[-2000:]


def test_coordinator_without_allow_user_code_refuses_code_jobs(project, tmp_path):
    from strata.client import CoordinatorError
    from strata.local import LocalCluster

    c = LocalCluster(workers=0, state_dir=str(tmp_path / "strict"), allow_user_code=False)
    c.start()
    try:
        with c.client() as cl:
            with pytest.raises(CoordinatorError) as e:
                cl.submit(_job_file(project.parent, {
                    "name": "code-refused", "strategy": "multi_worker_mirrored", "workers": 1,
                    "code": {"dir": "my_project", "model": "train:build_model"},
                    "data": {"source": "digits"}, "training": {"steps": 5}}))
            assert "--allow-user-code" in str(e.value), str(e.value)
            assert cl.jobs() == []
    finally:
        c.stop()


# --------------------------------------------------------------------------------------------
# data formats


def test_csv_job_streams_its_file_and_holds_out_a_test_split(client, tmp_path):
    from strata.worker.data import load_digits_splits

    s = load_digits_splits()
    x = np.concatenate([s.x_train, s.x_test])
    y = np.concatenate([s.y_train, s.y_test])
    path = tmp_path / "digits.csv"
    with open(path, "w") as f:
        f.write(",".join([f"p{i}" for i in range(32)] + ["digit"] + [f"p{i}" for i in
                                                                     range(32, 64)]) + "\n")
        for xi, yi in zip(x, y):
            row = [f"{v:.4f}" for v in xi[:32]] + [str(int(yi))] + [f"{v:.4f}" for v in xi[32:]]
            f.write(",".join(row) + "\n")
    job = client.submit({
        "name": "csv-digits", "strategy": "multi_worker_mirrored", "workers": 2,
        "model": {"builtin": {"input_shape": [64], "hidden": [128], "classes": 10}},
        "data": {"source": "csv", "path": str(path), "label": "digit", "batch_size": 64},
        "training": {"epochs": 8, "optimizer": {"name": "adam", "learning_rate": 0.003}}})
    final = client.wait(job.id, timeout=TIMEOUT_S)
    assert final.state == JobState.SUCCEEDED, final.message
    # 1,797 rows, every 5th held out: 1,437 train rows -> 22 steps an epoch at 64
    assert final.metrics.total_steps == 8 * ((1797 - 360) // 64), final.metrics
    assert final.metrics.test_accuracy >= 0.9, final.metrics


def test_images_job_on_a_directory_per_class(client, tmp_path):
    import keras
    import tensorflow as tf
    from keras import layers as L

    rng = np.random.default_rng(3)
    root = tmp_path / "shapes"
    for label in ("bright", "dark"):
        (root / label).mkdir(parents=True)
        for k in range(60):
            base = 190 if label == "bright" else 60
            img = np.clip(rng.normal(base, 40, (20, 24, 3)), 0, 255).astype(np.uint8)
            (root / label / f"{k}.png").write_bytes(tf.io.encode_png(img).numpy())
    i = keras.Input((16, 16, 3))
    x = L.Rescaling(1 / 255.0)(i)
    x = L.Conv2D(4, 3, activation="relu")(x)
    x = L.GlobalAveragePooling2D()(x)
    model = keras.Model(i, L.Dense(2)(x))
    job = client.submit({
        "name": "images", "strategy": "multi_worker_mirrored", "workers": 2,
        "model": {"keras_json": model.to_json()},
        "data": {"source": "images", "path": str(root), "image_size": [16, 16], "batch_size": 16},
        "training": {"epochs": 6, "optimizer": {"name": "adam", "learning_rate": 0.01}}})
    final = client.wait(job.id, timeout=TIMEOUT_S)
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.test_accuracy >= 0.9, final.metrics


def test_tfrecord_source_with_a_test_path(client, project):
    data = project.parent / "data"
    job = client.submit({
        "name": "tfrecord-digits", "strategy": "multi_worker_mirrored", "workers": 2,
        "model": {"builtin": {"input_shape": [64], "hidden": [128], "classes": 10}},
        "data": {"source": "tfrecord", "path": str(data / "train-*.tfrecord"),
                 "test_path": str(data / "test-*.tfrecord"), "label": "y",
                 "features": {"x": {"shape": [64], "dtype": "float32"},
                              "y": {"shape": [], "dtype": "int64"}},
                 "batch_size": 64},
        "training": {"steps": 150, "optimizer": {"name": "adam", "learning_rate": 0.003}}})
    final = client.wait(job.id, timeout=TIMEOUT_S)
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.test_accuracy >= 0.9, final.metrics


def test_parameter_server_job_weighs_a_code_dataset(cluster, client, project):
    """Sample weights from a code dataset count in a parameter-server step too: the weights
    leave class 0 out of training and count only it in the test split. (A third agent joins
    the module's cluster: chief, PS and worker each need their own.)"""
    cluster.add_worker("ps-third")
    job_yaml = _job_file(project.parent, {
        "name": "code-weighted-ps", "strategy": "parameter_server", "workers": 1,
        "parameter_servers": 1,
        "code": {"dir": "my_project", "model": "train:build_model", "dataset": "train:weighted"},
        "data": {"batch_size": 64}, "memory": {"per_task_budget": "256MiB"},
        "training": {"steps": 100, "optimizer": {"name": "adam", "learning_rate": 0.003}}})
    final = client.wait(client.submit(job_yaml).id, timeout=TIMEOUT_S)
    assert final.state == JobState.SUCCEEDED, final.message
    assert sorted(t.role for t in final.tasks) == ["chief", "ps", "worker"]
    # a model that never learned class 0, judged on class 0 alone (unweighted: about 0.9)
    assert final.metrics.test_accuracy < 0.2, final.metrics
    # a compiled model's own optimizer, loss and metrics, in a parameter-server job too
    job_yaml = _job_file(project.parent, {
        "name": "compiled-ps", "strategy": "parameter_server", "workers": 1,
        "parameter_servers": 1,
        "code": {"dir": "my_project", "model": "train:compiled_sgd",
                 "dataset": "train:make_dataset"},
        "data": {"batch_size": 64}, "memory": {"per_task_budget": "256MiB"},
        "training": {"steps": 5}})
    final = client.wait(client.submit(job_yaml).id, timeout=TIMEOUT_S)
    assert final.state == JobState.SUCCEEDED, final.message
    job = client.get(final.id)
    assert job.training.startswith("optimizer SGD(learning_rate=0.001) from code.model"), \
        job.training
    assert set(job.metrics.test_metrics) == {"accuracy", "top3"}


def test_a_probed_budget_holds_a_run_whose_peak_grows_after_the_probe(client, project):
    """memory.profile: the probe's three steps see short sequences, the run longer ones; the
    budget made from the probe's peak (with the stated headroom) holds the run, and the task
    log says at which step the peak grew."""
    import re

    job_yaml = _job_file(project.parent, {
        "name": "grows", "strategy": "multi_worker_mirrored", "workers": 1,
        "code": {"dir": "my_project", "model": "train:sequence_model",
                 "dataset": "train:sequences"},
        "data": {"batch_size": 32}, "training": {"steps": 8}})
    job = client.submit(job_yaml)
    final = client.wait(job.id, timeout=TIMEOUT_S)
    assert final.state == JobState.SUCCEEDED, final.message
    probe = next(j for j in client.jobs() if j.name == "grows-probe"
                 and j.created_at <= job.created_at)
    probe_peak = client.get(probe.id).tasks[0].peak_memory_bytes
    task = client.get(job.id).tasks[0]
    assert task.estimated_memory_bytes == probe_peak
    assert probe_peak < task.peak_memory_bytes <= task.memory_budget_bytes
    log = "".join(d.decode() for _, _, d in client.logs(job.id))
    grew = re.search(r"memory peak grew at: (.*)", log)
    assert grew and re.search(r"step [4-8] ", grew.group(1)), log[-2000:]


def test_a_code_model_larger_than_the_first_probe_grows_its_probe_and_runs(client, project):
    """Running out of memory while code.model builds is the budget's doing, not the code's:
    the first probe (256 MiB) runs out, the next has more, and the job runs on what it
    measured."""
    job_yaml = _job_file(project.parent, {
        "name": "large", "strategy": "multi_worker_mirrored", "workers": 1,
        "code": {"dir": "my_project", "model": "train:large_to_build",
                 "dataset": "train:make_dataset"},
        "data": {"batch_size": 64}, "training": {"steps": 3}})
    job = client.submit(job_yaml)
    final = client.wait(job.id, timeout=TIMEOUT_S)
    assert final.state == JobState.SUCCEEDED, final.message
    events = " ".join(e.message for e in client.watch(job.id, timeout=10))
    assert "ran out of memory at 256 MiB per task" in events and "probing again at" in events, \
        events
    task = client.get(job.id).tasks[0]
    assert (300 << 20) < task.peak_memory_bytes <= task.memory_budget_bytes < (1 << 30)
