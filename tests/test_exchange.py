"""The gradient exchange options (``gradients``: accumulate, compression, pack_size): the spec's
checks, the memory they cost, and real 2-worker task processes showing that each keeps the
replicas bit-identical, that accumulation is the unsliced step, and that it lowers the peak."""

from __future__ import annotations

import pytest

from strata import convert
from strata.errors import SpecError
from strata.memory import default_budget, estimate_task_memory
from strata.spec import parse_job_spec


def raw(**over) -> dict:
    spec = {"name": "ex", "strategy": "multi_worker_mirrored", "workers": 2,
            "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [1024, 512, 256],
                                  "classes": 10}},
            "data": {"source": "digits", "batch_size": 256}}
    spec.update(over)
    return spec


def test_options_parse_and_travel_through_the_protocol():
    s = parse_job_spec(raw(gradients={"accumulate": 4, "compression": "bfloat16",
                                      "pack_size": "1MiB"}))
    assert (s.gradients.accumulate, s.gradients.compression, s.gradients.pack_bytes) == \
        (4, "bfloat16", 1 << 20)
    back = convert.spec_from_proto(convert.spec_to_proto(s))
    assert back.gradients == s.gradients
    assert parse_job_spec(raw(gradients={"pack_size": 0})).gradients.pack_bytes == 0
    d = parse_job_spec(raw()).gradients
    assert (d.accumulate, d.compression, d.pack_size) == (1, "none", "")


@pytest.mark.parametrize("gradients,field,words", [
    ({"accumulate": 3}, "gradients.accumulate", "3 equal slices"),
    ({"accumulate": 0}, "gradients.accumulate", ">= 1"),
    ({"accumulate": 5000}, "gradients.accumulate", "<= 1024"),
    ({"compression": "int8"}, "gradients.compression", "none, bfloat16, float16"),
    ({"pack_size": "lots"}, "gradients.pack_size", "not a memory size"),
    ({"pack_size": [1]}, "gradients.pack_size", "size like"),
    ({"packsize": 1}, "gradients.packsize", "unknown field"),
])
def test_bad_options_name_their_field(gradients, field, words):
    with pytest.raises(SpecError) as e:
        parse_job_spec(raw(gradients=gradients))
    assert e.value.field == field and words in str(e.value)


@pytest.mark.parametrize("strategy,extra", [
    ("parameter_server", {}), ("pipeline", {"workers": 1}), ("hybrid", {}),
])
def test_other_strategies_refuse_the_options_but_take_their_defaults(strategy, extra):
    refused = [({"accumulate": 2}, "gradients.accumulate"),
               ({"pack_size": "1MiB"}, "gradients.pack_size")]
    if strategy != "hybrid":  # a hybrid job's replicas exchange in 16 bits too
        refused.append(({"compression": "float16"}, "gradients.compression"))
    for g, field in refused:
        with pytest.raises(SpecError) as e:
            parse_job_spec(raw(strategy=strategy, gradients=g, **extra))
        assert e.value.field == field and "multi_worker_mirrored" in str(e.value)
    # the defaults written out are not "set"
    parse_job_spec(raw(strategy=strategy, gradients={"accumulate": 1, "compression": "none"},
                       **extra))


def test_memory_estimate_follows_the_options():
    def est(batch=4096, **g):
        s = parse_job_spec(raw(data={"source": "digits", "batch_size": batch}, gradients=g))
        return estimate_task_memory(s.to_dict(), s.per_replica_batch)

    plain, sliced = est(), est(accumulate=8)
    params = 64 * 1024 + 1024 + 1024 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10
    # a slice's activations, plus the float32 running sum (and the next one)
    assert sliced.activations == pytest.approx(plain.activations / 8, rel=0.01)
    assert sliced.gradients == plain.gradients + 8 * params
    assert sliced.total < plain.total
    # 16-bit copies and their sum on top of the pack, in the all-reduce phase: it follows the
    # backward pass, so they count where that phase is the larger (a small batch)
    small, packed16 = est(64), est(64, compression="bfloat16")
    assert small.collective > 0
    assert packed16.collective == small.collective + 4 * params
    assert est(compression="bfloat16").total == plain.total  # the activations' phase is larger


