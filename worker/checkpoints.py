"""Checkpoints and resume for every training task process (``strata.worker.runner``'s hooks).

Layout on the shared storage (``TaskConfig.checkpoint_root`` = ``SHARED/jobs/JOB/checkpoints``)::

    gen-0/checkpoint              TensorFlow's state file (the kept checkpoints, newest last)
    gen-0/ckpt-3.index, ckpt-3.data-00000-of-0000N
    gen-0/ckpt-6.index, ...       ``CheckpointManager(max_to_keep=checkpoint.keep)``
    gen-1/...                     the generation started by the job's first restart

A task of generation N (``TaskConfig.restart``) writes only into ``gen-N``; the file name
carries the step (``save(checkpoint_number=step)``). It resumes from the newest checkpoint
(highest step) of the generations BEFORE its own, and never reads ``gen-K`` with K >= N:
``gen-N`` is what its own generation is writing, and a later generation's directory belongs to
a job that has moved on without this task (a stale task on a partitioned host must neither
resume from its successors nor write where they read). Only checkpoints that TensorFlow's state
file lists and whose index file exists count. After generation N has written its first
checkpoint, its writer deletes every ``gen-K`` with K < N, so ``keep`` bounds what is kept.

What each strategy saves (``TrainingRunner.checkpoint_objects``), with a step counter
(``step``) and a JSON description of the writer (``meta``: workers, replicas, stage split):

- ``multi_worker_mirrored``: the model and its optimizer. TensorFlow requires every worker to
  take part in a save of a multi-worker strategy's variables; all call ``save`` at the same
  step, worker 0 into ``gen-N``, each other worker into a directory of its own
  (``gen-N/tmp-worker-I``) that it deletes straight afterwards. Before building, the workers
  agree on what to resume from: worker 0's choice goes to every worker in one all-reduce, so
  they all restore the same checkpoint even when the shared directory changes under them.
- ``parameter_server``: the chief saves the model and optimizer (its ``tf.train.Checkpoint``
  reads the variables on the PS tasks; each PS task writes its own shard to the shared
  storage) and the ``applied`` and ``loss_sum`` counters. It stops scheduling at a checkpoint
  step and joins the coordinator before saving, so the saved state holds exactly the steps
  counted (the pipeline of queued steps drains once every ``every_steps``).
- ``pipeline`` / ``hybrid``: the driver saves every replica's layers (by layer name) and every
  stage's optimizer, and the float16 loss scale; the variables live on the stage tasks, which
  write their own shards. Resumed with the same stage split and replica count, everything is
  restored exactly. With another replica count, replica 0's layers and optimizers are restored
  into every replica. With another stage split (a job re-planned on other workers), the layers'
  weights are restored by name and the optimizers start afresh (their state is per stage).

Data position. A task resuming at step S trains steps S+1 .. total and ends at exactly the
planned step count; progress events carry the true step numbers. The in-memory sources'
order is a deterministic function of ``training.seed`` and the worker count, so the input
skips S batches cheaply: ``make_train_dataset`` skips S batches of row indices before the
gather, the pipeline driver fast-forwards ``_batch_indices`` by S. Resumed with the same
worker count, a run is the same as one never interrupted (the same weights, bit for bit).
Streamed sources and ``code.dataset`` pipelines skip S batches too, which costs reading them.
A ``multi_worker_mirrored`` job re-planned on another worker count resumes at step S with the
new sharding (each worker skips S batches of its new shard: not the same examples an
uninterrupted run would have seen next). A ``parameter_server`` job's order is random per
worker by design (asynchronous training, each worker's pipeline seeded from its clock), so it
resumes at the step count with a fresh order (a ``code.dataset`` pipeline starts again from its
beginning on every worker: which worker ran which step is not recorded).

Events: ``checkpoint`` (step, seconds, path) after every save, from the task that wrote into
the real directory only; ``resumed`` (step, path, generation) after a restore, before
training. Each is logged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from typing import Any

from strata.taskconfig import TaskConfig
from strata.worker.events import Events, log

GEN_PREFIX = "gen-"
CKPT_NAME = "ckpt"
_GEN_RE = re.compile(r"^gen-(\d+)$")
_STEP_RE = re.compile(r"-(\d+)$")


@dataclasses.dataclass(frozen=True)
class Found:
    """A checkpoint to resume from: its generation, step and path prefix."""

    generation: int
    step: int
    path: str


def generation_dirs(root: str) -> list[tuple[int, str]]:
    """``(K, path)`` of every ``gen-K`` directory under ``root``, by K."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    out = []
    for n in names:
        m = _GEN_RE.match(n)
        if m and os.path.isdir(os.path.join(root, n)):
            out.append((int(m.group(1)), os.path.join(root, n)))
    return sorted(out)


def checkpoint_path(root: str, generation: int, step: int) -> str:
    return os.path.join(root, f"{GEN_PREFIX}{generation}", f"{CKPT_NAME}-{step}")


