"""The job spec: one validation path for YAML files, JSON, ``--set`` overrides and gRPC requests.

``parse_job_spec`` takes the fields as given: the mapping a user wrote, or a ``JobSpec`` message's
set fields (read in place by ``strata.convert.spec_from_proto``); it returns a frozen, fully
defaulted ``strata.jobspec.JobSpec``, or raises :class:`SpecError` naming the dotted field to fix.
Above the strategies: each checks its own fields.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
from typing import Any, Mapping

from strata import safeyaml, strategies
from strata.errors import SpecError
from strata.jobspec import (
    DEFAULT_LOSS, DEFAULT_OPTIMIZER, DIGITS_CLASSES, DIGITS_FEATURES, FEATURE_DTYPES,
    GRADIENT_COMPRESSION, LOSSES, MAX_KERAS_JSON_BYTES, MAX_TASKS, MIXED_PRECISION, NAME_RE,
    OPTIMIZERS, DataSpec, GradientSpec, JobSpec, MemorySpec, OptimizerSpec, TrainingSpec,
)
from strata.modelspec import ModelSpecError, profile_model
from strata.types import DATA_SOURCES, STREAMED_SOURCES
from strata.units import parse_duration, parse_size
from strata.uploads import SHA256_RE

_TOP_KEYS = {
    "name", "strategy", "workers", "parameter_servers", "stages", "microbatches", "model", "data",
    "training", "memory", "checkpoint", "restart", "code", "gradients", "elastic", "queue",
    "priority", "preemptible",
}


def _section(d: Mapping[str, Any], key: str, allowed: set[str], prefix: str = "") -> Mapping[str, Any]:
    field = prefix + key
    value = d.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(field, f"must be a mapping, got {type(value).__name__}")
    for k in value:
        if k not in allowed:
            raise SpecError(f"{field}.{k}", f"unknown field (known: {', '.join(sorted(allowed))})")
    return value


def _int(d: Mapping[str, Any], key: str, field: str, default: int, lo: int = 0, hi: int | None = None) -> int:
    value = d.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SpecError(field, f"must be an integer, got {value!r}")
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise SpecError(field, f"must be an integer, got {value!r}") from None
    if value < lo:
        raise SpecError(field, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise SpecError(field, f"must be <= {hi}, got {value}")
    return value


def _float(d: Mapping[str, Any], key: str, field: str, default: float) -> float:
    value = d.get(key)
    if value is None:
        return default
    if isinstance(value, bool):
        raise SpecError(field, f"must be a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        raise SpecError(field, f"must be a number, got {str(value)[:64]!r}") from None
    if not out > 0 or out != out or out == float("inf"):
        raise SpecError(field, f"must be a positive finite number, got {value!r}")
    return out


def _choice(d: Mapping[str, Any], key: str, field: str, default: str, choices: tuple[str, ...]) -> str:
    value = d.get(key)
    if value is None or value == "":
        return default
    if not isinstance(value, str) or value not in choices:
        raise SpecError(field, f"must be one of {', '.join(choices)}; got {value!r}")
    return value


def _bool(d: Mapping[str, Any], key: str, field: str, default: bool) -> bool:
    value = d.get(key)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    raise SpecError(field, f"must be true or false, got {value!r}")


PROFILE_CHOICES = ("auto", "true", "false")


def _profile(value: Any) -> str:
    if value is None or value == "":
        return "auto"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and value.lower() in ("auto", "true", "false", "yes", "no"):
        return {"yes": "true", "no": "false"}.get(value.lower(), value.lower())
    raise SpecError("memory.profile", f"must be auto, true or false; got {value!r}")


#: every string field but model.keras_json (the same limit as the protocol's, coordinator.bounds)
MAX_STRING_CHARS = 4096


def _not_text(field: str, value: Any) -> SpecError:
    """A text field given as something else. YAML reads ``123``, ``yes`` and (from a Python
    caller) dates as such, so the message says what it read and to quote it."""
    kinds = ((bool, "boolean"), (int, "number"), (float, "number"),
             (datetime.date, "date"))  # bool before int: it is one
    kind = next((k for t, k in kinds if isinstance(value, t)), "")
    if not kind:
        return SpecError(field, f"must be text, got {type(value).__name__}")
    shown = (str(value).lower() if isinstance(value, bool) else str(value))[:64]
    return SpecError(field, f"must be text, got the {kind} {shown}: quote it in YAML, e.g. "
                            f"{field.rsplit('.', 1)[-1]}: \"{shown}\"")


def _str(d: Mapping[str, Any], key: str, field: str, default: str = "") -> str:
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise _not_text(field, value)
    if len(value) > MAX_STRING_CHARS:
        raise SpecError(field, f"at most {MAX_STRING_CHARS} characters, got {len(value)}")
    if "\0" in value:
        raise SpecError(field, "contains a NUL character")
    return value


def parse_job_spec(raw: Any) -> JobSpec:
    """Validates a job spec mapping and fills in defaults. The strategy (found in the registry,
    ``strata.strategies``) checks its own fields.

    Raises:
        SpecError: naming the first invalid field, e.g. ``data.batch_size``.
    """
    if not isinstance(raw, Mapping):
        raise SpecError("spec", f"must be a mapping of fields, got {type(raw).__name__}")
    for k in raw:
        if k not in _TOP_KEYS:
            raise SpecError(str(k), f"unknown field (known: {', '.join(sorted(_TOP_KEYS))})")

    name = _name(raw)
    strategy_name = raw.get("strategy")
    strategy = strategies.get(strategies.DEFAULT if strategy_name in (None, "") else strategy_name)
    workers, lo, hi = _workers(raw, strategy)
    defaults = strategy.defaults()
    parameter_servers = _int(raw, "parameter_servers", "parameter_servers",
                             defaults.get("parameter_servers", 0), hi=MAX_TASKS)
    stages = _int(raw, "stages", "stages", defaults.get("stages", 0), hi=MAX_TASKS)
    microbatches = _int(raw, "microbatches", "microbatches", 1, lo=1, hi=4096)

    code = _code(raw.get("code"))
    model_out = _model(raw, code)
    data = _data(raw, workers)
    training = _training(raw)
    memory = _memory(raw)
    if hi:
        workers = _elastic_width(raw, lo, hi, data.batch_size, microbatches)
    gradients = _gradients(raw, workers, data.batch_size)

    c = _section(raw, "checkpoint", {"every_steps", "keep"})
    r = _section(raw, "restart", {"max_restarts", "backoff_s", "retry_user_errors"})
    # 0 is a valid backoff (restart at once); _float takes positive numbers only
    zero = r.get("backoff_s") == 0 and not isinstance(r.get("backoff_s"), bool)
    backoff = 0.0 if zero else _float(r, "backoff_s", "restart.backoff_s",
                                      JobSpec.restart_backoff_s)
    if not 0 <= backoff <= 3600:
        raise SpecError("restart.backoff_s", f"must be between 0 and 3600 seconds, got {backoff:g}")
    spec = JobSpec(
        name=name,
        strategy=strategy.name,
        workers=workers,
        parameter_servers=parameter_servers,
        stages=stages,
        microbatches=microbatches,
        model=model_out,
        data=data,
        training=training,
        memory=memory,
        checkpoint_every_steps=_int(c, "every_steps", "checkpoint.every_steps", 0, hi=1 << 40),
        max_restarts=_int(r, "max_restarts", "restart.max_restarts", 0, hi=1000),
        checkpoint_keep=_int(c, "keep", "checkpoint.keep", JobSpec.checkpoint_keep, lo=1, hi=1000),
        restart_backoff_s=backoff,
        retry_user_errors=_bool(r, "retry_user_errors", "restart.retry_user_errors", False),
        code=code,
        gradients=gradients,
        workers_min=lo,
        workers_max=hi,
        queue=_label(raw, "queue"),
        priority=_label(raw, "priority"),
        preemptible=_bool(raw, "preemptible", "preemptible", True),
    )
    _check_strategy_fields(spec, strategy)
    strategy.validate(spec)
    _check_code(spec, strategy)
    if not spec.code_model:
        _check_model(spec)
    return spec


def _workers(raw: Mapping[str, Any], strategy: strategies.Strategy) -> tuple[int, int, int]:
    """``workers``: a fixed width (an integer), or an elastic range ``{min, max}``; the
    normalized form (``JobSpec.to_dict``, a message) gives the range as ``elastic: {min, max}``
    beside the width planned now. Returns (width, min, max), the range (0, 0) when fixed."""
    given = raw.get("workers")
    rng = raw.get("elastic")
    if isinstance(given, Mapping):
        if rng is not None:
            raise SpecError("elastic", "give the range once: workers: {min, max}")
        given, field = None, "workers"
    elif rng is None:
        return _int(raw, "workers", "workers", 1, lo=1, hi=MAX_TASKS), 0, 0
    else:
        field = "elastic"
    r = _section(raw, field, {"min", "max"})
    if "min" not in r or "max" not in r:
        raise SpecError(field, "an elastic range needs both min and max, e.g. {min: 2, max: 4}")
    lo = _int(r, "min", f"{field}.min", 1, lo=1, hi=MAX_TASKS)
    hi = _int(r, "max", f"{field}.max", 1, lo=1, hi=MAX_TASKS)
    if lo > hi:
        raise SpecError(f"{field}.max", f"must be >= min ({lo}), got {hi}")
    if not strategy.elastic:
        raise SpecError(field, f"strategy {strategy.name} runs at a fixed width (elastic: "
                               f"{', '.join(strategies.elastic_names())})")
    if given is not None:
        width = _int(raw, "workers", "workers", lo, lo=1, hi=MAX_TASKS)
        if not lo <= width <= hi:
            raise SpecError("workers", f"{width} is outside the elastic range {lo}-{hi}")
    return lo, lo, hi


def _elastic_width(raw: Mapping[str, Any], lo: int, hi: int, batch_size: int,
                   microbatches: int) -> int:
    """The width an elastic job is planned at first: the widest in its range whose replicas
    share the global batch evenly (each resize keeps the global batch), or the width the
    normalized form names. The narrowest must share it: a job may have to run at ``min``."""
    g = raw.get("gradients")
    accumulate = _int(g if isinstance(g, Mapping) else {}, "accumulate", "gradients.accumulate",
                      1, lo=1, hi=1024)
    share = accumulate * microbatches
    field = "workers.min" if isinstance(raw.get("workers"), Mapping) else "elastic.min"
    if batch_size % (lo * share):
        raise SpecError(field, f"the global batch {batch_size} must divide evenly among the "
                               f"{lo} workers an elastic job may run at"
                               + (f", {share} slices each" if share > 1 else ""))
    if raw.get("workers") is not None and not isinstance(raw.get("workers"), Mapping):
        return _int(raw, "workers", "workers", lo, lo=lo, hi=hi)
    return max(k for k in range(lo, hi + 1) if batch_size % (k * share) == 0)


def _label(raw: Mapping[str, Any], key: str) -> str:
    """``queue`` or ``priority``: a name from the coordinator's queues file (checked there)."""
    value = raw.get(key)
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or len(value) > 64 or not all(
            c.isalnum() or c in "-_." for c in value):
        raise SpecError(key, f"must be a name of 1-64 letters, digits, - _ . (from the "
                             f"coordinator's queues file), got {str(value)[:64]!r}")
    return value