# ---------------------------------------------------------------------------------------------
# real task processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Real 2-worker digits runs, started together (they share the 2 cores) and awaited once."""
    from test_task_process import launch, make_spec

    def spec(batch: int = 256, **g):
        s = make_spec(gradients=g)
        s["data"] = {**s["data"], "batch_size": batch}
        return s

    wanted = {
        "plain": spec(),
        "sliced": spec(accumulate=4),
        "bf16_packed": spec(compression="bfloat16", pack_size="64KiB"),
        "fp16_sliced": spec(accumulate=2, compression="float16"),
        # one large step at a time: the peak with and without slicing
        "big": {**spec(batch=8192), "training": {**make_spec()["training"], "epochs": 0,
                                                 "steps": 3}},
        "big_sliced": {**spec(batch=8192, accumulate=8),
                       "training": {**make_spec()["training"], "epochs": 0, "steps": 3}},
    }
    started = {}
    for name, s in wanted.items():
        # under the planner's own budget for the job: what an admitted job would get
        parsed = parse_job_spec({k: v for k, v in s.items() if k != "parameter_servers"})
        budget = default_budget(estimate_task_memory(parsed.to_dict(), parsed.per_replica_batch))
        started[name] = launch(s, tmp_path_factory.mktemp(name), workers=2,
                               bfc_mb=budget >> 20)
    out = {}
    for name, tasks in started.items():
        rcs = [t.wait() for t in tasks]
        assert rcs == [0, 0], f"{name}: exit {rcs}; log:\n{tasks[0].log()}\n{tasks[1].log()}"
        out[name] = [t.of("result")[0] for t in tasks]
    return out


@pytest.mark.integration
@pytest.mark.parametrize("name", ["plain", "sliced", "bf16_packed", "fp16_sliced", "big_sliced"])
def test_replicas_stay_identical(runs, name):
    a, b = runs[name]
    assert a["weights_sha256"] == b["weights_sha256"]
    if name != "big_sliced":
        assert a["test_accuracy"] >= 0.90


@pytest.mark.integration
def test_accumulation_is_the_unsliced_step(runs):
    # the same examples, the same updates: the same model up to float rounding
    plain, sliced = runs["plain"][0], runs["sliced"][0]
    assert sliced["steps"] == plain["steps"]
    assert sliced["test_loss"] == pytest.approx(plain["test_loss"], rel=1e-4)
    assert sliced["test_accuracy"] == pytest.approx(plain["test_accuracy"], abs=0.006)


@pytest.mark.integration
def test_compression_costs_little_accuracy(runs):
    plain = runs["plain"][0]
    for name in ("bf16_packed", "fp16_sliced"):
        assert runs[name][0]["test_accuracy"] == pytest.approx(plain["test_accuracy"], abs=0.02)


@pytest.mark.integration
def test_slices_lower_the_peak(runs):
    # per replica 4,096 examples at once against 8 slices of 512, under the same allocator
    # (measured 0.5x; the activations are most of the unsliced peak)
    big = max(r["memory"]["peak"] for r in runs["big"])
    sliced = max(r["memory"]["peak"] for r in runs["big_sliced"])
    assert sliced < 0.7 * big, (sliced, big)


@pytest.mark.integration
def test_the_keras_hook_is_still_there():
    import keras

    from strata.worker.exchange import KERAS_ALL_REDUCE

    for opt in (keras.optimizers.Adam(), keras.optimizers.SGD(),
                keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()).inner_optimizer):
        assert callable(getattr(opt, KERAS_ALL_REDUCE))


@pytest.mark.integration
@pytest.mark.parametrize("rows,k,written_out", [(10, 3, False), (2, 4, False), (8, 4, False),
                                                (10, 3, True), (2, 4, True)])
