"""A job spec and its message convert field by field, exactly, both ways: a parsed spec comes
back equal from its message (checked or accepted), a message made from a spec comes back equal
from its spec, with the presence of every field that has it (an empty list, a zero that is not
the default), and a client's message is checked as its fields were given."""

from __future__ import annotations

import json
import os

import pytest
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings

from strata import convert
from strata.errors import SpecError
from strata.modelspec import ModelSpecError
from strata.protos import strata_pb2 as pb
from strata.spec import parse_job_spec
from tests.test_fuzz import SPEC_DICTS, spec_protos

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "tests", "fixtures", "keras_models.json")) as _f:
    KERAS_JSON = json.load(_f)["good"]["digits_mlp"]["json"]
SHA = "ab" * 32
MLP = {"builtin": {"hidden": [16, 8]}}

#: every strategy; every optional section given and not; empty lists; defaults; zeros that
#: are not the default (their presence on the wire is what keeps them)
RAW = {
    "defaults": {"name": "a", "model": {"builtin": {}}},
    "no_hidden_layers": {"name": "a", "model": {"builtin": {"hidden": []}}},
    "mirrored_gradients": {
        "name": "m", "workers": 4, "model": MLP, "data": {"batch_size": 64},
        "gradients": {"accumulate": 2, "compression": "bfloat16", "pack_size": 0},
        "training": {"steps": 9, "seed": 7, "loss": "categorical_crossentropy",
                     "optimizer": {"name": "sgd", "learning_rate": 0.5}}},
    "parameter_server": {
        "name": "p", "strategy": "parameter_server", "workers": 3, "parameter_servers": 2,
        "model": MLP, "data": {"source": "synthetic", "examples": 512, "batch_size": 96},
        "memory": {"per_task_budget": "64MiB", "mixed_precision": "bfloat16",
                   "profile": False},
        "training": {"optimizer": {"name": "adagrad"}}},
    "pipeline": {
        "name": "q", "strategy": "pipeline", "stages": 2, "microbatches": 4, "model": MLP,
        "memory": {"recompute": True, "profile": True},
        "checkpoint": {"every_steps": 5, "keep": 1},
        "restart": {"max_restarts": 3, "backoff_s": 0, "retry_user_errors": True}},
    "hybrid": {
        "name": "h", "strategy": "hybrid", "workers": 2, "stages": 2, "microbatches": 2,
        "model": MLP, "gradients": {"compression": "float16"},
        "restart": {"backoff_s": 0.25}},
    "npz": {"name": "n", "model": MLP, "data": {"source": "npz", "path": "/d/x.npz"}},
    "tfrecord": {
        "name": "t", "model": {"builtin": {"input_shape": [8, 8], "classes": 3}},
        "data": {"source": "tfrecord", "path": "/d/*.tfrecord", "test_path": "/t/*",
                 "label": "y", "features": {"x": {"shape": [8, 8]},
                                            "y": {"shape": [], "dtype": "int64"}}},
        "training": {"steps": 3}},
    "csv": {"name": "c", "model": MLP,
            "data": {"source": "csv", "path": "/d/a.csv", "label": "y", "test_fraction": 0.5}},
    "images": {"name": "i", "model": {"builtin": {"input_shape": [4, 4, 3]}},
               "data": {"source": "images", "path": "/d/img", "image_size": [4, 4]}},
    "keras_json": {"name": "k", "model": {"keras_json": KERAS_JSON}},
    # size 0: a zero proto3 leaves out, which the spec still holds
    "keras_file": {"name": "f", "model": {"keras_file": {
        "sha256": SHA, "size": 0, "config": KERAS_JSON}}},
    "code_model": {"name": "u", "code": {"sha256": SHA, "dir_name": "proj", "size": 0,
                                         "model": "train:build_model"}},
    "code_dataset": {"name": "v", "strategy": "parameter_server", "model": MLP,
                     "training": {"steps": 4},
                     "code": {"sha256": SHA, "size": 10, "dataset": "data:load"}},
}
SPECS = {name: parse_job_spec(raw) for name, raw in RAW.items()}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_spec_comes_back_equal_from_its_message(name):
    spec = SPECS[name]
    msg = convert.spec_to_proto(spec)
    wire = pb.JobSpec.FromString(msg.SerializeToString())
    assert convert.spec_from_proto(wire) == spec
    assert convert.accepted_spec_from_proto(wire) == spec
    # plain data inside (nothing of the message's left in the spec): the store writes it as JSON
    # (a map's order is the wire's)
    assert (json.dumps(convert.spec_from_proto(wire).to_dict(), sort_keys=True)
            == json.dumps(spec.to_dict(), sort_keys=True))
    # and the message from its spec: equal, presence included, byte for byte
    for back in (convert.spec_from_proto(msg), convert.accepted_spec_from_proto(msg)):
        again = convert.spec_to_proto(back)
        assert again == msg
        assert again.SerializeToString(deterministic=True) == msg.SerializeToString(
            deterministic=True)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_message_is_that_of_the_normalized_mapping(name):
    # field by field, the same message as the spec's mapping (the store's JSON) read by
    # protobuf's own JSON reader
    spec = SPECS[name]
    assert convert.spec_to_proto(spec) == convert.raw_spec_to_proto(spec.to_dict())