def _name(raw: Mapping[str, Any]) -> str:
    name = raw.get("name")
    if name is not None and not isinstance(name, str):
        raise _not_text("name", name)  # e.g. `name: 2024` or `name: no`: never "required"
    if not name:
        raise SpecError("name", "is required: a lowercase name like 'digits-mlp'")
    if not NAME_RE.match(name):
        raise SpecError("name", f"{name[:64]!r} must be 1-40 characters of a-z, 0-9 and '-', "
                                "starting and ending with a letter or digit")
    return name


def _model(raw: Mapping[str, Any], code: dict[str, Any]) -> dict[str, Any]:
    """``model``: exactly one of keras_json, keras_file, builtin, or none with code.model."""
    model = _section(raw, "model", {"keras_json", "builtin", "keras_file"})
    given = [k for k in ("keras_json", "keras_file", "builtin") if k in model]
    if code.get("model"):
        if given:
            raise SpecError("model", f"code.model builds the model; drop model.{given[0]} "
                                     "(or code.model)")
        given = ["code"]
    if len(given) != 1:
        raise SpecError("model", "give exactly one of model.keras_json, model.keras_file or "
                                 f"model.builtin (got {', '.join(given) or 'none'})")
    model_out: dict[str, Any]
    if given == ["code"]:
        model_out = {}
    elif "keras_file" in model:
        model_out = {"keras_file": _keras_file(model["keras_file"])}
    elif "keras_json" in model:
        text = model["keras_json"]
        if not isinstance(text, str) or not text.strip():
            raise SpecError("model.keras_json", "must be the text of keras.Model.to_json()")
        if len(text) > MAX_KERAS_JSON_BYTES:
            raise SpecError("model.keras_json", f"is {len(text):,} characters; the limit is "
                                                f"{MAX_KERAS_JSON_BYTES:,}")
        model_out = {"keras_json": text}
    else:
        b = _section(model, "builtin", {"kind", "input_shape", "hidden", "classes"}, "model.")
        kind = _choice(b, "kind", "model.builtin.kind", "mlp", ("mlp",))
        model_out = {"builtin": {
            "kind": kind,
            "input_shape": _int_list(b, "input_shape", "model.builtin.input_shape", [DIGITS_FEATURES]),
            "hidden": _int_list(b, "hidden", "model.builtin.hidden", [1024, 512, 256], allow_empty=True),
            "classes": _int(b, "classes", "model.builtin.classes", DIGITS_CLASSES, lo=1, hi=1_000_000),
        }}
    return model_out


