"""Job spec validation: every bad field is named in the error."""

import pytest

from strata.errors import SpecError
from strata.spec import apply_overrides, parse_job_spec


def base(**over):
    spec = {"name": "digits-mlp", "strategy": "multi_worker_mirrored", "workers": 2,
            "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [32], "classes": 10}},
            "data": {"source": "digits", "batch_size": 64},
            "training": {"epochs": 2, "optimizer": {"name": "adam", "learning_rate": 0.01}}}
    for key, value in over.items():
        spec = apply_overrides(spec, [f"{key}={value}"]) if not callable(value) else value(spec)
    return spec


def test_defaults_fill_in():
    s = parse_job_spec({"name": "x", "model": {"builtin": {}}})
    d = s.to_dict()
    assert d["strategy"] == "multi_worker_mirrored" and d["workers"] == 1
    assert d["data"] == {"source": "digits", "path": "", "batch_size": 256, "examples": 0,
                         "test_path": "", "features": {}, "label": "", "image_size": [],
                         "test_fraction": 0.2}
    # an optimizer and loss not given stay out (a compiled code.model brings its own); what
    # stands in is the default's
    assert d["training"]["epochs"] == 1 and "optimizer" not in d["training"]
    assert "loss" not in d["training"]
    assert s.training.optimizer_used.name == "adam" and s.training.optimizer is None
    assert s.training.loss_used == "sparse_categorical_crossentropy" and s.training.loss == ""
    given = parse_job_spec({"name": "x", "model": {"builtin": {}},
                            "training": {"optimizer": {"name": "sgd"}, "loss": "mean_squared_error"}})
    assert given.training.optimizer.name == "sgd" and given.training.optimizer.learning_rate == 0.001
    assert parse_job_spec(given.to_dict()) == given
    assert d["memory"] == {"per_task_budget": "", "mixed_precision": "none", "recompute": False,
                           "profile": "auto"}
    assert parse_job_spec(d).to_dict() == d  # normalized specs are fixed points


def drop(*path):
    def f(spec):
        node = spec
        for p in path[:-1]:
            node = node[p]
        del node[path[-1]]
        return spec
    return f


BAD = [
    ("name", {"name": "Bad_Name"}),
    ("name", {"name": drop("name")}),
    ("strategy", {"strategy": "magic"}),
    ("workers", {"strategy": "pipeline"}),           # base has workers: 2
    ("parameter_servers", {"strategy": "parameter_server", "parameter_servers": 0}),
    ("workers", {"workers": 0}),
    ("workers", {"workers": "two"}),
    ("parameter_servers", {"parameter_servers": 1}),
    ("stages", {"stages": 2}),
    ("microbatches", {"microbatches": 0}),
    ("model", {"model": drop("model", "builtin")}),
    ("model.builtin.hidden[0]", {"model.builtin.hidden": "[0]"}),
    ("model.builtin.kind", {"model.builtin.kind": "cnn"}),
    ("model.builtin.input_shape", {"model.builtin.input_shape": "[784]"}),
    ("model.builtin.classes", {"model.builtin.classes": 3}),
    ("model.keras_json", {"model": lambda s: {**s, "model": {"keras_json": "{not json"}}}),
    ("data.source", {"data.source": "imagenet"}),
    ("data.path", {"data.source": "npz"}),
    ("data.batch_size", {"data.batch_size": 63}),
    ("data.batch_size", {"data.batch_size": -1}),
    ("data.examples", {"data.examples": 10}),
    ("training.steps", {"training.steps": 5}),
    ("training.optimizer.name", {"training.optimizer.name": "lbfgs"}),
    ("training.optimizer.learning_rate", {"training.optimizer.learning_rate": -1}),
    ("training.loss", {"training.loss": "hinge"}),
    ("memory.per_task_budget", {"memory.per_task_budget": "lots"}),
    ("memory.mixed_precision", {"memory.mixed_precision": "int4"}),
    ("memory.recompute", {"memory.recompute": "maybe"}),
    ("memory.recompute", {"memory.recompute": "true"}),
    ("checkpoint.every_steps", {"checkpoint.every_steps": -5}),
    ("restart.max_restarts", {"restart.max_restarts": -1}),
    ("colour", {"colour": "blue"}),
    ("training.epoch", {"training.epoch": 3}),
]