def complete_checkpoints(directory: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the complete checkpoints in one generation's directory: those its
    ``checkpoint`` state file lists (a manager writes it after the checkpoint's files) whose
    index file exists (a sweep may have deleted one since)."""
    import tensorflow as tf

    try:
        state = tf.train.get_checkpoint_state(directory)
    except (tf.errors.OpError, ValueError) as e:  # a torn state file: nothing to trust
        log(f"warning: cannot read the checkpoint state in {directory}: {e}")
        return []
    if state is None:
        return []
    out = []
    for p in state.all_model_checkpoint_paths:
        m = _STEP_RE.search(os.path.basename(p))
        if m and os.path.exists(p + ".index"):
            out.append((int(m.group(1)), p))
    return sorted(out)


def find_latest(root: str, before_generation: int) -> Found | None:
    """The checkpoint with the highest step among generations ``< before_generation``."""
    best: Found | None = None
    for k, d in generation_dirs(root):
        if k >= before_generation:
            continue  # its own or a later generation: never trusted (see the module doc)
        for step, path in complete_checkpoints(d):
            if best is None or (step, k) > (best.step, best.generation):
                best = Found(k, step, path)
    return best


class Checkpointer:
    """One task's checkpoints: where it looks for one to resume from (``find``), what it saves
    (``attach``), the restore, and the saves at step boundaries (``due``, ``save``).

    ``writer``: this task writes into the generation's directory (and emits the events);
    ``participant``: a task that must call ``save`` with the writer but writes elsewhere
    (the other workers of a multi_worker_mirrored job)."""

    def __init__(self, cfg: TaskConfig, events: Events, *, writer: bool = True):
        self.cfg, self.events, self.writer = cfg, events, writer
        self.every = int(cfg.spec.checkpoint_every_steps)
        self.keep = max(1, int(cfg.spec.checkpoint_keep))
        self.root = cfg.checkpoint_root
        self.generation = int(cfg.restart)
        self.directory = os.path.join(self.root, f"{GEN_PREFIX}{self.generation}")
        # a participant's own directory, deleted after every save
        self.scratch = os.path.join(self.directory, f"tmp-{cfg.role}-{cfg.index}")
        self.tf: Any = None
        self.ckpt: Any = None
        self.manager: Any = None
        self.step_var: Any = None
        self.saved_once = False
        self.last_save_s = 0.0

    # -- before building

    def find(self) -> Found | None:
        found = find_latest(self.root, self.generation)
        if found is None:
            log(f"checkpoints: none to resume from in {self.root} (generation {self.generation}"
                f"; every {self.every} steps, keeping {self.keep})")
        return found

    @staticmethod
    def read_meta(tf: Any, found: Found) -> dict[str, Any]:
        """The ``meta`` JSON saved with a checkpoint ({} when absent)."""
        try:
            raw = tf.train.load_variable(found.path, "meta/.ATTRIBUTES/VARIABLE_VALUE")
        except (tf.errors.OpError, ValueError):
            return {}
        try:
            out = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
        except ValueError:
            return {}
        return out if isinstance(out, dict) else {}

    # -- after building

    def attach(self, tf: Any, objects: dict[str, Any], meta: dict[str, Any] | None = None,
               device: str | None = None) -> None:
        """What every checkpoint holds: ``objects`` (trackables by name), a step counter and
        ``meta``, created on ``device`` (this process's own by default)."""
        import contextlib

        self.tf = tf
        ctx = tf.device(device) if device else contextlib.nullcontext()
        with ctx:
            self.step_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="strata_step")
            self.meta_var = tf.Variable(json.dumps(meta or {}, sort_keys=True), dtype=tf.string,
                                        trainable=False, name="strata_meta")
        self.objects = dict(objects)
        self.ckpt = tf.train.Checkpoint(step=self.step_var, meta=self.meta_var, **self.objects)
        if self.writer:
            self.manager = tf.train.CheckpointManager(self.ckpt, directory=self.directory,
                                                      max_to_keep=self.keep,
                                                      checkpoint_name=CKPT_NAME)

    def restore(self, found: Found, views: list[dict[str, Any]] | None = None) -> int:
        """Restores ``found`` into the attached objects, or through ``views``: mappings of the
        saved names to this task's objects, restored one after the other (for a checkpoint of
        another layout; what none names is left as built). Returns the restored step."""
        tf = self.tf
        t0 = time.time()
        # every object named must find its values in the checkpoint (a view leaves some of the
        # checkpoint's values unused: expect_partial)
        for view in [self.ckpt] if views is None else [
                tf.train.Checkpoint(step=self.step_var, **objects) for objects in views]:
            status = view.restore(found.path)
            try:
                status.assert_existing_objects_matched()
            except AssertionError as e:
                raise RuntimeError(f"checkpoint {found.path} does not match the model being "
                                   f"trained: {str(e)[:400]}") from None
            if views is not None:
                status.expect_partial()
        step = int(self.step_var.numpy())
        if step != found.step:
            log(f"warning: checkpoint {found.path} holds step {step}; resuming at {found.step}")
            step = found.step
        secs = time.time() - t0
        log(f"resumed from {found.path} (generation {found.generation}) at step {step} "
            f"({secs:.2f} s)")
        self.events.emit("resumed", step=step, path=found.path, generation=found.generation,
                         seconds=secs)
        return step

    # -- at step boundaries

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def next_due(self, step: int) -> int:
        """The first checkpoint step after ``step``."""
        return (step // self.every + 1) * self.every

    def save(self, step: int) -> None:
        tf = self.tf
        t0 = time.time()
        self.step_var.assign(step)
        if self.writer:
            path = self.manager.save(checkpoint_number=step)
        else:
            # every worker of a multi-worker strategy must take part in the save; only the
            # writer's copy is kept
            manager = tf.train.CheckpointManager(self.ckpt, directory=self.scratch,
                                                 max_to_keep=1, checkpoint_name=CKPT_NAME)
            manager.save(checkpoint_number=step)
            shutil.rmtree(self.scratch, ignore_errors=True)
            path = ""
        secs = time.time() - t0
        self.last_save_s = secs
        if not self.writer:
            return
        log(f"checkpoint at step {step}: {path} ({secs:.2f} s)")
        self.events.emit("checkpoint", step=step, seconds=secs, path=path)
        if not self.saved_once:
            self.saved_once = True
            self.delete_older_generations()

    def delete_older_generations(self) -> None:
        for k, d in generation_dirs(self.root):
            if k < self.generation:
                shutil.rmtree(d, ignore_errors=True)
                log(f"checkpoints: deleted generation {k} ({d})")
