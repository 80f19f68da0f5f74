"""Hostile input, as pure logic: bounds on every request field, the keras_json safety walk,
pages and their tokens, data roots, and per-user limits (coordinator driven tick by tick)."""

from __future__ import annotations

import json
import math
import os

import pytest

from strata.coordinator.bounds import MAX_STRING, Undecodable, check_request
from strata.coordinator.paging import MAX_PAGE_SIZE, page
from strata.dataroots import OutsideRoots, confine, under_roots
from strata.errors import QuotaExceeded, SpecError
from strata.modelspec import ModelSpecError, check_keras_json_safe, parse_keras_json
from strata.protos import strata_pb2 as pb

GiB = 1 << 30
SPEC = {"name": "h", "workers": 1,
        "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [8], "classes": 10}},
        "data": {"source": "digits", "batch_size": 64}, "training": {"steps": 10}}


def refused(msg) -> SpecError:
    with pytest.raises(SpecError) as e:
        check_request(msg)
    assert len(str(e.value)) < 300  # never the value itself
    return e.value


# --------------------------------------------------------------------------------------------
# bounds on every field


def test_strings_are_bounded_and_named_as_the_job_file_names_them():
    e = refused(pb.SubmitJobRequest(spec=pb.JobSpec(name="x" * 5_000_000)))
    assert e.field == "name" and "at most 4096" in e.message
    e = refused(pb.SubmitJobRequest(spec=pb.JobSpec(data=pb.DataSpec(path="/d" * MAX_STRING))))
    assert e.field == "data.path"
    e = refused(pb.RegisterAgentRequest(name="a", work_dir="/x\0y"))
    assert e.field == "work_dir" and "NUL" in e.message
    # a model's JSON may be long; a job name may not
    check_request(pb.SubmitJobRequest(spec=pb.JobSpec(
        model=pb.ModelSpec(keras_json="{" + " " * 1_000_000 + "}"))))


def test_counts_numbers_and_enums_are_bounded():
    e = refused(pb.SubmitJobRequest(spec=pb.JobSpec(model=pb.ModelSpec(
        builtin=pb.BuiltinModel(hidden=[8] * 1001)))))
    assert e.field == "model.builtin.hidden" and "at most 1000" in e.message
    e = refused(pb.SubmitJobRequest(spec=pb.JobSpec(
        training=pb.TrainingSpec(optimizer=pb.OptimizerSpec(learning_rate=math.nan)))))
    assert e.field == "training.optimizer.learning_rate" and "finite" in e.message
    e = refused(pb.SubmitJobRequest(spec=pb.JobSpec(restart=pb.RestartSpec(backoff_s=math.inf))))
    assert e.field == "restart.backoff_s"
    e = refused(pb.ReportTaskRequest(name="a", status=pb.TaskStatus(state=99)))
    assert e.field == "status.state" and "TaskState" in e.message
    e = refused(pb.ListJobsRequest(states=[pb.PENDING, 42]))
    assert e.field == "states[1]"
    e = refused(pb.HeartbeatRequest(tasks=[pb.TaskStatus(), pb.TaskStatus(peak_bytes=-1)]))
    assert e.field == "tasks[1].peak_bytes" and "negative" in e.message
    e = refused(pb.HeartbeatRequest(memory=pb.MemoryStatus(in_use_bytes=-5)))
    assert e.field == "memory.in_use_bytes"
    # an exit status is -signal
    check_request(pb.ReportTaskRequest(status=pb.TaskStatus(exit_code=-9)))


def test_maps_are_bounded_key_and_value():
    spec = pb.JobSpec()
    for i in range(1001):
        spec.data.features[f"f{i}"].dtype = "float32"
    assert refused(pb.SubmitJobRequest(spec=spec)).field == "data.features"
    spec = pb.JobSpec()
    spec.data.features["x"].dtype = "y" * 5000
    assert refused(pb.SubmitJobRequest(spec=spec)).field == "data.features['x'].dtype"


