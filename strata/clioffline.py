"""The ``strata`` commands that check a job file on this machine: validate (the spec, the
model, the data it can see; with ``--coordinator`` also the cluster's answer) and plan
(offline with ``--workers`` and ``--memory-budget``, else the coordinator's plan)."""

from __future__ import annotations

import argparse
import dataclasses
import os

from strata.clicommon import (
    EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError, _check_job, _client, _fail, _fmt_bytes,
    _print_json, _size, _table,
)


def cmd_validate(args: argparse.Namespace) -> int:
    from strata.client import local_spec
    from strata.coordinator.core import prepare

    _check_job(args.job, args.set)
    spec = local_spec(args.job, args.set)
    plan = prepare(spec).plan  # the model profiled, the strategy's plan without workers
    _check_local_data(spec, plan)
    if args.coordinator:  # and every check that needs the cluster: what submit would say
        with _client(args) as c:
            seen = c.plan(args.job, overrides=args.set)
        if not seen.feasible:
            return _fail(f"{args.job}: rejected by {args.coordinator}: {seen.reason}",
                         EXIT_USAGE)
    if not plan.tasks:  # stages are cut to fit the workers' budgets
        print(f"{args.job}: valid - {spec.name}, {spec.strategy}; its stages are planned "
              f"against the workers' budgets (strata plan {args.job} --workers N "
              f"--memory-budget SIZE shows them)")
        return EXIT_OK
    print(f"{args.job}: valid - {spec.name}, {spec.strategy}, {len(plan.tasks)} task(s), "
          f"about {_fmt_bytes(plan.largest_estimate)} for the largest")
    return EXIT_OK


#: a local data file validate reads whole to check its shapes, at most (larger: the task does)
VALIDATE_READ_BYTES = 256 << 20


def _check_local_data(spec, plan) -> None:
    """The job's data against its model, where this machine can see the data, as the task
    checks it before it trains: an npz file's arrays' shapes (read only when small); a CSV's,
    TFRecord's or image directory's files, the label, and the features' size against the
    model's input. Raises SpecError naming the field."""
    import dataclasses
    import glob

    from strata.errors import SpecError
    from strata.modelspec import ModelSpecError, profile_model
    from strata.worker import data as wdata

    def here(path: str) -> bool:  # a file, a directory or a pattern of files on this machine
        return bool(path) and (os.path.exists(path) or bool(glob.glob(path)))

    d = spec.data
    if spec.code_model or not here(d.path):
        return  # what the job's code builds, or data only the workers see
    if d.test_path and not here(d.test_path):
        d = dataclasses.replace(d, test_path="")  # a test split only the workers see
    try:
        profile = profile_model(dict(spec.model))
    except ModelSpecError:
        return  # the model's own checks said what there is to say
    try:
        if d.source == "npz" and not spec.code_dataset and os.path.isfile(d.path) and \
                os.path.getsize(d.path) <= VALIDATE_READ_BYTES:
            wdata.load_splits(d, profile.input_shape, profile.output_shape)
        elif d.source in ("csv", "tfrecord", "images") and not spec.code_dataset:
            wdata.check_streamed(d)
            _check_feature_size(d, profile)
    except wdata.DataError as e:
        raise SpecError(e.field, e.message) from None


def _check_feature_size(d, profile) -> None:
    """A CSV's feature columns, or a one-input TFRecord's feature, against the size of the
    model's input (the task reshapes neither: a mismatch fails its first step)."""
    from strata.worker import data as wdata

    want = 1
    for n in profile.input_shape:
        want *= int(n or 0)
    if not want or len(profile.model_inputs) > 1:
        return
    if d.source == "csv":
        path = wdata.data_files(d.path, "data.path")[0]
        have = len(wdata.csv_columns(path)) - 1
        what = f"{path} has {have} feature columns besides {d.label!r}"
        field = "data.path"
    elif d.source == "tfrecord":
        inputs = [n for n in d.features if n != d.label]
        if len(inputs) != 1:
            return
        shape = list(d.features[inputs[0]].get("shape") or [])
        have = 1
        for n in shape:
            have *= int(n)
        what = f"feature {inputs[0]!r} has shape {shape}"
        field = f"data.features.{inputs[0]}"
    else:
        return
    if have != want:
        raise wdata.DataError(field, f"{what}, and the model's input "
                                     f"{list(profile.input_shape)} takes {want} values")


def _offline_plan(args: argparse.Namespace):
    """``strata plan --workers N --memory-budget SIZE``: the plan for N idle workers of that
    budget, computed here (the coordinator's planner, no coordinator)."""
    from strata.client import local_spec
    from strata.coordinator.core import PreparedJob, plan_on, prepare
    from strata.coordinator.placement import Capacity
    from strata.types import WorkerOffer

    if not 1 <= args.workers <= 4096:
        raise UsageError(f"--workers {args.workers}: 1 to 4096")
    budget = _size("--memory-budget", args.memory_budget)
    names = [f"worker-{i}" for i in range(args.workers)]
    spec = local_spec(args.job, args.set)
    prepared: PreparedJob = prepare(spec, [WorkerOffer(n, budget) for n in names])
    plan = plan_on(prepared, [Capacity(name=n, budget_bytes=budget, free_bytes=budget,
                                       free_ports=64) for n in names], {})
    if plan.feasible and any(not t.worker for t in plan.tasks):
        # idle workers that cannot hold it now never will: no job ends to make room
        why = plan.reason.rsplit("would wait: ", 1)[-1]
        return dataclasses.replace(plan, feasible=False, reason=(
            f"{args.workers} worker(s) of {_fmt_bytes(budget)} cannot hold every task at "
            f"once: {why}"))
    return plan


def cmd_plan(args: argparse.Namespace) -> int:
    from strata.types import plan_to_json

    if (args.workers is None) != (args.memory_budget is None):
        raise UsageError("--workers and --memory-budget go together (offline planning)")
    _check_job(args.job, args.set)
    if args.workers is not None:
        plan = _offline_plan(args)
    else:
        with _client(args) as c:
            plan = c.plan(args.job, overrides=args.set)
    if args.json:
        _print_json(plan_to_json(plan))
    else:
        print(f"strategy {plan.strategy}: {'feasible' if plan.feasible else 'NOT feasible'} - {plan.reason}")
        rows = [[f"{t.role}:{t.index}", t.worker or "-", str(t.stage), str(len(t.layers)),
                 _fmt_bytes(t.estimated_memory_bytes), _fmt_bytes(t.memory_budget_bytes)] for t in plan.tasks]
        _table(rows, ["TASK", "WORKER", "STAGE", "LAYERS", "ESTIMATE", "BUDGET"])
    return EXIT_OK if plan.feasible else EXIT_FAILED
