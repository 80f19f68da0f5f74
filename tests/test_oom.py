"""Out-of-memory reports: TensorFlow's text parsed, the failure blamed on the task whose device
ran out, described with what would fit, and the need kept for the next plan."""

from strata.oom import describe, needed_bytes, parse_oom

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


def test_needed_bytes_is_above_the_failed_budget():
    assert needed_bytes(100 * MiB, 90 * MiB, 20 * MiB) == 110 * MiB
    assert needed_bytes(100 * MiB, 0, 8 * MiB) == 104 * MiB
    assert needed_bytes(100 * MiB, 99 * MiB, 0) == 100 * MiB