def _data(raw: Mapping[str, Any], workers: int) -> DataSpec:
    d = _section(raw, "data", {"source", "path", "batch_size", "examples", "test_path",
                               "features", "label", "image_size", "test_fraction"})
    source = _choice(d, "source", "data.source", "digits", DATA_SOURCES)
    data = DataSpec(
        source=source,
        path=_str(d, "path", "data.path"),
        batch_size=_int(d, "batch_size", "data.batch_size", 256, lo=1, hi=1 << 24),
        examples=_int(d, "examples", "data.examples", 0, hi=1 << 26),
        test_path=_str(d, "test_path", "data.test_path"),
        features=_features(d.get("features")),
        label=_str(d, "label", "data.label"),
        image_size=tuple(_int_list(d, "image_size", "data.image_size", [], allow_empty=True)),
        test_fraction=_fraction(d.get("test_fraction", 0.2)),
    )
    _check_data(data)
    if data.source != "synthetic" and data.examples:
        raise SpecError("data.examples", "applies to data.source synthetic only")
    if data.batch_size % workers:
        raise SpecError("data.batch_size", f"the global batch {data.batch_size} must divide evenly "
                                           f"among {workers} workers")
    return data


def _training(raw: Mapping[str, Any]) -> TrainingSpec:
    t = _section(raw, "training", {"epochs", "steps", "optimizer", "loss", "seed", "time_limit"})
    o = _section(t, "optimizer", {"name", "learning_rate"}, "training.")
    epochs = _int(t, "epochs", "training.epochs", 0, hi=1_000_000)
    steps = _int(t, "steps", "training.steps", 0, hi=1 << 40)
    if epochs and steps:
        raise SpecError("training.steps", "give training.epochs or training.steps, not both")
    if not epochs and not steps:
        epochs = 1
    training = TrainingSpec(
        epochs=epochs,
        steps=steps,
        # not given: the model's own compile (a code.model's), else the defaults
        optimizer=OptimizerSpec(
            name=_choice(o, "name", "training.optimizer.name", DEFAULT_OPTIMIZER.name,
                         OPTIMIZERS),
            learning_rate=_float(o, "learning_rate", "training.optimizer.learning_rate",
                                 DEFAULT_OPTIMIZER.learning_rate),
        ) if t.get("optimizer") else None,
        loss=_choice(t, "loss", "training.loss", DEFAULT_LOSS, LOSSES) if t.get("loss") else "",
        seed=_int(t, "seed", "training.seed", 0, hi=(1 << 31) - 1),
        time_limit_s=_time_limit(t.get("time_limit")),
    )
    return training


