"""Nothing crashes, nothing leaks: generated specs and raw bytes against the spec parser and
against a real coordinator through a real channel, undecodable bytes on every method, and a
burst of 1,000 submissions from many clients.

The servicer tests start a coordinator process each (no agents, so accepted jobs wait); the
spec parser is fuzzed in-process. Every refusal must be INVALID_ARGUMENT naming a field; no
call may end INTERNAL, UNKNOWN or past its deadline."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from strata.coordinator.admission import prepare
from strata.errors import SpecError
from strata.modelspec import ModelSpecError
from strata.protos import strata_pb2 as pb
from strata.spec import parse_job_spec

FIELD = "strata-field"
RPC_TIMEOUT_S = 20
# the status codes a well-formed refusal may carry (raw bytes can decode into a real lookup of
# a job or agent that does not exist, or a registration)
BENIGN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
          grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
          grpc.StatusCode.PERMISSION_DENIED}

WORDS = ["mlp", "digits", "synthetic", "npz", "csv", "tfrecord", "images", "adam", "sgd",
         "multi_worker_mirrored", "parameter_server", "pipeline", "hybrid", "1GiB", "0", "-1",
         "bfloat16", "float16", "none", "auto", "true", "x", "", "fz", "/etc/passwd", "../..",
         "sparse_categorical_crossentropy", "mse", "float32", "int64", "string", "CPU", "y"]
INTS = st.one_of(st.sampled_from([0, 1, 2, 3, 8, 64, 256, -1, 10**6, 2**31, 2**63 - 1]),
                 st.integers(min_value=-2**63, max_value=2**63 - 1))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, st.integers(min_value=-10**400, max_value=10**400),
                    st.floats(), st.sampled_from(WORDS), st.text(max_size=30))
VALUES = st.recursive(SCALARS, lambda c: st.lists(c, max_size=5)
                      | st.dictionaries(st.sampled_from(WORDS) | st.text(max_size=8), c,
                                        max_size=4), max_leaves=12)


_n = st.sampled_from
MLP = {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [32, 16], "classes": 10}}
DIGITS = {"source": "digits", "batch_size": 64}
#: valid specs of every strategy, mutated by the generators below
BASES = [
    {"name": "fz", "workers": 2, "model": MLP, "data": DIGITS, "training": {"steps": 20}},
    {"name": "fz", "strategy": "parameter_server", "workers": 2, "parameter_servers": 1,
     "model": MLP, "data": DIGITS, "training": {"epochs": 1, "optimizer": {"name": "sgd"}}},
    {"name": "fz", "strategy": "pipeline", "stages": 2, "microbatches": 4, "model": MLP,
     "data": DIGITS, "training": {"steps": 5}, "memory": {"recompute": True}},
    {"name": "fz", "strategy": "hybrid", "workers": 2, "stages": 2, "microbatches": 2,
     "model": MLP, "data": {"source": "synthetic", "examples": 512, "batch_size": 32},
     "training": {"steps": 5}, "checkpoint": {"every_steps": 2, "keep": 1},
     "restart": {"max_restarts": 2, "backoff_s": 0}},
    {"name": "fz", "model": MLP, "data": {"source": "npz", "path": "/data/d.npz"},
     "memory": {"per_task_budget": "256MiB", "mixed_precision": "bfloat16"}},
    {"name": "fz", "model": {"builtin": {"kind": "mlp", "input_shape": [8, 8], "hidden": [],
                                         "classes": 3}},
     "data": {"source": "tfrecord", "path": "/data/*.tfrecord", "label": "y",
              "features": {"x": {"shape": [8, 8], "dtype": "float32"},
                           "y": {"shape": [], "dtype": "int64"}}},
     "training": {"steps": 3, "loss": "sparse_categorical_crossentropy"}},
]
#: every field path a job file has (``a.b.c``), to mutate
PATHS = sorted({"name", "strategy", "workers", "parameter_servers", "stages", "microbatches",
                "model.builtin.kind", "model.builtin.input_shape", "model.builtin.hidden",
                "model.builtin.classes", "model.keras_json", "model.keras_file",
                "data.source", "data.path", "data.test_path", "data.batch_size", "data.examples",
                "data.test_fraction", "data.image_size", "data.label", "data.features",
                "data.features.x.shape", "data.features.x.dtype", "training.epochs",
                "training.steps", "training.loss", "training.seed",
                "training.optimizer.name", "training.optimizer.learning_rate",
                "memory.per_task_budget", "memory.mixed_precision", "memory.recompute",
                "memory.profile", "checkpoint.every_steps", "checkpoint.keep",
                "restart.max_restarts", "restart.backoff_s", "restart.retry_user_errors",
                "code.dir", "code.model", "code.dataset", "model", "data", "training",
                "data.bogus"})


def _mutate(spec: dict, path: str, value, delete: bool) -> dict:
    import copy

    out = copy.deepcopy(spec)
    node = out
    keys = path.split(".")
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    if delete:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return out


@st.composite
def spec_dicts(draw):
    """A valid spec with one to four fields replaced by any value (or removed)."""
    spec = draw(st.sampled_from(BASES))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        spec = _mutate(spec, draw(st.sampled_from(PATHS)), draw(VALUES),
                       draw(st.booleans().map(lambda b: b and draw(st.booleans()))))
    return spec


SPEC_DICTS = spec_dicts()


@settings(max_examples=3000, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(SPEC_DICTS)
def test_spec_validation_refuses_with_a_field_and_never_crashes(raw):
    try:
        spec = parse_job_spec(raw)
    except (SpecError, ModelSpecError) as e:
        assert e.field and len(str(e)) < 1500
        event(f"refused: {e.field}")
        return
    event("parsed")
    try:  # what the coordinator does next: profile the model and plan the tasks
        prepare(spec)
    except (SpecError, ModelSpecError) as e:
        assert e.field


# --------------------------------------------------------------------------------------------
# through a real coordinator


def _scalar(f):
    """Any value of a scalar field's type, edges included (NaN, unknown enums, huge ints)."""
    from google.protobuf.descriptor import FieldDescriptor as F

    t = f.type
    if t == F.TYPE_STRING:
        return _n(WORDS) | st.text(max_size=40)
    if t == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return st.floats(width=64 if t == F.TYPE_DOUBLE else 32)
    if t == F.TYPE_ENUM:
        return st.integers(min_value=-2, max_value=12)
    if t == F.TYPE_INT32:
        return st.integers(min_value=-2**31, max_value=2**31 - 1)
    return INTS


