"""Out-of-memory failures: what TensorFlow said, and what Strata tells the user.

Pure Python (the task parses, the coordinator describes; neither needs TensorFlow here).

A task's allocator refuses an allocation over its budget with a ``ResourceExhaustedError``
whose text names the tensor and the device, e.g.::

    OOM when allocating tensor with shape[1536,1536] and type float on
    /job:worker/replica:0/task:1/device:CPU:0 by allocator bfc_cpu_allocator_for_gpu
    ... [[{{node adam/Sub_10}}]]

``parse_oom`` turns that into an ``OutOfMemory``. The device matters: in a pipeline or a
parameter-server job the driving process runs ops on other tasks' devices, so the process
that raises the error (the chief) is often not the task that ran out. The coordinator blames
the task named by the device (``OutOfMemory.task``), reports its budget and the peak it
reached, and ``describe`` says what would fit.
"""

from __future__ import annotations

import math
import re

from strata.memory import default_budget
from strata.types import OutOfMemory
from strata.units import MiB, format_size

__all__ = ["parse_oom", "describe", "needed_bytes", "allocator_refusal"]

_ALLOC = re.compile(r"OOM when allocating tensor with shape\s*\[([0-9, ]*)\]\s*and type (\w+)"
                    r"(?: on (\S+))?")
_DEVICE_TASK = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")
_NODE = re.compile(r"\{\{node ([^}]+)\}\}")

#: bytes per element of TensorFlow's type names as its OOM messages spell them
_DTYPE_BYTES = {
    "float": 4, "double": 8, "half": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "int16": 2,
    "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "bool": 1,
    "complex64": 8, "complex128": 16,
}
_DTYPE_NAMES = {"float": "float32", "double": "float64", "half": "float16"}


def parse_oom(text: str) -> OutOfMemory | None:
    """The failed allocation in TensorFlow's error text, or None when it names none."""
    m = _ALLOC.search(text or "")
    if m is None:
        return None
    try:
        shape = tuple(int(d) for d in m.group(1).replace(" ", "").split(",") if d)
    except ValueError:
        shape = ()
    tf_type = m.group(2)
    per = _DTYPE_BYTES.get(tf_type, 4)
    n = math.prod(shape) if shape else 0
    task = ""
    if m.group(3):
        d = _DEVICE_TASK.search(m.group(3))
        if d is not None:
            task = f"{d.group(1)}:{int(d.group(2))}"
    node = _NODE.search(text)
    return OutOfMemory(task=task, allocation_bytes=n * per, shape=shape,
                       dtype=_DTYPE_NAMES.get(tf_type, tf_type),
                       op=node.group(1) if node else "")


#: what TensorFlow's BFC allocator logs when it refuses an allocation, before any error (or,
#: where the caller does not check, the crash that follows), e.g. ``Allocator
#: (bfc_cpu_allocator_for_gpu) ran out of memory trying to allocate 128.00MiB (rounded to
#: 134217728)requested by op``
_REFUSED = re.compile(r"ran out of memory trying to allocate ([0-9.]+\s*[KMGT]?i?B)"
                      r"(?: \(rounded to (\d+)\))?")


def allocator_refusal(log_text: str) -> str:
    """The size of the last allocation TensorFlow's allocator logged it refused in a task's
    log (``128.00MiB``), or empty."""
    found = _REFUSED.findall(log_text or "")
    return found[-1][0] if found else ""


def needed_bytes(budget: int, peak: int, allocation_bytes: int) -> int:
    """A lower bound on what the task needs: it had reached ``peak`` (at most its budget) and
    asked for ``allocation_bytes`` more that did not fit. The BFC allocator must also find the
    allocation a contiguous chunk, so the bound is taken from the budget, not the peak, when the
    peak is unknown or the sum is under the budget."""
    return max(budget, peak + allocation_bytes, budget + allocation_bytes // 2)


def describe(task_name: str, where: str, budget: int, estimate: int, peak: int,
             oom: OutOfMemory | None, levers: list[str], reporter: str = "") -> str:
    """The job's account of an out-of-memory failure: which task, its budget and estimate,
    the peak it reached (or that it never reported one), the allocation that failed, and what
    would fit."""
    alloc = oom.allocation_bytes if oom else 0
    seen = (f"peak reached {format_size(peak)}" if peak
            else "it ran out before it reported its memory (no peak seen)")
    parts = [f"task {task_name}{where} ran out of memory: budget {format_size(budget)}, "
             f"estimate {format_size(estimate)}, {seen}"]
    if oom is not None and oom.allocation:
        parts.append(f"the allocation that failed: {oom.allocation}")
    if reporter and reporter != task_name:
        parts.append(f"reported by {reporter}, which ran the op on that task")
    need = needed_bytes(budget, peak, alloc)
    fit = default_budget(need)
    if budget < estimate:
        # a budget the user set below the estimate: the estimate's own budget is the first to
        # try (what ran out only bounds the need from below)
        fit = max(fit, default_budget(estimate))
    fit = max(fit, budget + MiB)
    options = [f"a budget of at least {format_size(fit)} (memory.per_task_budget: "
               f"{-(-fit // MiB)}MiB; a rerun of this job plans with the figure measured now)"]
    options += levers
    parts.append("what would fit: " + "; or ".join(options))
    return "; ".join(parts)
