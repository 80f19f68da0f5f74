"""TF_CONFIG as Strata builds it is what TensorFlow's own resolver reads."""

import json
import os

import pytest

from strata.tfconfig import build_tf_config


def test_shape():
    cfg = json.loads(build_tf_config({"worker": ["h:1", "h:2"]}, "worker", 1))
    assert cfg == {"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": 1}}


def test_rejects_unknown_role_and_index():
    with pytest.raises(ValueError, match="role"):
        build_tf_config({"worker": ["h:1"]}, "ps", 0)
    with pytest.raises(ValueError, match="index"):
        build_tf_config({"worker": ["h:1"]}, "worker", 1)


@pytest.mark.integration
def test_accepted_by_tf_cluster_resolver(monkeypatch):
    tf = pytest.importorskip("tensorflow")
    cluster = {"chief": ["127.0.0.1:2000"], "worker": ["127.0.0.1:2001", "127.0.0.1:2002"],
               "ps": ["127.0.0.1:2003"]}
    monkeypatch.setenv("TF_CONFIG", build_tf_config(cluster, "worker", 1))
    r = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    assert r.task_type == "worker" and r.task_id == 1
    spec = r.cluster_spec().as_dict()
    assert spec == cluster
    assert r.master(rpc_layer="grpc") == "grpc://127.0.0.1:2002"
    os.environ.pop("TF_CONFIG", None)
