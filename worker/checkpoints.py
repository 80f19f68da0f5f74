"""Checkpoints and resume for every training task process (``strata.worker.runner``'s hooks).

``Checkpointer`` (one per task) saves what the strategy's runner names
(``TrainingRunner.checkpoint_objects``) with a ``step`` counter and a ``meta`` note of the
writer's layout, every ``checkpoint.every_steps`` steps, under ``TaskConfig.checkpoint_root``,
and restores the newest checkpoint before training. Invariants: a task of generation N
(``TaskConfig.restart``) writes only into ``gen-N`` and resumes only from generations K < N,
never its own or a later one's; a checkpoint counts only when TensorFlow's state file lists it
and its index file exists; once ``gen-N`` holds its first checkpoint, its writer deletes every
older generation. Events: ``checkpoint`` (only from the task that wrote into ``gen-N`` itself)
after a save, ``resumed`` after a restore.

Layout, what each strategy saves, the data position on resume: docs/checkpoints.md.
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
            continue  # its own or a later generation: never trusted (docs/checkpoints.md)
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
