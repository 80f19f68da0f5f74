"""TensorFlow's multi-worker Keras tutorial's ``mnist_setup.py``
(https://www.tensorflow.org/tutorials/distribute/multi_worker_with_keras), as it is but for the
data loading: MNIST cannot be downloaded on a cluster without internet, so the same pipeline
reads scikit-learn's digits (8x8 images, 10 classes) and the model takes their shape."""

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits


def mnist_dataset(batch_size):
    # was: (x_train, y_train), _ = tf.keras.datasets.mnist.load_data(); x_train / 255
    digits = load_digits()
    x_train = digits.images / np.float32(16)
    y_train = digits.target.astype(np.int64)
    train_dataset = tf.data.Dataset.from_tensor_slices(
        (x_train, y_train)).shuffle(60000).repeat().batch(batch_size)
    return train_dataset


def build_and_compile_cnn_model():
    model = tf.keras.Sequential([
        tf.keras.Input(shape=(8, 8)),  # was: (28, 28)
        tf.keras.layers.Reshape(target_shape=(8, 8, 1)),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(10)
    ])
    model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(learning_rate=0.001),
        metrics=["accuracy"])
    return model