def _time_limit(value: Any) -> float:
    """``training.time_limit``: ``2h``, ``90m``, seconds; absent or 0: none."""
    if value is None or value == 0 or value == "":
        return 0.0
    if isinstance(value, bool):
        raise SpecError("training.time_limit", f"must be a duration such as 2h, got {value!r}")
    try:
        seconds = parse_duration(str(value))
    except ValueError as e:
        raise SpecError("training.time_limit", str(e)) from None
    if seconds > 366 * 86400:
        raise SpecError("training.time_limit", "must be at most a year")
    return seconds


def _memory(raw: Mapping[str, Any]) -> MemorySpec:
    m = _section(raw, "memory", {"per_task_budget", "mixed_precision", "recompute", "profile"})
    budget = m.get("per_task_budget")
    if isinstance(budget, int) and not isinstance(budget, bool):
        budget = str(budget)
    budget = budget if budget is not None else ""
    if not isinstance(budget, str):
        raise SpecError("memory.per_task_budget", f"must be a size like 1GiB, got {budget!r}")
    if budget:
        try:
            if parse_size(budget) <= 0:
                raise ValueError("must be positive")
        except ValueError as e:
            raise SpecError("memory.per_task_budget", str(e)) from None
    memory = MemorySpec(
        per_task_budget=budget,
        mixed_precision=_choice(m, "mixed_precision", "memory.mixed_precision", "none", MIXED_PRECISION),
        recompute=_bool(m, "recompute", "memory.recompute", False),
        profile=_profile(m.get("profile")),
    )
    return memory


