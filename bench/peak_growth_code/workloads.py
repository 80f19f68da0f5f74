"""Users' code for ``bench/peak_growth.py``: TensorFlow's multi-worker tutorial at MNIST's
shape (random 28x28 images: the cluster has no internet) and two models with a test split, so
that the evaluation pass runs. Each dataset function is the tutorial's: global batches."""

import numpy as np
import tensorflow as tf


def _images(n, shape, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((n,) + shape, dtype=np.float32)
    y = rng.integers(0, classes, n).astype(np.int64)
    return x, y


def mnist_dataset(batch_size):
    x, y = _images(6000, (28, 28))
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(60000).repeat().batch(batch_size)


def tutorial_model():
    model = tf.keras.Sequential([
        tf.keras.Input(shape=(28, 28)),
        tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(10)])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.SGD(learning_rate=0.001), metrics=["accuracy"])
    return model


def images_with_test(input_context, split):
    """32x32x3 images with a test split (evaluated after training), per replica."""
    x, y = _images(2048 if split == "train" else 512, (32, 32, 3), seed=split == "test")
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    b = input_context.get_per_replica_batch_size(64)
    return ds.shuffle(1024).repeat().batch(b) if split == "train" else ds.batch(b)


def mobilenet():
    model = tf.keras.applications.MobileNetV2(input_shape=(32, 32, 3), weights=None,
                                              classes=10)
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=False),
                  optimizer=tf.keras.optimizers.Adam(1e-3))
    return model


def resnet50():
    model = tf.keras.applications.ResNet50(input_shape=(32, 32, 3), weights=None, classes=10)
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=False),
                  optimizer=tf.keras.optimizers.Adam(1e-3))
    return model


def _sequences(n, steps, features, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.random((n, steps, features), dtype=np.float32),
            rng.integers(0, 10, n).astype(np.int64))


def sequences_with_test(input_context, split):
    """32-step sequences of 64 features with a test split, per replica."""
    x, y = _sequences(2048 if split == "train" else 512, 32, 64, seed=split == "test")
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    b = input_context.get_per_replica_batch_size(64)
    return ds.shuffle(1024).repeat().batch(b) if split == "train" else ds.batch(b)


def lstm():
    model = tf.keras.Sequential([
        tf.keras.Input((32, 64)), tf.keras.layers.LSTM(256, return_sequences=True),
        tf.keras.layers.LSTM(128), tf.keras.layers.Dense(10)])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.Adam(1e-3))
    return model


def transformer():
    L = tf.keras.layers
    i = tf.keras.Input((32, 64))
    x = i
    for _ in range(2):
        a = L.MultiHeadAttention(num_heads=4, key_dim=16)(x, x)
        x = L.LayerNormalization()(L.Add()([x, a]))
        f = L.Dense(64)(L.Dense(256, activation="gelu")(x))
        x = L.LayerNormalization()(L.Add()([x, f]))
    x = L.GlobalAveragePooling1D()(x)
    model = tf.keras.Model(i, L.Dense(10)(x))
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.AdamW(1e-3))
    return model
