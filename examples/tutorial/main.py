"""The tutorial's ``main.py``, for comparison: what a user writes to run ``mnist_setup`` on
two machines by hand (TF_CONFIG set on each, the script started on each). Strata does this
part: ``tutorial.yaml`` names the two functions, and the job's workers, TF_CONFIG and batch.
Not run by Strata."""

import json
import os

import tensorflow as tf

import mnist_setup

per_worker_batch_size = 64
tf_config = json.loads(os.environ["TF_CONFIG"])
num_workers = len(tf_config["cluster"]["worker"])

strategy = tf.distribute.MultiWorkerMirroredStrategy()

global_batch_size = per_worker_batch_size * num_workers
multi_worker_dataset = mnist_setup.mnist_dataset(global_batch_size)

with strategy.scope():
    # Model building/compiling need to be within `strategy.scope()`.
    multi_worker_model = mnist_setup.build_and_compile_cnn_model()

multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=70)
