"""Which CPU kernels a host's TensorFlow runs: oneDNN's or Eigen's.

Pure Python: the agent tells the coordinator (``RegisterAgentRequest.cpu_kernels``) and the
memory estimators take it (``strata.memory``, ``strata.stagememory``), because the two families
hold very different memory for the same model: measured on one host (TF 2.21, CPU, BFC), a
conv 32-64 model's training step peaked at 34 MiB with oneDNN and 68 MiB with Eigen, whose
convolution gradients unfold patches into a buffer of up to 30 MiB (``memory.CONV_WORKING_SET``);
a 16x16 residual block at 6 MiB against 69 MiB.

TensorFlow's own rule (``IsMKLEnabled``; TF 2.9 and later, Linux x86-64 packages):
``TF_ENABLE_ONEDNN_OPTS`` decides when set (``1``/``true`` on, ``0``/``false`` off); unset, oneDNN
is on when the CPU has one of AVX512_VNNI, AVX512_BF16, AVX_VNNI or AMX. ``detect`` follows it
from the environment and ``/proc/cpuinfo`` without importing TensorFlow (an import costs seconds
of CPU per agent start); checked against ``_pywrap_util_port.IsMklEnabled()`` on this project's
host. Anything it cannot read is ``eigen`` (TensorFlow's own default where the features are
missing). ``strata worker --cpu-kernels`` overrides it.
"""

from __future__ import annotations

import os
import platform
from typing import Iterable, Mapping

__all__ = ["ONEDNN", "EIGEN", "ANY", "KINDS", "detect", "family", "parse"]

ONEDNN = "onednn"
EIGEN = "eigen"
#: not known, or workers of both families: estimated at the larger of the two, rate by rate
ANY = ""
KINDS = (ONEDNN, EIGEN)

#: CPU flags (as /proc/cpuinfo spells them) that turn oneDNN on by default
ONEDNN_FLAGS = frozenset({"avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16",
                          "amx_int8"})
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def parse(value: str, flag: str = "--cpu-kernels") -> str:
    """``auto`` (returned as ``""``), ``onednn`` or ``eigen``; anything else is refused naming
    ``flag``."""
    v = str(value or "auto").strip().lower()
    if v == "auto":
        return ""
    if v not in KINDS:
        raise ValueError(f"{flag} must be auto, onednn or eigen, got {value!r}")
    return v


def detect(environ: Mapping[str, str] | None = None, cpuinfo: str | None = None,
           machine: str | None = None, system: str | None = None) -> str:
    """The kernel family TensorFlow will use in a process started with ``environ`` on this
    host (the arguments default to this process's; tests pass their own)."""
    env = os.environ if environ is None else environ
    opt = str(env.get("TF_ENABLE_ONEDNN_OPTS", "")).strip().lower()
    if opt in _OFF:
        return EIGEN
    machine = (machine if machine is not None else platform.machine()).lower()
    system = system if system is not None else platform.system()
    if system != "Linux" or machine not in ("x86_64", "amd64"):
        return EIGEN
    if opt in _ON:
        return ONEDNN
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read(1 << 20)
        except OSError:
            return EIGEN
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return ONEDNN if ONEDNN_FLAGS & set(line.split(":", 1)[-1].split()) else EIGEN
    return EIGEN


def family(kinds: Iterable[str]) -> str:
    """The family to estimate a job with, given its candidate workers' families: theirs when
    they all run one (a task may be placed on any of them), else ``ANY``."""
    seen = set(kinds)
    return seen.pop() if len(seen) == 1 and seen <= set(KINDS) else ANY
