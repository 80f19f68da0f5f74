"""Saves a small residual CNN for the digits data as resnet.keras next to this file: the model a
user brings (any built-in Keras layers, a functional graph with residual Adds).

    .venv/bin/python examples/own-model/make_model.py
    strata submit examples/own-model/resnet.yaml --follow
    strata download JOB_ID out/      # out/model.keras, out/metrics.json
"""

import os

import keras
from keras import layers as L

i = keras.Input((8, 8, 1), name="img")
x = L.Conv2D(16, 3, padding="same", activation="relu", name="stem")(i)
for b in range(2):
    y = L.Conv2D(16, 3, padding="same", name=f"b{b}_conv1")(x)
    y = L.BatchNormalization(momentum=0.9, name=f"b{b}_bn")(y)
    y = L.ReLU(name=f"b{b}_relu")(y)
    y = L.Conv2D(16, 3, padding="same", name=f"b{b}_conv2")(y)
    x = L.Add(name=f"b{b}_add")([x, y])
x = L.GlobalAveragePooling2D(name="gap")(x)
model = keras.Model(i, L.Dense(10, name="logits")(x), name="resnet_digits")
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resnet.keras")
model.save(path)
print(path)
