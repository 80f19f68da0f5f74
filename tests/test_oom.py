"""Out-of-memory reports: TensorFlow's text parsed, the failure blamed on the task whose device
ran out, described with what would fit, and the need kept for the next plan."""

from strata.oom import describe, needed_bytes, parse_oom
from strata.types import OutOfMemory

MiB = 1 << 20

LOCAL = ("OOM when allocating tensor with shape[36,576,288] and type float on "
         "/job:worker/replica:0/task:1/device:CPU:0 by allocator bfc_cpu_allocator_for_gpu\n"
         "\t [[{{node gradient_tape/sequential/conv2d_1/Conv2D/Conv2DBackpropFilter}}]]")
REMOTE = ("2 root error(s) found. (0) RESOURCE_EXHAUSTED:   OOM when allocating tensor with "
          "shape[1536,1536] and type bfloat16 on /job:worker/replica:0/task:2/device:CPU:0 by "
          "allocator bfc_cpu_allocator_for_gpu [[{{node adam/Sub_10}}]]")


def test_parse_names_the_task_the_tensor_and_the_op():
    o = parse_oom(LOCAL)
    assert o is not None
    assert o.task == "worker:1" and o.shape == (36, 576, 288) and o.dtype == "float32"
    assert o.allocation_bytes == 36 * 576 * 288 * 4
    assert o.op.endswith("Conv2DBackpropFilter")
    r = parse_oom(REMOTE)
    assert r is not None and r.task == "worker:2" and r.dtype == "bfloat16"
    assert r.allocation_bytes == 1536 * 1536 * 2 and r.op == "adam/Sub_10"
    assert "4.5 MiB (bfloat16 [1536, 1536] in adam/Sub_10)" == r.allocation


def test_parse_without_an_allocation_is_none():
    assert parse_oom("ResourceExhaustedError: something else") is None
    assert parse_oom("") is None
    # no device: the reporter is the task that ran out
    o = parse_oom("OOM when allocating tensor with shape[10] and type int64 by allocator x")
    assert o is not None and o.task == "" and o.allocation_bytes == 80


def test_describe_says_task_budget_peak_allocation_and_what_fits():
    o = parse_oom(REMOTE)
    text = describe("worker:2", " (stage 1 of replica 1)", 154 * MiB, 123 * MiB, 144 * MiB, o,
                    ["more stages (stages: 3)"], reporter="chief:0")
    assert text.startswith("task worker:2 (stage 1 of replica 1) ran out of memory: budget "
                           "154 MiB, estimate 123 MiB, peak reached 144 MiB")
    assert "adam/Sub_10" in text and "reported by chief:0" in text
    assert "memory.per_task_budget:" in text and "more stages (stages: 3)" in text
    # the budget it names is above the budget that failed
    fit = int(text.split("memory.per_task_budget: ")[1].split("MiB")[0])
    assert fit * MiB > 154 * MiB
    none_seen = describe("worker:0", "", 22 * MiB, 5 * MiB, 0, None, [])
    assert "ran out before it reported its memory" in none_seen
    # a budget set below the estimate: what fits is at least the estimate's own budget, even
    # when the allocation that failed was smaller
    from strata.memory import default_budget

    low = describe("worker:0", "", 2 * MiB, 272 * MiB, 0, OutOfMemory(allocation_bytes=128 * MiB),
                   [])
    fit = int(low.split("memory.per_task_budget: ")[1].split("MiB")[0])
    assert fit * MiB >= default_budget(272 * MiB), low


def test_needed_bytes_is_above_the_failed_budget():
    assert needed_bytes(100 * MiB, 90 * MiB, 20 * MiB) == 110 * MiB
    assert needed_bytes(100 * MiB, 0, 8 * MiB) == 104 * MiB
    assert needed_bytes(100 * MiB, 99 * MiB, 0) == 100 * MiB


def test_a_crash_at_the_budget_is_classified_out_of_memory():
    import signal

    from strata.types import FailureKind, TaskState
    from strata.worker.taskexit import classify_exit

    def tail():
        return "log tail"

    kw = dict(stopped=False, has_result=False, error_kind="", message="", budget=64 * MiB,
              log_tail=tail)
    state, failure, code, msg = classify_exit(-signal.SIGSEGV, peak=59 * MiB, **kw)
    assert (state, failure) == (TaskState.FAILED, FailureKind.OOM)
    assert "SIGSEGV" in msg and "92% of its 64 MiB budget" in msg
    # far from its budget a crash is a crash
    _, failure, _, msg = classify_exit(-signal.SIGSEGV, peak=20 * MiB, **kw)
    assert failure == FailureKind.SIGNAL and msg == "killed by SIGSEGV"
    # a SIGKILL is someone else's doing, whatever the peak
    _, failure, _, msg = classify_exit(-signal.SIGKILL, peak=63 * MiB, **kw)
    assert failure == FailureKind.SIGNAL and "OOM killer" in msg
    # the task's own report wins; a stop is a stop
    assert classify_exit(75, peak=0, **kw)[1] == FailureKind.OOM
    assert classify_exit(-signal.SIGTERM, peak=63 * MiB, **dict(kw, stopped=True))[0] \
        == TaskState.CANCELLED
    assert classify_exit(1, peak=0, **kw)[3] == "log tail"
    # far from its budget, but its allocator logged that it refused an allocation: a crash
    # where TensorFlow had no error path for it
    state, failure, _, msg = classify_exit(-signal.SIGSEGV, peak=3 * MiB,
                                           refused=lambda: "128.00MiB", **kw)
    assert (state, failure) == (TaskState.FAILED, FailureKind.OOM)
    assert msg.startswith("killed by SIGSEGV after its allocator refused 128.00MiB over its 64 "
                          "MiB budget"), msg
    # a refusal does not make a SIGKILL or an exit status an OOM
    assert classify_exit(-signal.SIGKILL, peak=0, refused=lambda: "1MiB", **kw)[1] \
        == FailureKind.SIGNAL
    assert classify_exit(1, peak=0, refused=lambda: "1MiB", **kw)[1] == FailureKind.EXIT_CODE


def test_the_allocator_refusal_is_read_from_the_log():
    from strata.oom import allocator_refusal

    log = ("[task] started\n"
           "W0000 00:00:1796395545.812247    9320 bfc_allocator.cc:502] Allocator "
           "(bfc_cpu_allocator_for_gpu) ran out of memory trying to allocate 2.0KiB (rounded to "
           "2048)requested by op \n"
           "W0000 00:00:1796395545.812247    9320 bfc_allocator.cc:502] Allocator "
           "(bfc_cpu_allocator_for_gpu) ran out of memory trying to allocate 128.00MiB (rounded to "
           "134217728)requested by op \nIf the cause is memory fragmentation maybe ...\n"
           "Current allocation summary follows.\n")
    assert allocator_refusal(log) == "128.00MiB"  # the last one
    assert allocator_refusal("[task] step 3/20 loss 2.1") == ""