def test_uneven_and_weighted_batches_slice_to_the_unsliced_step(rows, k, written_out):
    """A batch that does not split into k equal slices (an epoch's last, a job's own dataset
    without drop_remainder), or has fewer rows than k, with sample weights and a model with
    weight and activity regularizers: the unsliced step is Keras's own ``fit`` step, and the
    sliced step applies the same update, looped or written out (a model that all-reduces in
    its forward pass, here a layer that only says so)."""
    import keras
    import numpy as np
    import tensorflow as tf

    from strata.worker.exchange import _synchronises, accumulating_step
    from strata.worker.runner import gradient_step

    class Says(keras.layers.Layer):
        synchronized = written_out

        def call(self, x):
            return x

    rng = np.random.default_rng(rows * 10 + k)
    x = tf.constant(rng.normal(size=(rows, 5)), tf.float32)
    y = tf.constant(rng.integers(0, 3, size=rows))
    w = tf.constant(rng.uniform(0.0, 2.0, size=(rows, 1)), tf.float32)  # Keras's (n, 1) too
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def model_and_optimizer(regularized: bool = True):
        keras.utils.set_random_seed(0)
        reg = dict(kernel_regularizer=keras.regularizers.L2(0.05),
                   activity_regularizer=keras.regularizers.L1(0.01)) if regularized else {}
        model = keras.Sequential([keras.Input((5,)),
                                  keras.layers.Dense(4, activation="relu", **reg),
                                  Says(), keras.layers.Dense(3)])
        opt = keras.optimizers.SGD(0.5)
        opt.build(model.trainable_variables)
        return model, opt

    def after(make, regularized: bool = True, weights=w) -> list:
        model, opt = model_and_optimizer(regularized)
        assert _synchronises(model) == written_out
        step = tf.function(make(model, opt))
        loss = float(step(x, y, weights))
        return [loss] + [v.numpy() for v in model.trainable_variables]

    def reduce(per_example):
        return tf.reduce_sum(per_example) / rows

    whole = after(lambda m, o: gradient_step(tf, m, o, loss_fn, "none", reduce))
    sliced = after(lambda m, o: accumulating_step(tf, m, o, loss_fn, "none", reduce, k))
    assert whole[0] == pytest.approx(sliced[0], rel=1e-5)
    for a, b in zip(whole[1:], sliced[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Keras's fit, one step on the same batch, weights and regularizers: the same update
    model, opt = model_and_optimizer()
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    model.fit(x, y, sample_weight=w, batch_size=rows, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(whole[1:], model.trainable_variables):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-5, atol=1e-6)
    # and both count: without either the model moves elsewhere
    for other in (after(lambda m, o: gradient_step(tf, m, o, loss_fn, "none", reduce),
                        regularized=False),
                  after(lambda m, o: gradient_step(tf, m, o, loss_fn, "none", reduce),
                        weights=None)):
        assert not np.allclose(other[1], whole[1])


def test_hybrid_stage_estimate_counts_the_16_bit_copies():
    from strata.modelspec import profile_model
    from strata.stagememory import StageCostModel

    s = parse_job_spec(raw(strategy="hybrid", stages=2, microbatches=2,
                           gradients={"compression": "bfloat16"}))
    profile = profile_model(s.model)

    def model(compressed: bool, replicas: int = 2) -> StageCostModel:
        return StageCostModel(profile, microbatch=64, microbatches=2, replicas=replicas,
                              compressed=compressed)

    L = len(profile.layers)
    train = profile.trainable_params
    plain, wired = model(False).breakdown(0, L), model(True).breakdown(0, L)
    assert wired["collective"] - plain["collective"] == 2 * 2 * train
    # (plus the estimate's proportional allowance for allocator rounding)
    assert 4 * train <= model(True).memory(0, L) - model(False).memory(0, L) <= 4.4 * train
    # one replica exchanges nothing
    assert model(True, 1).memory(0, L) == model(False, 1).memory(0, L)