def _leaves(desc, prefix=()):
    """Every field of the message, nested ones included, as a path of field descriptors."""
    for f in desc.fields:
        path = prefix + (f,)
        yield path
        if (f.message_type is not None and not f.is_repeated
                and not f.message_type.GetOptions().map_entry):
            yield from _leaves(f.message_type, path)


LEAVES = list(_leaves(pb.JobSpec.DESCRIPTOR))


@st.composite
def spec_protos(draw):
    """A valid JobSpec message of every strategy with one to four fields (at any depth) set to
    any value of their type, cleared, or filled with a list."""
    from strata.convert import spec_to_proto

    msg = pb.JobSpec()
    msg.CopyFrom(spec_to_proto(parse_job_spec(draw(st.sampled_from(BASES)))))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        path = draw(st.sampled_from(LEAVES))
        node = msg
        for f in path[:-1]:
            node = getattr(node, f.name)
        f = path[-1]
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            value = f.message_type.fields_by_name["value"]
            entry = getattr(node, f.name)[draw(_n(WORDS) | st.text(max_size=8))]
            for vf in value.message_type.fields:
                if draw(st.booleans()):
                    if vf.is_repeated:
                        getattr(entry, vf.name).extend(draw(st.lists(_scalar(vf), max_size=5)))
                    else:
                        setattr(entry, vf.name, draw(_scalar(vf)))
        elif f.message_type is not None:
            node.ClearField(f.name)
        elif f.is_repeated:
            node.ClearField(f.name)
            getattr(node, f.name).extend(draw(st.lists(_scalar(f), max_size=2000 if draw(
                st.integers(0, 20)) == 0 else 6)))
        else:
            setattr(node, f.name, draw(_scalar(f)))
    return msg


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    from strata.local import LocalCluster

    c = LocalCluster(workers=0, state_dir=str(tmp_path_factory.mktemp("fuzz")))
    c.start_coordinator()
    ch = grpc.insecure_channel(c.address)
    yield c, ch
    ch.close()
    c.stop()