def _check_code(spec: JobSpec, strategy: strategies.Strategy) -> None:
    """A job's own code: only for strategies that run it; code.dataset needs the steps."""
    code, training = spec.code, spec.training
    if code:
        which = "code.model" if code.get("model") else "code.dataset" \
            if code.get("dataset") else "code"
        if not strategy.runs_user_code:
            able = [s.name for s in strategies.all_strategies() if s.runs_user_code]
            raise SpecError(which, f"strategy {strategy.name} does not run users' code yet; "
                                   f"use {' or '.join(able)}, or give the model as "
                                   "model.keras_file / model.keras_json")
        if code.get("dataset") and not training.steps:
            raise SpecError("training.steps", "with code.dataset the data's size is unknown to "
                                              "Strata: give the number of steps")


def _features(raw: Any) -> dict[str, Any]:
    if raw in (None, {}):
        return {}
    if not isinstance(raw, Mapping):
        raise SpecError("data.features", "must map feature names to {shape, dtype}")
    out: dict[str, Any] = {}
    for name, f in raw.items():
        field = f"data.features.{name}"
        if not isinstance(name, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_./-]{0,127}$", name):
            raise SpecError("data.features", f"bad feature name {str(name)[:60]!r}")
        if not isinstance(f, Mapping) or set(f) - {"shape", "dtype"}:
            raise SpecError(field, "must be {shape: [...], dtype: float32 | int64 | string}")
        shape = _int_list(f, "shape", f"{field}.shape", [], allow_empty=True)
        out[name] = {"shape": shape,
                     "dtype": _choice(f, "dtype", f"{field}.dtype", "float32", FEATURE_DTYPES)}
    return out