def test_undecodable_bytes_are_marked_not_raised():
    parse = Undecodable.deserializer(pb.SubmitJobRequest)
    bad = parse(b"\x0a\xff\xff\xff\xff")
    assert isinstance(bad, Undecodable) and bad.size == 5 and bad.message == "SubmitJobRequest"
    ok = parse(pb.SubmitJobRequest(request_id="r").SerializeToString())
    assert ok.request_id == "r"


# --------------------------------------------------------------------------------------------
# keras_json: every nested object, registered name or not


def kj_refused(obj) -> str:
    with pytest.raises(ModelSpecError) as e:
        check_keras_json_safe(obj)
    return e.value.message


def layer(**config):
    return {"module": "keras.layers", "class_name": "Dense", "registered_name": None,
            "config": {"name": "d", "units": 4, **config}}


@pytest.mark.parametrize("obj", [
    {"module": "os", "class_name": "system"},                          # no registered_name
    {"module": "os", "class_name": "system", "config": "id"},
    {"class_name": "system", "module": "subprocess", "registered_name": None},
    {"module": None, "class_name": "PlainSubclass", "registered_name": "PlainSubclass"},
    {"module": "keras.layers", "class_name": "Dense", "registered_name": "mine>Dense"},
    {"module": "keras.activations", "class_name": "function", "registered_name": "a>b"},
    {"class_name": "__typespec__", "config": {}},
    {"class_name": "__lambda__", "config": {"code": "..."}},
    {"class_name": "Lambda", "config": {}},
    {"class_name": ["Dense"]},
    {"class_name": "os.system"},
])
def test_foreign_objects_are_refused_wherever_they_are(obj):
    assert "safe mode" in kj_refused(obj)
    nested = {"module": "keras", "class_name": "Sequential", "registered_name": None,
              "config": {"layers": [layer(kernel_initializer={"config": {"deep": [obj]}})]}}
    assert "safe mode" in kj_refused(nested)


def test_keras_own_objects_pass():
    check_keras_json_safe(layer(activation={"module": "keras.activations",
                                            "class_name": "function", "config": "relu",
                                            "registered_name": "relu"},
                                kernel_initializer={"module": "keras.initializers",
                                                    "class_name": "GlorotUniform",
                                                    "config": {"seed": None},
                                                    "registered_name": None}))
    check_keras_json_safe({"class_name": "Dense", "config": {"units": 3}})  # the older form
    check_keras_json_safe({"class_name": "__keras_tensor__", "config": {"shape": [None, 4]}})
    check_keras_json_safe({"class_name": "__tuple__", "config": {"value": [1, 2]}})


def test_deep_nesting_is_refused_not_a_recursion_error():
    with pytest.raises(ModelSpecError, match="nested too deeply"):
        parse_keras_json("[" * 5000 + "]" * 5000)
    deep: dict = {"class_name": "Dense", "config": {}}
    for _ in range(300):
        deep = {"config": deep}
    with pytest.raises(ModelSpecError, match="nested too deeply"):
        check_keras_json_safe(deep)


# --------------------------------------------------------------------------------------------
# pages