def _call(ch, path: str, payload: bytes, streaming: bool):
    """Sends raw bytes; returns (code, trailing metadata as a dict)."""
    ident = lambda b: b  # noqa: E731 - raw bytes both ways
    try:
        if streaming:
            for _ in ch.unary_stream(path, request_serializer=ident, response_deserializer=ident)(
                    payload, timeout=RPC_TIMEOUT_S):
                pass
            return grpc.StatusCode.OK, {}
        ch.unary_unary(path, request_serializer=ident, response_deserializer=ident)(
            payload, timeout=RPC_TIMEOUT_S)
        return grpc.StatusCode.OK, {}
    except grpc.RpcError as e:
        return e.code(), dict(e.trailing_metadata() or ())


METHODS = [(s.full_name, m) for s in pb.DESCRIPTOR.services_by_name.values()
           for m in s.methods]


@pytest.mark.integration
@pytest.mark.parametrize("service,method", METHODS, ids=[m.name for _, m in METHODS])
def test_undecodable_bytes_get_invalid_argument_on_every_method(coordinator, service, method):
    _, ch = coordinator
    path = f"/{service}/{method.name}"
    garbage = b"\x0a\xff\xff\xff\xff\x01"   # a length-delimited field longer than the message
    if method.client_streaming:
        ident = lambda b: b  # noqa: E731
        with pytest.raises(grpc.RpcError) as e:
            if method.server_streaming:
                call = ch.stream_stream(path, request_serializer=ident,
                                        response_deserializer=ident)
                list(call(iter([garbage]), timeout=RPC_TIMEOUT_S))
            else:
                call = ch.stream_unary(path, request_serializer=ident,
                                       response_deserializer=ident)
                call(iter([garbage]), timeout=RPC_TIMEOUT_S)
        code, details = e.value.code(), e.value.details()
    else:
        code, _ = _call(ch, path, garbage, method.server_streaming)
        details = ""
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, code, details)


