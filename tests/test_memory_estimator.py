"""strata.memory: size parsing, the estimate's arithmetic, and the estimate against the peak
that real task processes measure (TF's BFC allocator on CPU).

The measured test runs the 784-input seed MLP (1,462,538 parameters, Adam) as two
MultiWorkerMirroredStrategy workers at global batches 256 and 2048 (per-replica 128 and 1024),
3 steps each, both jobs at once (~15 s on 2 cores). The two workers of one job differ by up
to ~20% (BFC chunk rounding depends on thread timing); a task's budget must hold the larger,
so the estimate is compared with the larger of the two peaks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from strata.taskconfig import TASK_CONFIG_VERSION

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from strata.memory import (
    OPTIMIZER_SLOTS,
    MemoryEstimate,
    default_budget,
    estimate_task_memory,
    update_transient_bytes,
)
from strata.units import MiB, format_size, parse_size
from strata.modelspec import profile_model  # noqa: E402

GiB = 1 << 30


def make_spec(**over) -> dict:
    spec = {
        "name": "mem", "strategy": "multi_worker_mirrored", "workers": 2, "parameter_servers": 0,
        "stages": 0, "microbatches": 1,
        "model": {"builtin": {"kind": "mlp", "input_shape": [784], "hidden": [1024, 512, 256],
                              "classes": 10}},
        "data": {"source": "synthetic", "path": "", "batch_size": 256, "examples": 0},
        "training": {"epochs": 0, "steps": 3, "optimizer": {"name": "adam", "learning_rate": 0.001},
                     "loss": "sparse_categorical_crossentropy", "seed": 0},
        "memory": {"per_task_budget": "", "mixed_precision": "none", "recompute": False},
        "checkpoint": {"every_steps": 0}, "restart": {"max_restarts": 0},
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(spec.get(k), dict) and k != "model":
            spec[k] = {**spec[k], **v}
        else:
            spec[k] = v
    return spec


# --------------------------------------------------------------------------------------------
# sizes


@pytest.mark.parametrize("text,value", [
    ("512MiB", 512 * MiB), ("2GiB", 2 * GiB), ("1.5GB", 1_500_000_000), ("100MB", 100_000_000),
    ("123", 123), ("1KiB", 1024), ("1kib", 1024), ("1KB", 1000), ("2 gib", 2 * GiB),
    ("0.5GiB", GiB // 2), ("10B", 10), ("1Gi", GiB), ("3M", 3_000_000), (" 64MiB ", 64 * MiB),
    ("1TiB", 1 << 40), (4096, 4096),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "MiB", "abc", "1.5", "12XB", "-1MB", "1e3", "1 2MiB",
                                  "5 MiBs", None, True, [1]])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError) as e:
        parse_size(text)
    assert repr(text) in str(e.value) or "size" in str(e.value)


@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (512, "512 B"), (1024, "1 KiB"), (1536, "1.5 KiB"), (MiB, "1 MiB"),
    (int(40.2 * MiB), "40.2 MiB"), (int(1.5 * GiB), "1.5 GiB"), (2 * GiB, "2 GiB"),
    (GiB - 1, "1 GiB"), (3 << 40, "3 TiB"),
])
def test_format_size(n, text):
    assert format_size(n) == text


def test_format_parse_round_trip():
    for n in (MiB, 3 * GiB, int(1.5 * GiB), 640 * MiB):
        assert parse_size(format_size(n).replace(" ", "")) == n


# --------------------------------------------------------------------------------------------
# arithmetic


def test_estimate_terms_for_the_seed_mlp():
    spec = make_spec()
    e = estimate_task_memory(spec, 128)
    params = 1_462_538
    assert isinstance(e, MemoryEstimate)
    assert e.weights == 4 * params and e.gradients == 4 * params
    assert e.optimizer_slots == 2 * 4 * params
    # the packed all-reduce buffer (every gradient in one chunk, the task's largest allocation)
    # and the update's temporaries come after the backward pass: what they hold beyond its
    # activations and workspace
    prof = profile_model(spec["model"])
    update = max(update_transient_bytes(layer, "adam") for layer in prof.layers)
    assert e.collective == 4 * params + update - e.activations - e.workspace > 0
    assert e.largest_alloc == 4 * params
    assert e.activations > 0 and e.data > 0 and e.overhead >= MiB
    d = e.as_dict()
    assert d["total"] == e.total == sum(v for k, v in d.items() if k != "total")
    # a given profile gives the same answer
    assert estimate_task_memory(spec, 128, profile_model(spec["model"])) == e


def test_estimate_grows_with_batch_and_follows_the_optimizer():
    spec = make_spec()
    small, big = estimate_task_memory(spec, 128), estimate_task_memory(spec, 1024)
    assert big.activations > 7 * small.activations and big.total > small.total
    for name, slots in OPTIMIZER_SLOTS.items():
        e = estimate_task_memory(make_spec(training={"optimizer": {"name": name}}), 128)
        # RMSprop's step holds one more gradient-sized buffer, counted with its slots
        assert e.optimizer_slots == (slots + (name == "rmsprop")) * 4 * 1_462_538
    assert OPTIMIZER_SLOTS == {"adam": 2, "adamw": 2, "rmsprop": 1, "adagrad": 1, "sgd": 0}


def test_estimate_data_terms():
    digits = make_spec(model={"builtin": {"kind": "mlp", "input_shape": [64],
                                          "hidden": [1024, 512, 256], "classes": 10}},
                       data={"source": "digits"})
    syn_small = make_spec(data={"examples": 1024})
    syn_big = make_spec(data={"examples": 65536})
    assert estimate_task_memory(digits, 128).data < estimate_task_memory(syn_small, 128).data
    assert estimate_task_memory(syn_big, 128).data > 65536 // 2 * 784 * 4
    # more workers: a smaller shard per task
    assert estimate_task_memory({**syn_big, "workers": 4}, 128).data < \
        estimate_task_memory(syn_big, 128).data
    # npz: the coordinator cannot see the file; the shard counts only when told its size
    npz = make_spec(data={"source": "npz", "path": "/x.npz"})
    assert estimate_task_memory(npz, 128, train_examples=60000).data > \
        estimate_task_memory(npz, 128).data


def test_mixed_precision_adds_compute_copies():
    plain = estimate_task_memory(make_spec(), 128)
    bf16 = estimate_task_memory(make_spec(memory={"mixed_precision": "bfloat16"}), 128)
    assert bf16.weights == plain.weights + 2 * 1_462_538
    assert bf16.gradients == plain.gradients and bf16.total > plain.total


def test_keras_json_model_estimate():
    with open(os.path.join(ROOT, "tests", "fixtures", "keras_models.json")) as f:
        cnn = json.load(f)["good"]["cnn"]
    spec = make_spec(model={"keras_json": cnn["json"]})
    e = estimate_task_memory(spec, 64)
    assert e.weights == 4 * cnn["count_params"]
    assert e.gradients == 4 * cnn["trainable_params"]  # BN moving statistics get none


def test_default_budget_headroom():
    small = MemoryEstimate(weights=4 * MiB, gradients=0, optimizer_slots=0, activations=0,
                           data=0, overhead=0)
    assert default_budget(small) == 20 * MiB  # +16 MiB floor
    big = MemoryEstimate(weights=800 * MiB, gradients=0, optimizer_slots=0, activations=0,
                         data=0, overhead=0)
    assert default_budget(big) == 1000 * MiB  # +25%
    assert default_budget(MiB * 100 + 1) % MiB == 0
    assert default_budget(estimate_task_memory(make_spec(), 1024)) > \
        estimate_task_memory(make_spec(), 1024).total


# --------------------------------------------------------------------------------------------
# against reality


def _launch_job(spec: dict, tmp_path, bfc_mb: int = 1024) -> list[tuple[subprocess.Popen, list]]:
    portpicker = pytest.importorskip("portpicker")
    n = spec["workers"]
    ports = [portpicker.pick_unused_port() for _ in range(n)]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    out = []
    for i in range(n):
        cfg = {"version": TASK_CONFIG_VERSION, "job_id": "mem", "role": "worker", "index": i,
               "spec": spec, "memory_budget_bytes": bfc_mb << 20, "report_interval_s": 5.0,
               "agent": {"output_dir": str(tmp_path / "out"), "threads": 1, "device": "CPU"}}
        path = tmp_path / f"task{i}.json"
        path.write_text(json.dumps(cfg))
        env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                   TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB=str(bfc_mb),
                   TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}))
        r, w = os.pipe()
        log = open(tmp_path / f"task{i}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "strata.worker.task", "--config", str(path),
                                 "--events-fd", str(w)], cwd=ROOT, env=env, pass_fds=(w,),
                                stdout=log, stderr=subprocess.STDOUT)
        log.close()
        os.close(w)
        events: list = []

        def read(fd=r, events=events):
            with os.fdopen(fd) as f:
                events.extend(json.loads(line) for line in f)

        t = threading.Thread(target=read, daemon=True)
        t.start()
        out.append((proc, events, t))
    return out


def _peaks(job, tmp_path, timeout=150) -> list[int]:
    peaks = []
    try:
        for i, (proc, events, reader) in enumerate(job):
            rc = proc.wait(timeout=timeout)
            reader.join(timeout=10)
            log = (tmp_path / f"task{i}.log").read_text()[-3000:]
            assert rc == 0, f"worker {i} exit {rc}:\n{log}"
            [res] = [e for e in events if e["event"] == "result"]
            peaks.append(res["memory"]["peak"])
    finally:
        for proc, _, _ in job:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    return peaks


@pytest.mark.integration
def test_estimate_matches_measured_peaks(tmp_path):
    cases = {256: make_spec(data={"batch_size": 256}), 2048: make_spec(data={"batch_size": 2048})}
    jobs = {}
    for gb, spec in cases.items():
        (tmp_path / str(gb)).mkdir()
        jobs[gb] = _launch_job(spec, tmp_path / str(gb))
    report = []
    for gb, spec in cases.items():
        peaks = _peaks(jobs[gb], tmp_path / str(gb))
        est = estimate_task_memory(spec, gb // spec["workers"])
        peak = max(peaks)
        err = (est.total - peak) / peak
        report.append(f"global {gb}: peaks {[format_size(p) for p in peaks]}, estimate "
                      f"{format_size(est.total)} ({err:+.1%}), budget "
                      f"{format_size(default_budget(est))}")
        assert abs(err) <= 0.15, report
        assert all(p <= default_budget(est) for p in peaks), report
    print("\n".join(report))


def test_budget_leaves_room_for_the_largest_allocation():
    from strata.memory import LARGEST_ALLOC_ROOM, default_budget
    from strata.units import MiB

    # usually 25% of the estimate covers it
    assert default_budget(400 * MiB, 72 * MiB) == default_budget(400 * MiB) == 500 * MiB
    # one tensor that dominates the task gets room of its own
    assert default_budget(128 * MiB, 32 * MiB) == 128 * MiB + int(LARGEST_ALLOC_ROOM * 32 * MiB)
    # the estimate carries its largest allocation
    spec = make_spec()
    spec["model"]["builtin"].update(input_shape=[1024], hidden=[8192])
    spec["training"]["optimizer"]["name"] = "sgd"
    e = estimate_task_memory(spec, 256)
    assert e.largest_alloc == 4 * profile_model(spec["model"]).trainable_params
    assert default_budget(e.total, e.largest_alloc) > default_budget(e.total)
    # ... and its largest activation tensor, added whole (one more alive under contention)
    assert e.activation_tensor == 4 * 256 * 8192
    extra = default_budget(e) - default_budget(e.total, e.largest_alloc)
    assert e.activation_tensor <= extra <= e.activation_tensor + MiB