def _fraction(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 0.5:
        raise SpecError("data.test_fraction", f"must be a number in (0, 0.5], got {v!r}")
    return float(v)


def _check_data(data: DataSpec) -> None:
    """Which data fields go with which source."""
    src = data.source
    if src in ("npz",) + STREAMED_SOURCES and not data.path:
        raise SpecError("data.path", f"is required when data.source is {src}")
    if src in ("digits", "synthetic") and data.path:
        raise SpecError("data.path", f"does not apply to data.source {src}")
    if src != "synthetic" and data.examples:
        raise SpecError("data.examples", "applies to data.source synthetic only")
    if data.test_path and src not in STREAMED_SOURCES:
        raise SpecError("data.test_path", f"applies to data.source {', '.join(STREAMED_SOURCES)}")
    if src == "tfrecord":
        if not data.features:
            raise SpecError("data.features", "is required for tfrecord: each feature's "
                                             "{shape, dtype}")
        if data.label not in data.features:
            raise SpecError("data.label", f"must name one of data.features "
                                          f"({', '.join(data.features)}), got {data.label!r}")
        if len(data.features) < 2:
            raise SpecError("data.features", "needs the label and at least one input feature")
    elif data.features:
        raise SpecError("data.features", "applies to data.source tfrecord only")
    if src == "csv" and not data.label:
        raise SpecError("data.label", "is required for csv: the label column's name")
    if src not in ("tfrecord", "csv") and data.label:
        raise SpecError("data.label", "applies to data.source tfrecord and csv only")
    if src == "images":
        if len(data.image_size) != 2:
            raise SpecError("data.image_size", "is required for images: [height, width]")
    elif data.image_size:
        raise SpecError("data.image_size", "applies to data.source images only")


_CALLABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def _code(raw: Any) -> dict[str, Any]:
    """The ``code`` section as it travels: the uploaded project directory's digest (the client
    packs ``code.dir``, ``strata.uploads``) and the functions to call in it."""
    if raw in (None, {}):
        return {}
    if not isinstance(raw, Mapping):
        raise SpecError("code", "must be a mapping with dir, model and/or dataset")
    unknown = sorted(set(raw) - {"dir", "dir_name", "sha256", "size", "model", "dataset"})
    if unknown:
        raise SpecError(f"code.{unknown[0]}", "unknown field (code takes dir, model, dataset)")
    if isinstance(raw.get("dir"), str):
        raise SpecError("code.dir", f"{raw['dir'][:200]!r} is a directory on the submitting "
                                    "machine; submit through the strata client (strata submit, "
                                    "strata.client), which packs and uploads it")
    sha = raw.get("sha256")
    if not isinstance(sha, str) or not SHA256_RE.match(sha):
        raise SpecError("code.dir", "is required: the project directory to run the code from")
    size = raw.get("size") or 0
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size < 1 << 50:
        raise SpecError("code.size", "must be a byte count")
    out: dict[str, Any] = {"dir_name": str(raw.get("dir_name") or "code")[:255], "sha256": sha,
                           "size": size}
    for key in ("model", "dataset"):
        v = raw.get(key) or ""
        if not isinstance(v, str) or (v and not _CALLABLE.match(v)):
            raise SpecError(f"code.{key}", f"must be MODULE:FUNCTION (e.g. train:build_"
                                           f"{'model' if key == 'model' else 'dataset'}), "
                                           f"got {str(v)[:100]!r}")
        out[key] = v
    if not out["model"] and not out["dataset"]:
        raise SpecError("code", "names neither code.model nor code.dataset: nothing to run")
    return out


def _gradients(raw: Mapping[str, Any], workers: int, batch_size: int) -> GradientSpec:
    g = _section(raw, "gradients", {"accumulate", "compression", "pack_size"})
    accumulate = _int(g, "accumulate", "gradients.accumulate", 1, lo=1, hi=1024)
    if batch_size % (workers * accumulate):
        raise SpecError("gradients.accumulate", f"each of the {workers} workers' share of the "
                                                f"global batch {batch_size} must split into "
                                                f"{accumulate} equal slices")
    pack = g.get("pack_size")
    if isinstance(pack, int) and not isinstance(pack, bool):
        pack = str(pack)
    pack = "" if pack is None else pack
    if not isinstance(pack, str):
        raise SpecError("gradients.pack_size", f"must be a size like 4MiB, got {pack!r}")
    if pack:
        try:
            if parse_size(pack) < 0:
                raise ValueError("must not be negative")
        except ValueError as e:
            raise SpecError("gradients.pack_size", str(e)) from None
    return GradientSpec(
        accumulate=accumulate,
        compression=_choice(g, "compression", "gradients.compression", "none",
                            GRADIENT_COMPRESSION),
        pack_size=pack)


def _check_strategy_fields(spec: JobSpec, strategy: Any) -> None:
    """Optional fields that only some strategies take (each lists its own in ``fields``): set
    to anything but their default (or zero) value for another strategy, they are refused,
    never ignored."""
    for field in strategies.all_fields():
        value: Any = spec
        owner: Any = spec
        for part in field.split("."):
            owner, value = value, getattr(value, part)
        default = {f.name: f.default for f in dataclasses.fields(owner)}.get(
            field.rsplit(".", 1)[-1], dataclasses.MISSING)
        if not value or value == default or field in strategy.fields:
            continue
        users = strategies.users_of(field)
        raise SpecError(field, f"applies to strategies {' and '.join(users)} only"
                        if len(users) > 1 else f"applies to strategy {users[0]} only")


def _int_list(d: Mapping[str, Any], key: str, field: str, default: list[int],
              allow_empty: bool = False) -> list[int]:
    value = d.get(key)
    if value is None:
        return list(default)
    if isinstance(value, str):
        value = [v for v in re.split(r"[,\s]+", value.strip("[] ")) if v]
    if not isinstance(value, (list, tuple)) or (not value and not allow_empty):
        raise SpecError(field, f"must be a list of positive integers, got {value!r}")
    out = []
    for i, v in enumerate(value):
        out.append(_int({"v": v}, "v", f"{field}[{i}]", 0, lo=1, hi=1 << 24))
    return out


def _keras_file(kf: Any) -> dict[str, Any]:
    """``model.keras_file`` as it travels: the uploaded file's digest, name, size and the model
    config read from it. A path is the client's to upload (``strata.client``)."""
    f = "model.keras_file"
    if isinstance(kf, str):
        raise SpecError(f, f"{kf[:200]!r} is a path on the submitting machine; submit through "
                           "the strata client (strata submit, strata plan, strata.client), which "
                           "uploads the file")
    if not isinstance(kf, Mapping):
        raise SpecError(f, "must be the path of a .keras file")
    unknown = sorted(set(kf) - {"name", "sha256", "size", "config"})
    if unknown:
        raise SpecError(f"{f}.{unknown[0]}", "unknown field")
    sha = kf.get("sha256")
    if not isinstance(sha, str) or not SHA256_RE.match(sha):
        raise SpecError(f"{f}.sha256", "must be the SHA-256 of the uploaded file (64 hex digits)")
    name = kf.get("name", "") or "model.keras"
    if not isinstance(name, str) or len(name) > 4096:
        raise SpecError(f"{f}.name", "must be a file name")
    size = kf.get("size", 0)
    if isinstance(size, str) and size.isdigit():
        size = int(size)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise SpecError(f"{f}.size", "must be a byte count")
    config = kf.get("config", "")
    if not isinstance(config, str) or not config:
        raise SpecError(f, f"{name}: no model config; the client reads it from the file")
    if len(config) > MAX_KERAS_JSON_BYTES:
        raise SpecError(f, f"{name}'s config is {len(config):,} characters; the limit is "
                           f"{MAX_KERAS_JSON_BYTES:,}")
    return {"name": name, "sha256": sha, "size": size, "config": config}


def _model_field(spec: JobSpec) -> str:
    return "model.keras_file" if "keras_file" in spec.model else "model.keras_json"


def _check_model(spec: JobSpec) -> None:
    """Profiles the model without building it: refuses unsafe or unsupported layers and checks
    that its input and output fit the data source."""
    try:
        profile = profile_model(dict(spec.model))
    except ModelSpecError as e:
        raise SpecError(e.field, e.message) from None
    if len(profile.model_inputs) != 1:
        raise SpecError(_model_field(spec), f"the model has {len(profile.model_inputs)} inputs "
                                            f"({', '.join(i.name for i in profile.model_inputs)})"
                                            f"; data.source {spec.data.source} gives one")
    if spec.data.source == "digits":
        field = "model.builtin.input_shape" if "builtin" in spec.model else _model_field(spec)
        features = 1
        for dim in profile.input_shape:
            features *= dim
        if features != DIGITS_FEATURES:
            raise SpecError(field, f"the digits data has {DIGITS_FEATURES} features per example; the "
                                   f"model takes input shape {list(profile.input_shape)}")
        if profile.layers and profile.layers[-1].output_elems != DIGITS_CLASSES:
            field = "model.builtin.classes" if "builtin" in spec.model else _model_field(spec)
            raise SpecError(field, f"the digits data has {DIGITS_CLASSES} classes; the model's "
                                   f"last layer has {profile.layers[-1].output_elems} outputs")


#: ``--set`` flags one call takes, and the size of one value: a model goes in a file
MAX_OVERRIDES = 1000
MAX_OVERRIDE_VALUE_BYTES = 64 << 10
_FIELD_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Applies ``--set KEY=VALUE`` overrides (dotted keys, YAML-typed values) to a spec mapping.

    Values are read by the job files' loader (``strata.safeyaml``): aliases, equal keys and
    dates behave as in a file. A path or value that does not parse is refused naming ``--set``,
    never kept as text or cut to what parses, so a typo cannot change what a job means."""
    if len(overrides) > MAX_OVERRIDES:
        raise SpecError("--set", f"{len(overrides):,} flags; at most {MAX_OVERRIDES:,}")
    try:
        out: dict[str, Any] = json.loads(json.dumps(raw))
    except (TypeError, ValueError, RecursionError) as e:
        raise SpecError("spec", f"is not plain data (what JSON holds): {str(e)[:200]}") from None
    nodes = 0
    for item in overrides:
        key, eq, text = item.partition("=")
        if not eq:
            raise SpecError("--set", f"{safeyaml.quote(item)}: takes KEY=VALUE, e.g. "
                                     "--set training.epochs=3")
        if not _FIELD_PATH.fullmatch(key):
            raise SpecError("--set", f"{safeyaml.quote(item)}: a field path is names joined by "
                                     "single dots, e.g. training.epochs")
        parts = key.split(".")
        if len(parts) >= MAX_SPEC_DEPTH:
            raise SpecError("--set", f"{safeyaml.quote(key)}: {len(parts)} names deep; a job "
                                     f"file is at most {MAX_SPEC_DEPTH} levels")
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_OVERRIDE_VALUE_BYTES:
            raise SpecError("--set", f"{key}: the value is {size:,} bytes; at most "
                                     f"{MAX_OVERRIDE_VALUE_BYTES >> 10} KiB (a model goes in "
                                     "model.keras_file)")
        value: Any = ""
        if text.strip():
            try:
                # the value sits len(parts) levels down: the file's depth bound holds with it
                value = safeyaml.load(text, f"--set {key}",
                                      max_depth=MAX_SPEC_DEPTH - len(parts))
            except safeyaml.YamlRefused as e:
                plain = len(text) <= 40 and text.isprintable() and not set(text) & set("'\"")
                example = text if plain else "..."
                raise SpecError("--set", f"{key}: {e.problem}; to give text, quote it: "
                                         f"--set '{key}=\"{example}\"'") from None
            if value is None and text.strip() not in ("null", "Null", "NULL", "~"):
                # YAML reads a lone document marker or a comment as nothing: not what was meant
                raise SpecError("--set", f"{key}: {text.strip()[:40]!r} is no value (YAML reads "
                                         f"it as nothing); to give text, quote it: --set "
                                         f"'{key}=\"...\"'")
            nodes += _expanded_nodes(value, {})
            if nodes > safeyaml.MAX_NODES:
                raise SpecError("--set", f"{key}: the values of --set come to more than "
                                         f"{safeyaml.MAX_NODES:,} nodes with aliases expanded")
            value = json.loads(json.dumps(value))  # aliases made copies: one edit, one place
        node = out
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise SpecError(".".join(parts[: i + 1]), "is not a mapping; cannot set a field inside it")
            node = nxt
        node[parts[-1]] = value
    return out


def _expanded_nodes(value: Any, memo: dict[int, int]) -> int:
    """Nodes in ``value`` with a list or mapping that it holds more than once counted each time
    (``memo``: by object, so that counting is linear in the distinct ones)."""
    if not isinstance(value, (dict, list)):
        return 1
    known = memo.get(id(value))
    if known is None:
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        known = memo[id(value)] = 1 + sum(_expanded_nodes(v, memo) for v in items)
    return known


def load_spec_file(path: str) -> dict[str, Any]:
    """Reads a YAML or JSON job file into a mapping (validation is parse_job_spec's job), with
    the loader that bounds aliases, depth and equal keys (``strata.safeyaml``)."""
    try:
        if os.path.getsize(path) > MAX_SPEC_FILE_BYTES:
            raise SpecError("JOB", f"{path} is larger than {MAX_SPEC_FILE_BYTES >> 20} MiB: not "
                                   "a job file (a large model goes in model.keras_file)")
        with open(path, "rb") as fb:
            raw = fb.read()
    except OSError as e:
        raise SpecError("JOB", f"cannot read {path}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise SpecError("JOB", f"{path} line {line}: not UTF-8 text (byte "
                               f"0x{raw[e.start]:02x})") from None
    try:
        data = safeyaml.load(text, path, max_depth=MAX_SPEC_DEPTH)
    except safeyaml.YamlRefused as e:  # its message names the file and the line
        raise SpecError("JOB", e.message) from None
    if not isinstance(data, dict):
        raise SpecError("JOB", f"{path} must hold a mapping of job fields")
    return data


#: a job file is a few KiB (a keras_json model a few hundred); gRPC takes at most 16 MiB
MAX_SPEC_FILE_BYTES = 16 << 20
MAX_SPEC_DEPTH = 32