@pytest.mark.integration
@settings(max_examples=1500, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(spec=spec_protos(), plan=st.booleans())
def test_generated_specs_through_a_real_channel(coordinator, spec, plan):
    _, ch = coordinator
    method = "PlanJob" if plan else "SubmitJob"
    payload = (pb.PlanJobRequest(spec=spec) if plan
               else pb.SubmitJobRequest(spec=spec, request_id=uuid.uuid4().hex))
    ident = lambda b: b  # noqa: E731
    try:
        reply = ch.unary_unary(f"/strata.v1.JobService/{method}", request_serializer=ident,
                               response_deserializer=ident)(payload.SerializeToString(),
                                                            timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # a valid spec this cluster can't
            assert "cannot run on this cluster" in e.details(), e.details()  # run (no workers)
            event(f"{method}: infeasible")
            return
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert dict(e.trailing_metadata() or ()).get(FIELD), e.details()
        assert len(e.details()) < 1500
        event(f"refused: {dict(e.trailing_metadata() or ()).get(FIELD)}")
        return
    event(f"{method} accepted")
    if not plan:  # accepted: it waits for agents; cancelled so that the queue stays short
        job = pb.Job.FromString(reply)
        ch.unary_unary("/strata.v1.JobService/CancelJob", request_serializer=ident,
                       response_deserializer=ident)(pb.CancelJobRequest(id=job.id)
                                                    .SerializeToString(), timeout=RPC_TIMEOUT_S)


@pytest.mark.integration
@settings(max_examples=1500, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from([(s, m) for s, m in METHODS if not m.client_streaming]),
       payload=st.binary(max_size=300))
def test_raw_bytes_on_every_method(coordinator, method, payload):
    _, ch = coordinator
    service, m = method
    code, trailers = _call(ch, f"/{service}/{m.name}", payload, m.server_streaming)
    assert code in BENIGN, (m.name, code)


# --------------------------------------------------------------------------------------------
# a burst


def _burst_spec(i: int) -> tuple[pb.JobSpec, str]:
    """Job ``i`` of the burst, and the field a refusal must name ("" for a valid one)."""
    spec = pb.JobSpec(name=f"burst-{i}", strategy="multi_worker_mirrored", workers=1,
                      model=pb.ModelSpec(builtin=pb.BuiltinModel(kind="mlp", input_shape=[64],
                                                                 hidden=[16], classes=10)),
                      data=pb.DataSpec(source="digits", batch_size=64),
                      training=pb.TrainingSpec(steps=10))
    fault = i % 10
    if fault == 7:
        spec.data.batch_size = -5
        return spec, "data.batch_size"
    if fault == 8:
        spec.strategy = "telepathy"
        return spec, "strategy"
    if fault == 9:
        spec.model.builtin.hidden.extend([8] * 2000)
        return spec, "model.builtin.hidden"
    return spec, ""


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_burst_of_1000_submissions_from_many_clients(tmp_path):
    """700 valid and 300 invalid jobs from 10 clients at once, 50 of the valid ones sent a
    second time with their request id (a retry after a lost reply): every valid job is stored
    exactly once, every invalid one refused naming its field."""
    from strata.local import LocalCluster
    from strata.protos import strata_pb2_grpc as pb_grpc

    c = LocalCluster(workers=0, state_dir=str(tmp_path))
    c.start_coordinator()
    try:
        ids = {i: uuid.uuid4().hex for i in range(1000)}
        local = threading.local()

        def stub():
            if not hasattr(local, "stub"):
                local.stub = pb_grpc.JobServiceStub(grpc.insecure_channel(c.address))
            return local.stub

        def submit(i: int):
            spec, field = _burst_spec(i)
            try:
                job = stub().SubmitJob(pb.SubmitJobRequest(spec=spec, request_id=ids[i]),
                                       timeout=60)
                return i, field, job.id, None
            except grpc.RpcError as e:
                return i, field, "", (e.code(), dict(e.trailing_metadata() or ()).get(FIELD))

        order = list(range(1000)) + [i for i in range(0, 500, 10)]  # 50 retries
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            results = list(pool.map(submit, order))
        took = time.monotonic() - start
        first: dict[int, str] = {}
        for i, field, job_id, err in results:
            if field:
                assert err == (grpc.StatusCode.INVALID_ARGUMENT, field), (i, err)
            else:
                assert err is None, (i, err)
                assert first.setdefault(i, job_id) == job_id  # a retry returns the same job
        assert len(first) == 700
        # every stored job, read back a page at a time: each valid name exactly once
        names, token = [], ""
        s = pb_grpc.JobServiceStub(grpc.insecure_channel(c.address))
        while True:
            resp = s.ListJobs(pb.ListJobsRequest(page_size=97, page_token=token), timeout=30)
            names += [j.name for j in resp.jobs]
            token = resp.next_page_token
            if not token:
                break
        assert sorted(names) == sorted(f"burst-{i}" for i in first)
        from strata.client import Client

        with Client(c.address) as client:  # the client reads every page too
            assert sorted(j.name for j in client.jobs(page_size=97)) == sorted(names)
            assert len(client.jobs(states=["PENDING"], page_size=1000)) == 700
        pending = s.ListJobs(pb.ListJobsRequest(states=[pb.PENDING], page_size=1000), timeout=30)
        assert len(pending.jobs) == 700 and not pending.next_page_token
        print(f"1,050 submissions from 10 clients in {took:.1f} s "
              f"({1050 / took:.0f}/s)")
    finally:
        c.stop()