@pytest.mark.parametrize("field,over", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_bad_field_is_named(field, over):
    spec = base()
    for k, v in over.items():
        spec = v(spec) if callable(v) else apply_overrides(spec, [f"{k}={v}"])
    with pytest.raises(SpecError) as e:
        parse_job_spec(spec)
    assert e.value.field == field, str(e.value)
    assert str(e.value).startswith(field)


def test_lambda_layer_refused_at_submit():
    import json
    lam = {"class_name": "Sequential", "config": {"name": "s", "layers": [
        {"module": "keras.layers", "class_name": "InputLayer", "config": {"batch_shape": [None, 64], "name": "in"}},
        {"module": "keras.layers", "class_name": "Lambda", "config": {"name": "evil", "function": "x"}}]}}
    with pytest.raises(SpecError) as e:
        parse_job_spec({"name": "x", "model": {"keras_json": json.dumps(lam)}})
    assert e.value.field == "model.keras_json" and "Lambda" in str(e.value)


def test_not_a_mapping():
    with pytest.raises(SpecError):
        parse_job_spec(["name"])


def test_overrides_typed_values():
    spec = apply_overrides({"training": {"epochs": 1}}, ["training.epochs=3", "memory.recompute=false",
                                                         "name=abc"])
    assert spec["training"]["epochs"] == 3 and spec["memory"]["recompute"] is False
    with pytest.raises(SpecError):
        apply_overrides({}, ["noequals"])


def test_empty_hidden_list_survives_the_wire():
    # proto3 drops an empty repeated field: `hidden: []` (a linear model) must not come back
    # as the default [1024, 512, 256]
    from strata.convert import accepted_spec_from_proto, raw_spec_to_proto, spec_from_proto, spec_to_proto

    raw = {"name": "linear", "strategy": "multi_worker_mirrored",
           "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [], "classes": 10}}}
    parsed = spec_from_proto(raw_spec_to_proto(raw))
    assert parsed.to_dict()["model"]["builtin"]["hidden"] == []
    again = accepted_spec_from_proto(spec_to_proto(parsed))
    assert again.to_dict()["model"]["builtin"]["hidden"] == []
    unset = dict(raw, model={"builtin": {"kind": "mlp", "input_shape": [64], "classes": 10}})
    assert spec_from_proto(raw_spec_to_proto(unset)).to_dict()["model"]["builtin"]["hidden"] == [1024, 512, 256]


def test_streamed_sources_fields_and_round_trip():
    from strata import convert

    base = {"name": "x", "model": {"builtin": {"input_shape": [64], "classes": 10}},
            "training": {"steps": 5}}
    tf = dict(base, data={"source": "tfrecord", "path": "/d/train-*", "label": "y",
                          "features": {"x": {"shape": [64]}, "y": {"shape": [], "dtype": "int64"}}})
    s = parse_job_spec(tf)
    assert s.data.features == {"x": {"shape": [64], "dtype": "float32"},
                               "y": {"shape": [], "dtype": "int64"}}
    assert convert.spec_from_proto(convert.spec_to_proto(s)) == s  # a map survives the wire
    for data, field in [
        ({"source": "tfrecord", "path": "/d/*", "label": "y"}, "data.features"),
        ({"source": "tfrecord", "path": "/d/*", "label": "z",
          "features": {"x": {"shape": [64]}, "y": {}}}, "data.label"),
        ({"source": "csv", "path": "/d.csv"}, "data.label"),
        ({"source": "csv", "label": "y"}, "data.path"),
        ({"source": "images", "path": "/imgs"}, "data.image_size"),
        ({"source": "digits", "label": "y"}, "data.label"),
        ({"source": "npz", "path": "/a.npz", "test_path": "/b"}, "data.test_path"),
        ({"source": "csv", "path": "/d.csv", "label": "y", "test_fraction": 0.9},
         "data.test_fraction"),
    ]:
        with pytest.raises(SpecError) as e:
            parse_job_spec(dict(base, data=data))
        assert e.value.field == field, (data, e.value)


def test_code_section_rules():
    sha = "a" * 64
    base = {"name": "x", "training": {"steps": 5}}
    s = parse_job_spec(dict(base, code={"sha256": sha, "dir_name": "p", "model": "train:build"}))
    assert s.code_model == "train:build" and s.model == {}
    for raw, field in [
        (dict(base, code={"dir": "./p", "model": "train:build"}), "code.dir"),
        (dict(base, code={"sha256": sha, "model": "train"}), "code.model"),
        (dict(base, code={"sha256": sha}), "code"),
        (dict(base, code={"sha256": sha, "model": "t:f"}, model={"builtin": {}}), "model"),
        (dict(base, code={"sha256": sha, "model": "t:f"}, strategy="pipeline"), "code.model"),
        (dict(base, code={"sha256": sha, "dataset": "t:f"}, training={"epochs": 2},
              model={"builtin": {}}), "training.steps"),
    ]:
        with pytest.raises(SpecError) as e:
            parse_job_spec(raw)
        assert e.value.field == field, (raw, e.value)


@pytest.mark.parametrize("content,needle", [
    (b"name: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply"),
    (b"name: x\nworkers: 1\ndata: \xff\xfe\n", "line 3: not UTF-8"),
    (b"name: x\nworkers: " + b"9" * 5000 + b"\n", "digits"),
    (b"name: x\nmodel: " + b"{a: " * 40 + b"1" + b"}" * 40 + b"\n", "levels deep"),
])
def test_hostile_job_files_name_the_problem_without_a_traceback(tmp_path, content, needle):
    from strata.spec import load_spec_file

    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    with pytest.raises(SpecError, match=needle) as e:
        load_spec_file(str(path))
    assert e.value.field == "JOB"


def test_a_refusal_never_echoes_unbounded_input():
    with pytest.raises(SpecError) as e:
        parse_job_spec({"name": "a" * (5 << 20)})
    assert len(str(e.value)) < 1200
