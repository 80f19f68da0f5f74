"""The CPU kernel family (oneDNN or Eigen): detected as TensorFlow decides it, told by the agent,
and estimated with its own figures."""

from __future__ import annotations

import math

import pytest

from strata.cpukernels import ANY, EIGEN, ONEDNN, detect, family, parse
from strata.memory import (
    RATES, conv_workspace_bytes, estimate_task_memory, largest_workspace, rates_of,
)
from strata.modelspec import profile_model
from strata.stagememory import StageCostModel

AVX512 = "flags\t\t: fpu sse sse2 avx avx2 avx512f avx512_vnni avx512_bf16\n"
AVX2 = "flags\t\t: fpu sse sse2 avx avx2 fma\n"
LINUX = dict(machine="x86_64", system="Linux")


@pytest.mark.parametrize("env,cpuinfo,want", [
    ({}, AVX512, ONEDNN),                                  # TF's default on these CPUs
    ({}, AVX2, EIGEN),                                     # ... and off without the features
    ({"TF_ENABLE_ONEDNN_OPTS": "0"}, AVX512, EIGEN),       # the variable decides when set
    ({"TF_ENABLE_ONEDNN_OPTS": "false"}, AVX512, EIGEN),
    ({"TF_ENABLE_ONEDNN_OPTS": "1"}, AVX2, ONEDNN),
    ({}, "processor: 0\n", EIGEN),                         # no flags line: the safe answer
    ({}, "flags : amx_tile amx_bf16\n", ONEDNN),
])
def test_detect_follows_tensorflows_rule(env, cpuinfo, want):
    assert detect(env, cpuinfo, **LINUX) == want


def test_detect_off_linux_x86_is_eigen():
    assert detect({}, AVX512, machine="aarch64", system="Linux") == EIGEN
    assert detect({"TF_ENABLE_ONEDNN_OPTS": "1"}, AVX512, machine="x86_64",
                  system="Darwin") == EIGEN


def test_parse_and_family():
    assert parse("auto") == "" and parse("oneDNN") == ONEDNN and parse(" eigen ") == EIGEN
    with pytest.raises(ValueError, match="--cpu-kernels"):
        parse("mkl")
    assert family([ONEDNN, ONEDNN]) == ONEDNN and family([EIGEN]) == EIGEN
    # workers of both families, one that did not say, or none: the larger of each figure
    assert family([ONEDNN, EIGEN]) == ANY and family([ONEDNN, ""]) == ANY and family([]) == ANY


def _conv_spec(precision: str = "none") -> dict:
    import json
    import os

    from strata.spec import parse_job_spec

    root = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(root, "fixtures", "keras_models.json")) as f:
        cnn = json.load(f)["good"]["cnn"]
    return parse_job_spec({
        "name": "conv", "strategy": "multi_worker_mirrored", "workers": 2,
        "model": {"keras_json": cnn["json"]},
        "data": {"source": "synthetic", "examples": 256, "batch_size": 32},
        "memory": {"mixed_precision": precision}}).to_dict()


def test_onednn_has_no_convolution_workspace_and_any_takes_the_larger():
    spec = _conv_spec()
    profile = profile_model(spec["model"])
    conv = next(layer for layer in profile.layers if layer.kind == "Conv2D")
    assert conv_workspace_bytes(conv, EIGEN) > 1 << 20         # Eigen's im2col working set
    assert conv_workspace_bytes(conv, ONEDNN) == 0
    assert largest_workspace(profile, ONEDNN) == 0
    for precision in ("none", "bfloat16"):
        spec = _conv_spec(precision)
        e, o, a = (estimate_task_memory(spec, 16, profile, kernels=k).total
                   for k in (EIGEN, ONEDNN, ANY))
        assert e != o and a >= max(e, o)
        stages = [StageCostModel(profile, microbatch=4, microbatches=4, kernels=k,
                                 mixed_precision=precision).estimate(0, len(profile.layers))
                  for k in (EIGEN, ONEDNN, ANY)]
        assert stages[2] >= max(stages[:2])
    # the larger family's rates, kind by kind
    r = rates_of(ANY)
    for kind, rate in RATES[ONEDNN].layers.items():
        other = RATES[EIGEN].layers.get(kind, RATES[EIGEN].dense)
        assert r.layers[kind] == (max(rate[0], other[0]), max(rate[1], other[1]))


def test_a_stage_accumulator_is_the_family_share_of_a_gradient():
    """A stage that sums gradients (micro-batches or replicas) counts its family's accumulator
    share (oneDNN 0.75 of a gradient, Eigen 1, ANY the larger); one that does not counts none."""
    profile = profile_model(_conv_spec()["model"])
    L = len(profile.layers)
    train = profile.trainable_params
    for k in (EIGEN, ONEDNN, ANY):
        summed = StageCostModel(profile, microbatch=4, microbatches=4, kernels=k)
        assert summed.breakdown(0, L)["accumulator"] == math.ceil(4 * rates_of(k).accumulator
                                                                   * train)
        assert StageCostModel(profile, microbatch=16, microbatches=1,
                              kernels=k).breakdown(0, L)["accumulator"] == 0
    assert RATES[ONEDNN].accumulator < RATES[EIGEN].accumulator == rates_of(ANY).accumulator
