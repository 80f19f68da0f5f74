"""The task's device, set up right after TensorFlow is imported (the memory budget as the BFC
limit or a logical GPU's ``memory_limit``, threads), and its allocator's figures."""

from __future__ import annotations

import os
import sys

from strata.taskconfig import TaskConfig


def prepare_environment(cfg: TaskConfig) -> None:
    """Environment TensorFlow reads at import: quiet C++ INFO logs; on CPU, a BFC allocator
    limited to the budget when the agent has not set one (it normally does)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    budget = cfg.memory_budget_bytes
    if cfg.agent.device == "CPU" and budget > 0 \
            and "TF_CPU_ALLOCATOR_USE_BFC" not in os.environ:
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
        os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(max(1, budget >> 20))


def configure_device(cfg: TaskConfig):
    """Imports TensorFlow and applies the task's device settings before the runtime starts:
    on ``GPU:N`` a logical device limited to the memory budget, on CPU no GPUs (the BFC limit
    comes from the environment, see ``prepare_environment``); intra-op threads. Returns
    ``(tf, memory)`` where ``memory()`` reads this process's allocator ``{current, peak}``."""
    device = cfg.agent.device
    threads = cfg.agent.threads
    import tensorflow as tf

    if device.startswith("GPU:"):
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            raise RuntimeError(f"device {device} requested but TensorFlow sees no GPU "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        budget_mb = cfg.memory_budget_bytes >> 20
        if budget_mb > 0:
            tf.config.set_logical_device_configuration(
                gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=budget_mb)])
        mem_device = "GPU:0"
    else:
        tf.config.set_visible_devices([], "GPU")
        mem_device = "CPU:0"
    if threads > 0:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(2)

    def memory() -> dict:
        try:
            info = tf.config.experimental.get_memory_info(mem_device)
            return {"current": int(info.get("current", 0)), "peak": int(info.get("peak", 0))}
        except (ValueError, RuntimeError, tf.errors.OpError):
            return {"current": 0, "peak": 0}

    return tf, memory


def allocator_figures() -> dict[str, int]:
    """``{current, peak}`` of this process's device allocator (GPU:0 when a GPU is visible,
    else CPU:0), without touching a device that is not initialised; zeros when unreadable."""
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return {"current": 0, "peak": 0}
    try:
        device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
        info = tf.config.experimental.get_memory_info(device)
        return {"current": int(info.get("current", 0)), "peak": int(info.get("peak", 0))}
    except Exception:  # noqa: BLE001 - a report must never fail the failure path
        return {"current": 0, "peak": 0}
