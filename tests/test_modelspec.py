"""strata.modelspec: the pure-Python model profiler, checked against Keras' own numbers.

tests/fixtures/keras_models.json holds real keras.Model.to_json() texts with Keras' parameter
counts and layer output shapes (regenerate with tests/fixtures/make_fixtures.py); these tests
never import TensorFlow or Keras.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from strata.modelspec import (  # noqa: E402
    SUPPORTED_LAYERS, LayerProfile, ModelProfile, ModelSpecError, final_activation, profile_model,
)

with open(os.path.join(ROOT, "tests", "fixtures", "keras_models.json")) as _f:
    FIX = json.load(_f)

SEED_MLP_784_PARAMS = 1_462_538  # keras count_params of 784-1024-512-256-10


def builtin(**over):
    b = {"kind": "mlp", "input_shape": [64], "hidden": [1024, 512, 256], "classes": 10}
    b.update(over)
    return {"builtin": b}


# --------------------------------------------------------------------------------------------
# builtin


def test_builtin_digits_mlp_matches_keras():
    p = profile_model(builtin())
    keras_fix = FIX["good"]["digits_mlp"]
    assert p.total_params == keras_fix["count_params"] == 725_258
    assert p.input_shape == (64,)
    assert [l.name for l in p.layers] == ["hidden_0", "hidden_1", "hidden_2", "logits"]
    assert [l.kind for l in p.layers] == ["Dense"] * 4
    assert [l.params for l in p.layers] == [
        l["params"] for l in keras_fix["layers"] if l["class_name"] != "InputLayer"]
    assert [l.output_elems for l in p.layers] == [1024, 512, 256, 10]
    assert p.output_shape == (10,)
    # forward FLOPs: 2 per multiply-add, + bias, + relu on hidden layers
    assert p.layers[0].flops == 2 * 64 * 1024 + 1024 + 1024
    assert p.layers[-1].flops == 2 * 256 * 10 + 10
    assert final_activation(builtin()) == "linear"


def test_builtin_784_seed_mlp_and_rank3_input():
    assert profile_model(builtin(input_shape=[784])).total_params == SEED_MLP_784_PARAMS
    p = profile_model(builtin(input_shape=[28, 28, 1], hidden=[], classes=3))
    assert [(l.name, l.kind, l.output_shape) for l in p.layers] == [
        ("flatten", "Flatten", (784,)), ("logits", "Dense", (3,))]
    assert p.total_params == 784 * 3 + 3


@pytest.mark.parametrize("over,field", [
    ({"kind": "cnn"}, "model.builtin.kind"),
    ({"input_shape": []}, "model.builtin.input_shape"),
    ({"input_shape": [0]}, "model.builtin.input_shape"),
    ({"input_shape": "64"}, "model.builtin.input_shape"),
    ({"hidden": [128, -1]}, "model.builtin.hidden"),
    ({"hidden": [True]}, "model.builtin.hidden"),
    ({"classes": 0}, "model.builtin.classes"),
    ({"classes": None}, "model.builtin.classes"),
])
def test_builtin_bad_fields(over, field):
    with pytest.raises(ModelSpecError) as e:
        profile_model(builtin(**over))
    assert e.value.field == field
    assert str(e.value) == f"{field}: {e.value.message}"


def test_exactly_one_model_kind():
    with pytest.raises(ModelSpecError) as e:
        profile_model({})
    assert e.value.field == "model"
    with pytest.raises(ModelSpecError):
        profile_model({**builtin(), "keras_json": FIX["good"]["digits_mlp"]["json"]})


# --------------------------------------------------------------------------------------------
# keras_json vs Keras


@pytest.mark.parametrize("name", sorted(FIX["good"]))
def test_keras_json_matches_keras(name):
    fx = FIX["good"][name]
    p = profile_model({"keras_json": fx["json"]})
    assert isinstance(p, ModelProfile) and all(isinstance(l, LayerProfile) for l in p.layers)
    assert p.total_params == fx["count_params"]
    assert p.trainable_params == fx["trainable_params"]
    assert list(p.input_shape) == fx["input_shape"]
    assert [[list(i.shape), i.dtype] for i in p.model_inputs] == [x[1:] for x in fx["inputs"]]
    if '"class_name": "Functional"' in fx["json"]:
        assert [i.name for i in p.model_inputs] == [x[0] for x in fx["inputs"]]
    keras_layers = {l["name"]: l for l in fx["layers"] if l["class_name"] != "InputLayer"}
    ours = {l.name: l for l in p.layers}
    assert set(ours) == set(keras_layers)
    for name, k in keras_layers.items():
        l = ours[name]
        shapes = k["output_shape"] if k["output_shape"] and isinstance(k["output_shape"][0], list) \
            else [k["output_shape"]]
        assert (l.kind, l.params, list(l.output_shape)) == \
            (k["class_name"], k["params"], shapes[0]), name
        assert l.output_elems == sum(_prod(s) for s in shapes) and l.flops >= 0
    # a topological order: every layer after what it takes, the output last
    seen = {i.name for i in p.model_inputs}
    for l in p.layers:
        assert all(r.split(":")[0] in seen for r in l.inputs), l.name
        seen.add(l.name)
    if len(fx["layers"]) and fx["json"].count('"class_name": "Functional"'):
        out = json.loads(fx["json"])["config"]["output_layers"]
        assert p.layers[-1].name == (out[0] if isinstance(out[0], str) else out[0][0])


def _prod(xs):
    n = 1
    for d in xs:
        n *= d
    return n


def test_cut_points_only_between_residual_blocks():
    p = profile_model({"keras_json": FIX["good"]["residual_cnn"]["json"]})
    names = [l.name for l in p.layers]
    cuts = {names[k - 1] for k in p.cut_points}
    # after the stem, after each block's Add, after pooling: never inside a block
    assert cuts == {"stem", "b0_add", "b1_add", "gap"}
    assert not p.is_chain
    chain = profile_model({"keras_json": FIX["good"]["seq_mlp"]["json"]})
    assert chain.is_chain and chain.cut_points == tuple(range(1, len(chain.layers)))
    two = profile_model({"keras_json": FIX["good"]["two_inputs"]["json"]})
    # the second input is used late: no cut before that
    meta_use = min(i for i, l in enumerate(two.layers) if "meta" in l.inputs)
    assert all(k > meta_use for k in two.cut_points)


def test_internal_activations_of_recurrent_and_attention_layers():
    rec = profile_model({"keras_json": FIX["good"]["recurrent"]["json"]})
    lstm = next(l for l in rec.layers if l.kind == "LSTM")
    assert lstm.internal_elems >= 12 * 2 * 16  # the states of every step
    assert lstm.workspace_bytes == 4 * 12 * lstm.params  # each step's kernel gradients
    tr = profile_model({"keras_json": FIX["good"]["transformer"]["json"]})
    mha = next(l for l in tr.layers if l.name == "mha")
    assert mha.internal_elems >= 2 * 10 * 10  # the score matrix of each head
    assert tr.model_inputs[0].name == "seq"


def test_softmax_output_detected():
    assert final_activation({"keras_json": FIX["good"]["seq_mlp"]["json"]}) == "softmax"
    assert final_activation({"keras_json": FIX["good"]["cnn"]["json"]}) == "softmax"
    assert final_activation({"keras_json": FIX["good"]["func_mlp"]["json"]}) == "linear"


def test_profile_is_frozen():
    p = profile_model(builtin())
    with pytest.raises(Exception):
        p.layers[0].params = 1  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# refusals


def refuse(model_json) -> ModelSpecError:
    with pytest.raises(ModelSpecError) as e:
        profile_model({"keras_json": model_json})
    assert e.value.field == "model.keras_json"
    assert str(e.value).startswith("model.keras_json: ")
    return e.value


def test_lambda_refused():
    e = refuse(FIX["bad"]["lambda"])
    assert str(e) == ("model.keras_json: layer 'double' is a Lambda layer; Lambda and custom "
                      "code are refused (safe mode)")


@pytest.mark.parametrize("name,cls", [("custom_registered", "MyDense"),
                                      ("custom_unregistered", "PlainSubclass")])
def test_custom_objects_refused(name, cls):
    e = refuse(FIX["bad"][name])
    assert cls in e.message and "custom" in e.message


def test_custom_nested_object_refused():
    # a custom initializer inside an otherwise built-in layer
    obj = json.loads(FIX["good"]["digits_mlp"]["json"])
    obj["config"]["layers"][1]["config"]["kernel_initializer"] = {
        "module": "mypkg.init", "class_name": "Evil", "config": {}, "registered_name": "mypkg>Evil"}
    e = refuse(json.dumps(obj))
    assert "Evil" in e.message


def test_unsupported_layer_lists_supported():
    e = refuse(FIX["bad"]["unsupported_layer"])
    assert "'ein'" in e.message and "EinsumDense" in e.message
    for kind in SUPPORTED_LAYERS:
        assert kind in e.message


@pytest.mark.parametrize("name", ["branching", "branching_add"])
def test_branching_accepted(name):
    p = profile_model({"keras_json": FIX["bad"][name]})
    assert not p.is_chain and p.layers[-1].kind in ("Concatenate", "Add")


def test_dangling_layer_refused():
    obj = json.loads(FIX["good"]["residual_cnn"]["json"])
    obj["config"]["output_layers"] = [["b0_add", 0, 0]]
    assert "do not lead to the model's output" in refuse(json.dumps(obj)).message


def test_shared_layer_refused():
    obj = json.loads(FIX["good"]["func_mlp"]["json"])
    dense = obj["config"]["layers"][1]
    dense["inbound_nodes"].append(copy.deepcopy(dense["inbound_nodes"][0]))
    assert "shared" in refuse(json.dumps(obj)).message


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"foo": 1}', 42])
def test_bad_json(text):
    e = refuse(text)
    assert e.message


def test_empty_keras_json_is_no_model():
    with pytest.raises(ModelSpecError) as e:
        profile_model({"keras_json": ""})
    assert e.value.field == "model"


def test_missing_input_shape():
    obj = json.loads(FIX["good"]["built_no_input"]["json"])
    obj["config"]["layers"] = [l for l in obj["config"]["layers"] if l["class_name"] != "InputLayer"]
    obj["config"].pop("build_input_shape", None)
    obj.pop("build_config", None)
    for l in obj["config"]["layers"]:
        l.pop("build_config", None)
    e = refuse(json.dumps(obj))
    assert "input shape" in e.message


def test_unknown_dimension_refused():
    obj = json.loads(FIX["good"]["digits_mlp"]["json"])
    obj["config"]["layers"][0]["config"]["batch_shape"] = [None, None]
    assert "unknown" in refuse(json.dumps(obj)).message or "known" in refuse(json.dumps(obj)).message


def test_fixture_untouched_by_profiling():
    before = copy.deepcopy(FIX["good"]["cnn"])
    profile_model({"keras_json": FIX["good"]["cnn"]["json"]})
    assert FIX["good"]["cnn"] == before


def test_pure_modules_do_not_import_tensorflow():
    code = ("import sys; import strata.modelspec, strata.memory, strata.exitcodes; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('tensorflow', 'keras', 'numpy')); print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("app", ["EfficientNetB0"])
def test_keras_applications_profile_as_keras_counts_them(app):
    """keras.applications at a small input, weights=None: every layer kind they use has a
    rule (EfficientNet's Normalization layer among them), and the counts are Keras's."""
    import keras

    model = getattr(keras.applications, app)(input_shape=(32, 32, 3), weights=None, classes=10)
    p = profile_model({"keras_json": model.to_json()})
    assert p.total_params == model.count_params()
    assert p.trainable_params == sum(int(_prod(w.shape)) for w in model.trainable_weights)
    assert list(p.layers[-1].output_shape) == [10]
