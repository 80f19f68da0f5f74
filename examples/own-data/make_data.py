"""Writes the digits data as files a user would have: digits.csv (a header row, a `digit` label
column) and train-*.tfrecord / test-0.tfrecord, next to this file.

    .venv/bin/python examples/own-data/make_data.py
    strata submit examples/own-data/csv.yaml --follow
    strata submit examples/own-data/tfrecord.yaml --follow
"""

import os

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

here = os.path.dirname(os.path.abspath(__file__))
d = load_digits()
x, y = (d.data / 16.0).astype(np.float32), d.target
with open(os.path.join(here, "digits.csv"), "w") as f:
    f.write(",".join([f"p{i}" for i in range(64)] + ["digit"]) + "\n")
    for xi, yi in zip(x, y):
        f.write(",".join(f"{v:.4f}" for v in xi) + f",{yi}\n")
test = np.arange(len(y)) % 5 == 0
for split, mask, shards in (("train", ~test, 4), ("test", test, 1)):
    xs, ys = x[mask], y[mask]
    for k in range(shards):
        with tf.io.TFRecordWriter(os.path.join(here, f"{split}-{k}.tfrecord")) as w:
            for xi, yi in zip(xs[k::shards], ys[k::shards]):
                w.write(tf.train.Example(features=tf.train.Features(feature={
                    "pixels": tf.train.Feature(float_list=tf.train.FloatList(value=xi)),
                    "digit": tf.train.Feature(int64_list=tf.train.Int64List(value=[yi]))})
                ).SerializeToString())
print(here)
