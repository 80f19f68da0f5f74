"""The one skeleton every training task follows; each strategy supplies its steps.

``TrainingRunner.run``: join the cluster (``join``), load the data (shared), build the model
(``build``), train for the planned number of steps (``train``: by default one ``train_step`` per
step, with progress and allocator figures reported every ``report_interval_s``), evaluate on
the test split (``eval_batch`` over batches), report the result (``result_fields``), and leave
through ``exit_task`` with the documented exit status (``strata.exitcodes``; errors become
exit statuses in ``strata.worker.task``).

Checkpoints (``strata.worker.checkpoints``, with ``checkpoint.every_steps`` and a shared
directory): after loading the data the task looks for a checkpoint of an earlier generation
(``agree_resume`` lets the workers of one strategy agree on it) and sets ``start_step``, which
``build`` uses to skip the input to where that step left it; after building it restores the
strategy's ``checkpoint_objects`` and trains steps ``start_step + 1 .. steps``, saving at every
multiple of ``every_steps`` (``after_step``).

Subclasses: ``strata.worker.trainers.data_parallel`` (multi_worker_mirrored), ``strata.worker.trainers.ps_chief`` (the
parameter_server chief), ``strata.worker.trainers.gpipe`` (the pipeline and hybrid driver).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

from strata.exitcodes import TASK_EXIT_NOTICE, TASK_EXIT_OK
from strata.modelspec import ModelProfile, ModelSpecError, profile_model
from strata.types import STREAMED_SOURCES
from strata.taskconfig import TaskConfig, TaskConfigError
from strata.worker.checkpoints import Checkpointer, Found
from strata.worker.notice import Notice
from strata.worker.device import configure_device
from strata.worker.events import Events, exit_task, format_mib, log
from strata.worker.losses import training_loss
from strata.worker.watchdog import install_sigterm_handler


@dataclasses.dataclass
class Data:
    """The job's data as a task holds it: NumPy arrays, targets shaped for the loss."""

    x_train: Any
    y_train: Any
    x_test: Any
    y_test: Any
    classify: bool        # test accuracy is meaningful (class labels)
    steps: int            # the planned number of training steps

    @property
    def n_train(self) -> int:
        return int(self.x_train.shape[0])


def load_data(cfg: TaskConfig, input_shape: tuple[int, ...],
              output_shape: tuple[int, ...], input_dtype: str = "float32",
              loss: str = "") -> Data:
    """Loads the spec's data for a model of these shapes (integer features for a model whose
    input is integer: token ids for an Embedding), targets shaped for ``loss`` (one of
    ``strata.worker.data``'s; the job's by default). Raises ``TaskConfigError``."""
    import numpy as np

    from strata.worker import data as wdata

    spec = cfg.spec
    loss = loss or spec.training.loss_used
    field = "data.path" if spec.data.path else "data.source"
    try:
        splits = wdata.load_splits(spec.data, tuple(input_shape), tuple(output_shape),
                                   input_dtype)
        y_train = wdata.prepare_targets(splits.y_train, loss, tuple(output_shape), field)
        y_test = wdata.prepare_targets(splits.y_test, loss, tuple(output_shape), field)
    except wdata.DataError as e:
        raise TaskConfigError(e.field, e.message) from None
    classify = loss in wdata.CLASSIFICATION_LOSSES or (
        np.issubdtype(splits.y_test.dtype, np.integer) and splits.y_test.ndim == 1)
    steps = wdata.total_steps(spec.training, splits.n_train, spec.data.batch_size)
    x_train, x_test = splits.x_train, splits.x_test
    if input_dtype.startswith(("int", "uint")):
        x_train, x_test = x_train.astype(input_dtype), x_test.astype(input_dtype)
    return Data(x_train, y_train, x_test, y_test, bool(classify), steps)


def check_data_available(cfg: TaskConfig) -> None:
    """What can be checked before TensorFlow is imported (a bad config fails in milliseconds):
    a data file's presence and arrays. First of all, the data paths must lie inside the
    agent's data roots (``strata.dataroots``), before anything says whether a file exists."""
    from strata.dataroots import OutsideRoots, confine

    for field, path in (("data.path", cfg.spec.data.path),
                        ("data.test_path", cfg.spec.data.test_path)):
        try:
            confine(path, field, cfg.agent.data_roots)
        except OutsideRoots as e:
            raise TaskConfigError(e.field, e.message) from None
    if cfg.spec.code_dataset:
        return  # the job's own input pipeline
    from strata.worker.data import DataError, check_streamed, load_npz_keys

    try:
        if cfg.spec.data.source == "npz":
            load_npz_keys(cfg.spec.data.path)
        elif cfg.spec.data.source in STREAMED_SOURCES:
            check_streamed(cfg.spec.data)
    except DataError as e:
        raise TaskConfigError(e.field, e.message) from None