def test_pages_walk_every_item_once_and_survive_changes_between_calls():
    items = [(float(i // 3), f"j{i:03d}") for i in range(250)]
    seen, token, pages = [], "", 0
    while True:
        chosen, token = page(items, lambda x: x, 100, token)
        seen += chosen
        pages += 1
        if not token:
            break
        items.insert(0, (-1.0, "new"))  # an item before the cursor does not shift the pages
    assert seen == sorted(set(seen)) and len(seen) == 250 and pages == 3
    assert page(items, lambda x: x, 0, "") [0] == items[:100]   # 0: the default size


@pytest.mark.parametrize("size,token", [(-1, ""), (MAX_PAGE_SIZE + 1, ""), (10, "garbage!"),
                                        (10, "W10="), (10, "WyJhIl0="), (10, "x" * 2000)])
def test_bad_page_requests_name_the_field(size, token):
    items = [(1.0, "a"), (2.0, "b")]
    with pytest.raises(SpecError) as e:
        page(items, lambda x: x, size, token)
    assert e.value.field in ("page_size", "page_token")


# --------------------------------------------------------------------------------------------
# data roots


def test_under_roots_is_lexical_and_strict():
    roots = ["/data", "/mnt/shared/ds"]
    assert under_roots("/data/a.npz", roots) and under_roots("/data/x/*.tfrecord", roots)
    assert under_roots("/data", roots)
    assert not under_roots("/data2/a.npz", roots)          # a prefix is not a parent
    assert not under_roots("/data/../etc/passwd", roots)
    assert not under_roots("/data/*/../../etc/shadow", roots)
    assert not under_roots("data/a.npz", roots)            # relative: never confined
    assert under_roots("anything", [])                     # no roots: unconfined


def test_confine_follows_links_and_says_the_same_whether_a_file_exists(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    (outside / "secret.npz").write_bytes(b"x")
    (root / "ok.npz").write_bytes(b"x")
    os.symlink(outside / "secret.npz", root / "link.npz")
    os.symlink(outside, root / "dirlink")
    (root / "shards").mkdir()
    (root / "shards" / "a.tfrecord").write_bytes(b"")
    os.symlink(outside / "secret.npz", root / "shards" / "b.tfrecord")
    roots = [str(root)]
    confine(str(root / "ok.npz"), "data.path", roots)
    confine(str(root / "missing.npz"), "data.path", roots)  # inside: "not found" comes later
    messages = set()
    for path in (outside / "secret.npz", outside / "nothing-here.npz", root / "link.npz",
                 root / "dirlink", root / "dirlink" / "secret.npz", root / "shards",
                 root / "shards" / "*.tfrecord", root / ".." / "outside" / "secret.npz"):
        with pytest.raises(OutsideRoots) as e:
            confine(str(path), "data.path", roots)
        assert e.value.field == "data.path"
        messages.add(e.value.message)
    assert len(messages) == 1 and "secret" not in messages.pop()


# --------------------------------------------------------------------------------------------
# per-user limits and data roots in the coordinator


def test_pending_jobs_per_user_and_tasks_per_job_are_limited(env):
    coord, *_ = env
    coord.max_pending_per_user, coord.max_tasks_per_job = 3, 4
    mine = [coord.submit(SPEC, owner="alice") for _ in range(3)]
    with pytest.raises(QuotaExceeded, match="alice has 3 jobs pending"):
        coord.submit(SPEC, owner="alice")
    coord.submit(SPEC, owner="bob")  # a limit per user
    coord.cancel(mine[0].id)
    coord.submit(SPEC, owner="alice")  # room again
    with pytest.raises(SpecError) as e:
        coord.submit({**SPEC, "workers": 5, "data": {"source": "digits", "batch_size": 80}},
                     owner="bob")
    assert e.value.field == "workers" and "at most 4" in str(e.value)


def test_jobs_go_only_where_the_data_roots_hold_their_data(env):
    coord, *_ = env
    coord.register("plain", "127.0.0.1", "CPU", GiB, [5000, 5001], [], shared_dir="/s",
                   data_roots=["/other"])
    with pytest.raises(SpecError) as e:
        coord.submit({**SPEC, "data": {"source": "npz", "path": "/data/d.npz"}})
    assert e.value.field == "data.path" and "/other" in e.value.message
    coord.register("data", "127.0.0.1", "CPU", GiB, [5010, 5011], [], shared_dir="/s",
                   data_roots=["/data"])
    job = coord.submit({**SPEC, "data": {"source": "npz", "path": "/data/d.npz"}})
    coord.tick()
    assert job.tasks[0].worker == "data"
    assert json.loads(json.dumps(coord.list_workers()[0].data_roots)) == ["/data"]
