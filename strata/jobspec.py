"""The job spec's types: ``JobSpec`` and its sections, frozen and fully defaulted, with the
constants their fields are checked against. ``strata.spec.parse_job_spec`` makes one from what a
user wrote (checking it against its strategy's rules); ``JobSpec.to_dict`` is the normalized
mapping (what the store keeps, what the memory estimator reads) and ``JobSpec.from_dict`` reads
it back without checking again. Ground floor of the library: every layer above names these
types."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping

from strata.units import parse_size

FEATURE_DTYPES = ("float32", "int64", "string")
OPTIMIZERS = ("adam", "adamw", "sgd", "rmsprop", "adagrad")
LOSSES = ("sparse_categorical_crossentropy", "categorical_crossentropy", "mean_squared_error")
MIXED_PRECISION = ("none", "bfloat16", "float16")
#: the all-reduce's wire format (``gradients.compression``)
GRADIENT_COMPRESSION = ("none", "bfloat16", "float16")
NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")
MAX_TASKS = 4096
#: the all-reduce pack size when ``gradients.pack_size`` is unset: every gradient in one pack
#: (TensorFlow's own default). Measured (bench/allreduce_packs.py, docs/benchmarks.md): on CPU
#: loopback smaller packs cost more collectives than their overlap saves.
DEFAULT_PACK_BYTES = 0
# The text of keras.Model.to_json() for a model of a few thousand layers is well under this;
# larger texts only cost the coordinator time and messages room.
MAX_KERAS_JSON_BYTES = 4 << 20

# Shape of the digits data set (scikit-learn): 8x8 images flattened, 10 classes.
DIGITS_FEATURES = 64
DIGITS_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class DataSpec:
    source: str = "digits"
    path: str = ""
    batch_size: int = 256
    examples: int = 0
    #: the streamed sources (``STREAMED_SOURCES``): where the test split is (a glob, a file, a
    #: directory), else ``test_fraction`` of the records is held out
    test_path: str = ""
    #: tfrecord: feature name -> {"shape": [...], "dtype": ...}; the model's inputs by name
    features: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: tfrecord: the label feature; csv: the label column
    label: str = ""
    #: images: [height, width] every image is resized to
    image_size: tuple[int, ...] = ()
    test_fraction: float = 0.2


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    name: str = "adam"
    learning_rate: float = 0.001


#: what trains a job that names no optimizer or loss, and whose model brings none (a
#: ``code.model`` compiled with its own is trained with those: ``worker.runner``)
DEFAULT_OPTIMIZER = OptimizerSpec()
DEFAULT_LOSS = "sparse_categorical_crossentropy"


@dataclasses.dataclass(frozen=True)
class TrainingSpec:
    epochs: int = 0
    steps: int = 0
    #: None, "": not given in the job (``optimizer_used``, ``loss_used``: what stands in)
    optimizer: OptimizerSpec | None = None
    loss: str = ""
    seed: int = 0
    #: seconds the job may train (from its first step); past it, it fails. The scheduler plans
    #: backfill with it (0: no limit)
    time_limit_s: float = 0.0

    @property
    def optimizer_used(self) -> OptimizerSpec:
        """The optimizer the job names, else the default (a compiled ``code.model``'s own
        optimizer is known only in the task)."""
        return self.optimizer if self.optimizer is not None else DEFAULT_OPTIMIZER

    @property
    def loss_used(self) -> str:
        return self.loss or DEFAULT_LOSS


@dataclasses.dataclass(frozen=True)
class MemorySpec:
    per_task_budget: str = ""
    mixed_precision: str = "none"
    recompute: bool = False
    #: measure before admission: a short probe run of the same plan, whose allocator peaks set
    #: the job's estimates and budgets (``coordinator.core``; skipped once a run has measured
    #: it). ``auto``: for jobs whose largest task estimate is large enough to be worth it
    profile: str = "auto"

    @property
    def per_task_budget_bytes(self) -> int:
        return parse_size(self.per_task_budget) if self.per_task_budget else 0


@dataclasses.dataclass(frozen=True)
class GradientSpec:
    """How data-parallel replicas exchange gradients (``strata.worker.exchange``)."""

    #: each replica's share of the batch runs as this many slices in turn, their gradients
    #: summed locally, then one exchange and one update: the same step as unsliced (up to
    #: float rounding) for 1/N of the activations and 1/N of the exchanges per example
    accumulate: int = 1
    #: the all-reduce carries gradients as 16 bits (half the bytes; rounding measured in
    #: docs/benchmarks.md); every replica receives the same sum, so replicas stay identical
    compression: str = "none"
    #: bytes per all-reduce pack ("4MiB"; "0": every gradient in one pack); empty: the default
    pack_size: str = ""

    @property
    def pack_bytes(self) -> int:
        """The pack size in bytes; ``DEFAULT_PACK_BYTES`` when unset."""
        return parse_size(self.pack_size) if self.pack_size else DEFAULT_PACK_BYTES


@dataclasses.dataclass(frozen=True)
class JobSpec:
    name: str
    strategy: str
    workers: int
    parameter_servers: int
    stages: int
    microbatches: int
    model: Mapping[str, Any]  # {"keras_json": str} or {"builtin": {...}}
    data: DataSpec
    training: TrainingSpec
    memory: MemorySpec
    checkpoint_every_steps: int = 0
    max_restarts: int = 0
    #: checkpoints kept (the newest), with ``checkpoint_every_steps``
    checkpoint_keep: int = 3
    #: seconds between a failure and the restart's placement (``restart.backoff_s``)
    restart_backoff_s: float = 5.0
    #: restart also after the job's own code raised (``restart.retry_user_errors``)
    retry_user_errors: bool = False
    #: users' own code: {"dir_name", "sha256", "size", "model", "dataset"} (empty: none)
    code: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    gradients: GradientSpec = GradientSpec()
    #: an elastic job's range of widths (``workers: {min, max}``): ``workers`` is the width it
    #: is planned at now, which resizes move within the range; both 0: a fixed width
    workers_min: int = 0
    workers_max: int = 0
    #: its queue (``strata.queues``; resolved at submission: the owner's when not given), its
    #: priority class, and whether a job of higher priority may preempt it
    queue: str = ""
    priority: str = ""
    preemptible: bool = True

    @property
    def elastic(self) -> bool:
        """Whether the job may run narrower or wider than planned (``workers: {min, max}``)."""
        return self.workers_max > 0

    @property
    def code_model(self) -> str:
        """``module:function`` building the model, when the job's own code builds it."""
        return str(self.code.get("model") or "") if self.code else ""

    @property
    def code_dataset(self) -> str:
        return str(self.code.get("dataset") or "") if self.code else ""

    def to_dict(self) -> dict[str, Any]:
        """The normalized mapping: every field present (``code`` only when the job has code),
        the shape of the YAML file."""
        out = self._to_dict()
        if self.code:
            out["code"] = json.loads(json.dumps(self.code))
        if self.elastic:
            out["elastic"] = {"min": self.workers_min, "max": self.workers_max}
        for key, value in (("queue", self.queue), ("priority", self.priority)):
            if value:
                out[key] = value
        if not self.preemptible:
            out["preemptible"] = False
        return out

    def _to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "strategy": self.strategy,
            "workers": self.workers,
            "parameter_servers": self.parameter_servers,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "model": json.loads(json.dumps(self.model)),
            "data": {**dataclasses.asdict(self.data), "image_size": list(self.data.image_size),
                     "features": json.loads(json.dumps(self.data.features))},
            # an optimizer or loss not given stays out: the task then knows it was not
            "training": {("time_limit" if k == "time_limit_s" else k): v
                         for k, v in dataclasses.asdict(self.training).items()
                         if not (k in ("optimizer", "loss", "time_limit_s") and not v)},
            "memory": dataclasses.asdict(self.memory),
            "gradients": dataclasses.asdict(self.gradients),
            "checkpoint": {"every_steps": self.checkpoint_every_steps,
                           "keep": self.checkpoint_keep},
            "restart": {"max_restarts": self.max_restarts, "backoff_s": self.restart_backoff_s,
                        "retry_user_errors": self.retry_user_errors},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "JobSpec":
        """An accepted spec from its normalized mapping (``to_dict``: the store's copy, perhaps
        written before a field existed): rebuilt without validating again, so a rule added
        later, or a strategy this side does not know, never makes an accepted job unreadable.
        A missing field takes its zero value, a missing field of a section the section's
        default. A message converts field by field instead (``strata.convert``)."""
        def sub(name: str) -> Mapping[str, Any]:
            v = d.get(name)
            return v if isinstance(v, Mapping) else {}

        def fill(kind: Any, m: Mapping[str, Any]) -> Any:
            names = {f.name for f in dataclasses.fields(kind)}
            return kind(**{k: v for k, v in m.items() if k in names})

        t = sub("training")
        return cls(
            name=str(d.get("name", "")), strategy=str(d.get("strategy", "")),
            workers=int(d.get("workers", 0)), parameter_servers=int(d.get("parameter_servers", 0)),
            stages=int(d.get("stages", 0)), microbatches=int(d.get("microbatches", 0)),
            model=json.loads(json.dumps(dict(sub("model")))),
            data=fill(DataSpec, {**sub("data"), "image_size": tuple(
                int(v) for v in sub("data").get("image_size") or ())}),
            training=TrainingSpec(
                epochs=int(t.get("epochs", 0)), steps=int(t.get("steps", 0)),
                optimizer=fill(OptimizerSpec, t["optimizer"]) if t.get("optimizer") else None,
                loss=str(t.get("loss") or ""), seed=int(t.get("seed", 0)),
                time_limit_s=float(t.get("time_limit", 0.0))),
            memory=fill(MemorySpec, sub("memory")),
            gradients=fill(GradientSpec, sub("gradients")),
            checkpoint_every_steps=int(sub("checkpoint").get("every_steps", 0)),
            max_restarts=int(sub("restart").get("max_restarts", 0)),
            checkpoint_keep=int(sub("checkpoint").get("keep", cls.checkpoint_keep)),
            restart_backoff_s=float(sub("restart").get("backoff_s", cls.restart_backoff_s)),
            retry_user_errors=bool(sub("restart").get("retry_user_errors", False)),
            code=json.loads(json.dumps(dict(sub("code")))),
            workers_min=int(sub("elastic").get("min", 0)),
            workers_max=int(sub("elastic").get("max", 0)),
            queue=str(d.get("queue") or ""), priority=str(d.get("priority") or ""),
            preemptible=bool(d.get("preemptible", True)))

    @property
    def per_replica_batch(self) -> int:
        return self.data.batch_size // max(1, self.workers)