def test_presence_that_matters_survives():
    msg = convert.spec_to_proto(SPECS["no_hidden_layers"])
    assert msg.model.builtin.no_hidden and not msg.model.builtin.hidden
    assert not convert.spec_to_proto(SPECS["defaults"]).model.builtin.HasField("no_hidden")
    # zeros that are not the default: absent, each would read as its default
    pipe = convert.spec_to_proto(SPECS["pipeline"])
    assert pipe.restart.HasField("backoff_s") and pipe.restart.backoff_s == 0
    assert pipe.training.HasField("steps") and pipe.training.HasField("seed")
    # a model only the job's code builds: an empty model section, given
    code = convert.spec_to_proto(SPECS["code_model"])
    assert code.HasField("model") and code.model.WhichOneof("source") is None
    # an optimizer not given stays out; given, it is there
    assert not convert.spec_to_proto(SPECS["defaults"]).training.HasField("optimizer")
    assert convert.spec_to_proto(SPECS["parameter_server"]).training.HasField("optimizer")


def _plain(value):
    """A mapping read by ``spec_from_proto`` as plain data, to compare."""
    if hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _nan_named(value):
    """``value`` with each NaN as the text "nan" (a NaN is not equal to itself)."""
    if isinstance(value, dict):
        return {k: _nan_named(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_named(v) for v in value]
    return "nan" if isinstance(value, float) and value != value else value


def _message_to_dict(msg):
    """Only the fields that are set (optional scalars by presence), with native Python types:
    the dict the conversion once went through, as the reference to compare with."""
    out = {}
    for field, value in msg.ListFields():
        sub = field.message_type
        if sub is not None and sub.GetOptions().map_entry:
            nested = sub.fields_by_name["value"].message_type is not None
            out[field.name] = {k: _message_to_dict(v) if nested else v for k, v in value.items()}
        elif convert._is_repeated(field):
            out[field.name] = [_message_to_dict(v) if isinstance(v, Message) else v
                               for v in value]
        elif sub is not None:
            out[field.name] = _message_to_dict(value)
        else:
            out[field.name] = value
    return out


def _given_fields(msg):
    """What a client's message gives: its set fields, an empty hidden list by its flag."""
    d = _message_to_dict(msg)
    builtin = d.get("model", {}).get("builtin")
    if isinstance(builtin, dict) and builtin.pop("no_hidden", False):
        builtin.setdefault("hidden", [])
    return d


def _outcome(parse, raw):
    try:
        return repr(parse(raw))
    except (SpecError, ModelSpecError) as e:
        return f"{type(e).__name__}: {e.field}: {e.message}"


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(spec_protos())
def test_a_clients_message_is_checked_as_its_fields_were_given(msg):
    assert _nan_named(_plain(convert._Given(msg))) == _nan_named(_given_fields(msg))
    assert _outcome(convert.spec_from_proto, msg) == _outcome(parse_job_spec,
                                                               _given_fields(msg))


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(SPEC_DICTS)
def test_a_mapping_sent_unchecked_is_checked_as_written(raw):
    try:
        msg = convert.raw_spec_to_proto(raw)
    except Exception:  # not a JobSpec message at all: refused by the client's library
        return
    assert _outcome(convert.spec_from_proto, msg) == _outcome(parse_job_spec,
                                                               _given_fields(msg))