def gradient_step(tf: Any, model: Any, optimizer: Any, loss_fn: Any, mixed: str,
                  reduce: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    """One replica's training step: forward and ``training_loss`` (``reduce`` is a mean over
    the global or the local batch), backward (scaled with float16's loss scaling), apply.
    Returns the loss."""
    variables = model.trainable_variables
    scaled = mixed == "float16"

    def step_fn(x: Any, y: Any, w: Any = None) -> Any:
        with tf.GradientTape() as tape:
            loss = training_loss(tf, model, loss_fn, reduce, x, y, w)
            loss_for_grad = optimizer.scale_loss(loss) if scaled else loss
        grads = tape.gradient(loss_for_grad, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    return step_fn


class Scalars:
    """TensorBoard scalars of one task: ``OUTPUT_DIR/tensorboard/ROLE-INDEX`` (the job's
    output location, on the shared directory when the workers have one; the coordinator keeps
    a copy with the job's outputs). Never fails the training: a writer that errs is logged
    once and dropped."""

    def __init__(self, tf: Any, cfg: TaskConfig):
        self.tf = tf
        self.dir = os.path.join(cfg.agent.output_dir, "tensorboard",
                                f"{cfg.role}-{cfg.index}")
        self.writer: Any = None
        from tensorflow.core.framework import summary_pb2

        md = summary_pb2.SummaryMetadata(data_class=summary_pb2.DATA_CLASS_SCALAR)
        md.plugin_data.plugin_name = "scalars"
        self.metadata = md.SerializeToString()
        try:
            with tf.device("/device:CPU:0"):
                self.writer = tf.summary.create_file_writer(self.dir)
        except Exception as e:  # noqa: BLE001 - TensorBoard is an extra
            log(f"tensorboard: cannot write {self.dir}: {e}")

    def write(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            return
        tf = self.tf
        try:
            with tf.device("/device:CPU:0"), self.writer.as_default():
                for name, value in values.items():
                    # what tf.summary.scalar writes, without the tensorboard package (which
                    # tensorflow-cpu does not bring): a float32 scalar tagged for the scalars
                    # dashboard
                    tf.summary.write(name, tf.constant(float(value), tf.float32), step=step,
                                     metadata=self.metadata)
            self.writer.flush()
        except Exception as e:  # noqa: BLE001
            log(f"tensorboard: stopped writing {self.dir}: {e}")
            self.writer = None


class Progress:
    """Reports ``first_step`` once and ``progress`` (step, loss, examples/s, this process's
    allocator figures) after the first and the last step and at most every ``interval`` s."""

    def __init__(self, events: Events, memory: Callable[[], dict], total_steps: int,
                 global_batch: int, interval: float, label: str = "mem", start: int = 0,
                 scalars: Scalars | None = None):
        self.events, self.memory, self.total = events, memory, total_steps
        self.scalars = scalars
        self.gb, self.interval, self.label = global_batch, interval, label
        self.first = start + 1  # a resumed task's first step
        self.t_start = time.time()
        self.last_t, self.last_step, self.last_report = self.t_start, start, self.t_start

    def first_step(self) -> None:
        self.events.emit("first_step", latency_s=time.time() - self.t_start)

    def due(self, step: int) -> bool:
        return step == self.first or step == self.total or \
            time.time() - self.last_report >= self.interval

    def report(self, step: int, loss: float) -> None:
        now = time.time()
        eps = (step - self.last_step) * self.gb / max(now - self.last_t, 1e-9)
        m = self.memory()
        self.events.emit("progress", step=step, total_steps=self.total, loss=loss,
                         examples_per_sec=eps, memory=m)
        log(f"step {step}/{self.total} loss {loss:.4f} {eps:,.0f} ex/s {self.label} "
            f"{format_mib(m['current'])} (peak {format_mib(m['peak'])})")
        if self.scalars is not None:
            self.scalars.write(step, {"loss": loss, "examples_per_sec": eps,
                                      "memory/in_use_bytes": m["current"],
                                      "memory/peak_bytes": m["peak"]})
        self.last_t, self.last_step, self.last_report = now, step, now


def variable_bytes(model: Any) -> list[int]:
    """The size of each of ``model``'s trainable variables (Keras 3 or tf.Variable); empty
    when they cannot be read (a figure for the budget must never fail the task)."""
    import numpy as np

    try:
        return [int(np.prod([int(d) for d in v.shape])) * int(
                    getattr(v.dtype, "size", 0) or np.dtype(str(v.dtype)).itemsize)
                for v in getattr(model, "trainable_weights", [])]
    except (TypeError, ValueError, AttributeError):
        return []


class PeakLog:
    """Where a task's allocator peak grew: read after every step, checkpoint, the evaluation
    and the outputs, each growth kept with what ran just before it. A probe run
    (``memory.profile``) measures the first steps and the evaluation; this says, in the task's
    log and its ``peaks`` event, what the rest of a run added to that peak and when
    (``bench/peak_growth.py``)."""

    #: growths kept in detail; later ones are counted
    KEEP = 12

    def __init__(self, memory: Callable[[], dict]):
        self.memory = memory
        self.last = 0
        self.grew: list[tuple[str, int, int]] = []  # (what ran, peak before, peak after)
        self.more = 0

    def note(self, what: str) -> None:
        peak = int(self.memory().get("peak", 0))
        if peak <= self.last:
            return
        if len(self.grew) < self.KEEP:
            self.grew.append((what, self.last, peak))
        else:
            self.more += 1
        self.last = peak

    def summary(self) -> str:
        parts = [f"{what} {format_mib(before)} -> {format_mib(after)}"
                 for what, before, after in self.grew]
        more = f", and {self.more} more" if self.more else ""
        return "memory peak grew at: " + (", ".join(parts) or "nothing") + more

    def as_event(self) -> list[dict[str, Any]]:
        return [{"after": what, "from": before, "to": after}
                for what, before, after in self.grew]


class TrainingRunner:
    """Subclasses implement ``join``, ``build``, ``train_step`` (or ``train``), ``eval_batch``
    and ``result_fields``; ``run`` is the order they happen in."""

    #: how the allocator figures are labelled in the log (the chief's own, for drivers)
    memory_label = "mem"

    def __init__(self, cfg: TaskConfig, events: Events):
        self.cfg = cfg
        self.spec = cfg.spec
        self.events = events
        self.gb = cfg.spec.data.batch_size
        self.mixed = cfg.spec.memory.mixed_precision
        self.seed = cfg.spec.training.seed
        # None for a model the job's own code builds (``code.model``): its runner knows it
        # once built
        self.profile: ModelProfile | None = None
        if not cfg.spec.code_model:
            try:
                self.profile = profile_model(cfg.spec.model)
            except ModelSpecError as e:
                raise TaskConfigError(e.field, e.message) from None
        self.tf: Any = None
        self.memory: Callable[[], dict] = lambda: {"current": 0, "peak": 0}
        self.data: Data | None = None
        # checkpoints: None when the job takes none; the step training resumes after
        self.checkpointer: Checkpointer | None = None
        #: a notice from the agent: save and stop after its step (``stop_on_notice``)
        self.notice = Notice()
        self.resume_from: Found | None = None
        self.start_step = 0
        self.scalars: Scalars | None = None
        #: the optimizer and loss it trains with and where they came from (``build`` sets it)
        self.training_text = ""
        #: what the job's events should say of how it trains (``build`` adds them)
        self.notes: list[str] = []
        #: a compiled ``code.model``'s own metrics, evaluated on the test split (fresh objects
        #: of this task's, outside the strategy: ``build`` sets them)
        self.metrics: list[Any] = []
        #: where the allocator peak grew (``setup_device`` points ``memory`` at the allocator)
        self.peaks = PeakLog(lambda: self.memory())

    # -- hooks

    def load(self) -> Data:
        """The job's data as NumPy arrays, for the model's one input (the skeleton's default);
        with ``code.dataset`` only the step count (the job's own pipeline feeds the steps);
        for a ``code.model`` the model is built first, to read its input."""
        from strata.worker import data as wdata

        if self.spec.code_dataset:
            return Data(None, None, None, None,
                        self.loss_kind() in wdata.CLASSIFICATION_LOSSES,
                        self.spec.training.steps)
        if self.spec.code_model:
            model = self.user_model()
            inp = model.inputs[0]
            return load_data(self.cfg, tuple(int(d) for d in inp.shape[1:]),
                             tuple(int(d) for d in model.outputs[0].shape[1:]), str(inp.dtype),
                             loss=self.loss_kind())
        assert self.profile is not None
        inputs = self.profile.model_inputs
        if len(inputs) != 1:
            raise TaskConfigError("model", f"the model has {len(inputs)} inputs "
                                           f"({', '.join(i.name for i in inputs)}); "
                                           f"data.source {self.spec.data.source} gives one")
        return load_data(self.cfg, self.profile.input_shape, self.profile.output_shape,
                         inputs[0].dtype)

    def loss_kind(self) -> str:
        """The loss as ``strata.worker.data`` knows losses (how targets are shaped, whether
        accuracy is counted): ``training.loss`` when the job gives it, else what a compiled
        ``code.model`` was compiled with, else the default."""
        t = self.spec.training
        if t.loss or not self.spec.code_model:
            return t.loss_used
        from strata.worker.models import loss_kind

        model = self.user_model()
        if getattr(model, "compiled", False) and getattr(model, "loss", None) is not None:
            return loss_kind(model.loss)
        return t.loss_used

    def param_count(self) -> int:
        model = getattr(self, "model", None)
        if model is not None and hasattr(model, "count_params"):
            return int(model.count_params())
        return self.profile.total_params if self.profile is not None else 0

    def user_model(self) -> Any:
        """The model ``code.model`` builds, under the strategy's scope (``self.strategy``) and
        the job's mixed precision policy (built once)."""
        if getattr(self, "_code_model", None) is None:
            import keras

            from strata.worker import models as wmodels
            from strata.worker.usercode import call, load_callable

            fn = load_callable(self.cfg, self.spec.code_model, "code.model")
            keras.utils.set_random_seed(self.seed)
            keras.mixed_precision.set_dtype_policy(wmodels.POLICIES[self.mixed])
            try:
                with self.strategy.scope():  # type: ignore[attr-defined]
                    model = call(self.spec.code_model, fn)
            finally:
                keras.mixed_precision.set_dtype_policy("float32")
            if not isinstance(model, keras.Model):
                raise TaskConfigError("code.model", f"{self.spec.code_model} returned "
                                                    f"{type(model).__name__}, not a keras.Model")
            inputs = getattr(model, "inputs", None)  # none: a subclassed model
            if not self.spec.code_dataset:
                if inputs is None:
                    raise TaskConfigError("code.model", f"{self.spec.code_model} returned a "
                                                        f"subclassed {type(model).__name__} "
                                                        "with no declared inputs; data.source "
                                                        "needs the input's shape: give "
                                                        "code.dataset, or build the model on "
                                                        "keras.Input")
                if len(inputs) != 1:
                    raise TaskConfigError("code.model", f"the model has {len(inputs)} inputs; "
                                                        "data.source gives one (use "
                                                        "code.dataset)")
            n_out = len(model.outputs) if getattr(model, "outputs", None) is not None else 1
            if not model.built:
                with self.strategy.scope():  # type: ignore[attr-defined]
                    n_out = len(self.tf.nest.flatten(self._build_on_dataset(model)))
            if n_out != 1:
                raise TaskConfigError("code.model", f"{self.spec.code_model} returned a model "
                                                    f"with {n_out} outputs; a job trains one "
                                                    "output with one loss (training.loss)")
            self._code_model = model
        return self._code_model

    def _build_on_dataset(self, model: Any) -> Any:
        """Creates the variables of a model that has none yet (a subclassed model never
        called): one call on a row of zeros shaped like the job's ``code.dataset`` features.
        Until then its ``trainable_variables`` are empty, and a step built on them would train
        nothing. Returns what the call returned."""
        from strata.worker.usercode import call, load_callable, user_dataset

        tf = self.tf
        what = self.spec.code_dataset
        fn = load_callable(self.cfg, what, "code.dataset")
        ctx = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                         num_replicas_in_sync=1)
        from strata.worker.usercode import DatasetCall

        features = user_dataset(tf, what, fn, ctx, "train", how=DatasetCall.of(fn, what),
                                global_batch=self.gb).element_spec[0]

        def zeros(spec: Any) -> Any:
            if not isinstance(spec, tf.TensorSpec):
                raise TaskConfigError("code.model", f"{self.spec.code_model} has no variables "
                                                    "until it is called, and code.dataset's "
                                                    f"features include {type(spec).__name__}, "
                                                    "which Strata cannot make a sample of: "
                                                    "build the model in code.model "
                                                    "(model.build or a first call)")
            shape = [1 if d is None else d for d in spec.shape]
            return tf.fill(shape, "") if spec.dtype == tf.string else tf.zeros(shape, spec.dtype)

        sample = tf.nest.map_structure(zeros, features)
        return call(f"{self.spec.code_model} (its first call, which creates its variables)",
                    lambda: model(sample, training=False))

    def check(self) -> None:
        """What can be checked before TensorFlow is imported (the contract against the model
        and ``TF_CONFIG``), so a bad config fails in milliseconds. Raises TaskConfigError."""

    def setup_device(self) -> None:
        """Imports TensorFlow and applies the device settings (before the runtime starts)."""
        self.tf, self.memory = configure_device(self.cfg)

    def join(self) -> dict[str, Any]:
        """Joins the job's cluster; returns the ``started`` event's fields."""
        raise NotImplementedError

    def build(self) -> None:
        """Builds the model, optimizer and input pipeline (``self.data`` is loaded)."""
        raise NotImplementedError

    def train_step(self, step: int) -> Callable[[], float]:
        """Runs one step; returns a function that reads its loss (reading may wait for it)."""
        raise NotImplementedError

    def eval_batch_size(self) -> int:
        return max(1, self.gb)

    def eval_batch(self, x: Any, y: Any) -> tuple[float, float]:
        """(summed loss, correct predictions) of one test batch."""
        raise NotImplementedError

    def result_fields(self) -> dict[str, Any]:
        """The ``result`` event's strategy fields: ``weights_sha256``, ``model_path``, ..."""
        raise NotImplementedError

    # -- checkpoint hooks (``strata.worker.checkpoints``)

    def checkpoint_writer(self) -> bool:
        """This task writes the job's checkpoints (the others of a multi-worker strategy only
        take part in each save)."""
        return True

    def agree_resume(self, found: Found | None) -> Found | None:
        """The checkpoint every task of the job resumes from, given the one this task found
        (the default: this task alone decides)."""
        return found

    def checkpoint_objects(self) -> dict[str, Any]:
        """What a checkpoint holds, by name: the model's variables, the optimizer(s), the
        strategy's own counters (called after ``build``)."""
        raise NotImplementedError

    def checkpoint_meta(self) -> dict[str, Any]:
        """A description of the writer's layout saved with every checkpoint."""
        return {"strategy": self.spec.strategy}

    def checkpoint_device(self) -> str | None:
        """Where the step counter lives (None: this process's default device)."""
        return None

    def restore_checkpoint(self, found: Found) -> int:
        """Restores ``found`` (a strategy whose layout can change overrides this)."""
        assert self.checkpointer is not None
        return self.checkpointer.restore(found)

    def largest_alloc_bytes(self) -> int:
        """The largest single allocation this task knows it makes, that a budget made from
        its peak must leave room for as one contiguous chunk: here its largest variable's
        gradient (0 before the model is built)."""
        return max(variable_bytes(getattr(self, "model", None)), default=0)

    def after_step(self, step: int) -> None:
        """Called once step ``step`` is done (all its collectives issued): saves a checkpoint
        when one is due."""
        c = self.checkpointer
        if c is not None and c.due(step):
            c.save(step)

    # -- the skeleton

    def train(self, steps: int) -> None:
        start = self.start_step
        progress = Progress(self.events, self.memory, steps, self.gb, self.cfg.report_interval_s,
                            self.memory_label, start=start, scalars=self.scalars)
        for step in range(start + 1, steps + 1):
            read_loss = self.train_step(step)
            if step == start + 1:
                progress.first_step()
            if progress.due(step):
                progress.report(step, read_loss())
            self.peaks.note(f"step {step}")
            self.after_step(step)
            self.peaks.note(f"checkpoint at step {step}")
            if self.checkpointer is not None and self.notice.due(step):
                self.stop_on_notice(step)

    def stop_on_notice(self, step: int) -> None:
        """A notice (``strata.worker.notice``): the checkpoint of step ``step`` is saved (unless
        it was just saved as due), then the task stops with ``TASK_EXIT_NOTICE``."""
        c = self.checkpointer
        assert c is not None
        if not c.due(step):
            c.save(step)
        log(f"notice: checkpoint at step {step} saved; stopping")
        exit_task(TASK_EXIT_NOTICE, self.events)

    def evaluate(self) -> tuple[float, float] | None:
        """(test loss, test accuracy), None when the job has no test split."""
        if hasattr(self, "_user_dataset"):
            return self.evaluate_stream()
        assert self.data is not None
        d = self.data
        total_loss, total_correct = 0.0, 0.0
        n_test = int(d.x_test.shape[0])
        bs = self.eval_batch_size()
        for i in range(0, n_test, bs):
            loss_sum, correct = self.eval_batch(d.x_test[i:i + bs], d.y_test[i:i + bs])
            total_loss += float(loss_sum)
            total_correct += float(correct)
            self.update_metrics(d.x_test[i:i + bs], d.y_test[i:i + bs])
        test_loss = total_loss / max(1, n_test)
        test_acc = total_correct / max(1, n_test) if d.classify else 0.0
        return test_loss, test_acc

    def evaluate_stream(self) -> tuple[float, float] | None:
        """The test split of a pipeline given as ``self._user_dataset`` (``(fn, what, how)``:
        the job's ``code.dataset`` called as ``how`` says, or a streamed source's
        ``(input_context, split)`` function, ``how`` None), whole, through
        ``self._eval_batch``. None for a function that gives no test split."""
        from strata.worker.usercode import user_dataset

        tf = self.tf
        user_fn, what, how = self._user_dataset  # type: ignore[attr-defined]
        if how is not None and not how.split:
            log(f"no test split: {what} takes no split argument; the job has no test figures")
            return None
        ctx = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                         num_replicas_in_sync=1)
        inputs = getattr(getattr(self, "model", None), "inputs", None)
        rank = len(inputs[0].shape) if inputs and len(inputs) == 1 else None
        # only the job's own function's errors are the user's (``call`` marks them so)
        ds = user_dataset(tf, what, user_fn, ctx, "test", loss=self.loss_kind(), how=how,
                          global_batch=self.eval_batch_size(), model_rank=rank,
                          batch=self.eval_batch_size()) \
            if self.spec.code_dataset \
            else user_fn(ctx, "test")
        # With sample weights (a code.dataset's third element), as Keras's evaluate: the loss
        # over the examples (the weighted sum over their number), accuracy over the weights.
        total_loss = total_correct = counted = 0.0
        n = 0
        for batch in ds:
            x, y, w = (*batch, None) if len(batch) == 2 else batch
            eval_batch = self._eval_batch  # type: ignore[attr-defined]
            loss_sum, correct = eval_batch(x, y) if w is None else eval_batch(x, y, w)
            self.update_metrics(x, y, w)
            total_loss += float(loss_sum)
            total_correct += float(correct)
            b = int(tf.shape(tf.nest.flatten(y)[0])[0])
            n += b
            counted += b if w is None else float(tf.reduce_sum(tf.cast(w, tf.float32)))
        assert self.data is not None
        acc = total_correct / counted if self.data.classify and counted > 0 else 0.0
        return total_loss / max(1, n), acc

    def update_metrics(self, x: Any, y: Any, w: Any = None) -> None:
        """One test batch into the compiled ``code.model``'s own metrics (``self.metrics``),
        when it has any: a forward pass of its own, in eager, on this task's copy."""
        if not self.metrics:
            return
        out = self.model(x, training=False)  # type: ignore[attr-defined]
        out = self.tf.cast(out, self.tf.float32)
        for m in self.metrics:
            m.update_state(y, out, sample_weight=w)

    def metric_results(self) -> dict[str, float]:
        out = {}
        for m in self.metrics:
            try:
                out[m.name] = float(m.result())
            except (TypeError, ValueError):  # a metric of several values: not reported
                continue
        return out

    def run(self) -> int:
        self._start_task()
        self.data = self.load()
        steps = self.data.steps
        if self.cfg.agent.output_dir and not self.cfg.probe:  # a probe keeps no outputs
            self.scalars = Scalars(self.tf, self.cfg)
        self._resume_point(steps)
        self._build_and_restore(steps)
        rows = (f"{self.data.n_train} train / {self.data.x_test.shape[0]} test rows"
                if self.data.x_train is not None else f"data from {self.spec.code_dataset}")
        log(f"training: {self.param_count():,} params, {steps} steps"
            + (f" (from step {self.start_step + 1})" if self.start_step else "")
            + f", global batch {self.gb}, {rows}, mixed precision {self.mixed}")
        self.peaks.note("build")
        t_train = time.time()
        self.train(steps)
        train_s = time.time() - t_train
        self._report_result(steps, train_s)
        # Leave from here, not by returning: returning frees the strategy, its iterators and
        # collective state, whose destructors talk to the cluster's coordination service. When
        # a peer has already exited that blocks ~10 s before failing.
        exit_task(TASK_EXIT_OK, self.events)
        return TASK_EXIT_OK  # not reached

    def _start_task(self) -> None:
        """Checks, the device, joining the cluster; the ``started`` event."""
        t0 = time.time()
        self.check()
        self.setup_device()
        started = self.join()
        install_sigterm_handler(self.events)
        self.events.emit("started", **started)
        log(f"started: {self.cfg.task_name} of job {self.cfg.job_id} ({self.spec.strategy}), "
            f"device {self.cfg.agent.device}, threads {self.cfg.agent.threads or 'default'}, "
            f"TF {self.tf.__version__} (import and join {time.time() - t0:.1f} s); "
            + ", ".join(f"{k} {v}" for k, v in started.items()))

    def _resume_point(self, steps: int) -> None:
        """With checkpoints: the checkpoint to resume from, agreed (``self.resume_from``), and
        the step ``build`` starts the input at."""
        if self.cfg.checkpoints_enabled:
            self.checkpointer = Checkpointer(self.cfg, self.events,
                                             writer=self.checkpoint_writer())
            self.resume_from = self.agree_resume(self.checkpointer.find())
            if self.resume_from is not None:
                # ``build`` starts the input where this step left it
                self.start_step = min(self.resume_from.step, steps)

    def _build_and_restore(self, steps: int) -> None:
        """``build``, what trains it and the notes reported, and the checkpoint restored."""
        try:
            self.build()
        except ModelSpecError as e:  # a model Keras refuses to build, optimizer, loss
            raise TaskConfigError(e.field, e.message) from None
        if self.training_text:  # what trains it, and where each part came from
            log(f"training with {self.training_text}")
            self.events.emit("setup", training=self.training_text)
        for note in self.notes:  # what the job's events should say of how it trains
            log(f"note: {note}")
            self.events.emit("note", message=note)
        if self.checkpointer is not None:
            self.checkpointer.attach(self.tf, self.checkpoint_objects(), self.checkpoint_meta(),
                                     self.checkpoint_device())
            if self.resume_from is not None:
                restored = self.restore_checkpoint(self.resume_from)
                self.start_step = min(restored, steps)
                if restored >= steps:
                    log(f"the checkpoint's step {restored} is at or past the planned {steps} "
                        "steps: nothing left to train")

    def _report_result(self, steps: int, train_s: float) -> None:
        """Evaluation, the outputs, the ``peaks`` and ``result`` events."""
        if self.spec.code_model and not self.metrics:
            from strata.worker.models import compiled_metrics

            self.metrics = compiled_metrics(self.user_model(), self.loss_kind())
        evaluated = self.evaluate()
        self.peaks.note("evaluation")
        test_loss, test_acc = evaluated if evaluated is not None else (None, None)
        fields = self.result_fields()
        self.peaks.note("outputs")
        log(self.peaks.summary())
        self.events.emit("peaks", grew=self.peaks.as_event(),
                         largest_alloc=self.largest_alloc_bytes())
        if self.metrics:
            fields["test_metrics"] = self.metric_results()
            log("test metrics (code.model's compile): " + ", ".join(
                f"{k} {v:.4f}" for k, v in fields["test_metrics"].items()))
        m = self.memory()
        if self.scalars is not None:
            self.scalars.write(steps, {"memory/peak_bytes": m["peak"]} if evaluated is None
                               else {"test/accuracy": test_acc, "test/loss": test_loss,
                                     "memory/peak_bytes": m["peak"]})
        self.events.emit("result", test_accuracy=test_acc, test_loss=test_loss, memory=m,
                         steps=steps, train_seconds=train_s, **fields)
        digest = str(fields.get("weights_sha256") or "")
        log("result: " + (f"test accuracy {test_acc:.4f} test loss {test_loss:.4f}"
                          if evaluated is not None else "no test split") + f" after {steps} "
            f"steps ({train_s:.1f} s); peak memory {format_mib(m['peak'])}; weights "
            f"{digest[:12]}" + (f"; saved {fields['model_path']}" if fields.get("model_path")
                                else ""))
