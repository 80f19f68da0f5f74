"""A user's own model and input pipeline (code.model, code.dataset in ../code-digits.yaml)."""

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

GLOBAL_BATCH = 64


def build_model():
    # called under the strategy's scope: variables are mirrored on every worker
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                             keras.layers.Dropout(0.1), keras.layers.Dense(10)])


def make_dataset(input_context, split):
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    test = np.arange(len(y)) % 5 == 0
    keep = test if split == "test" else ~test
    ds = tf.data.Dataset.from_tensor_slices((x[keep], y[keep]))
    if split == "test":
        return ds.batch(256)
    # each worker reads its own shard and batches its share of the global batch
    ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return ds.shuffle(2048, seed=input_context.input_pipeline_id).batch(
        input_context.get_per_replica_batch_size(GLOBAL_BATCH))
