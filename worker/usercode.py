"""Users' own code in a task process (``code:`` in the job spec).

The job's project directory arrives as a ``.tar.gz`` the agent fetched (``BLOB_DIR/SHA.tar.gz``);
it is unpacked once into the task's working directory (``code/DIR_NAME``: members may not
leave it, links are dropped) and put first on ``sys.path``, so ``train:build_model`` imports
``train`` from it. Anything the user's code raises, on import or in the call, becomes a
``UserCodeError``: the task reports it as its own failure kind (``user_code``) with the
traceback of the user's frames, and exits with ``TASK_EXIT_USER_CODE``.

Only a coordinator started with ``--allow-user-code`` hands out such tasks; the agent runs
them like any other task process, with the same memory budget and no more privileges.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import sys
import tarfile
import traceback
from typing import Any, Callable

from strata.taskconfig import TaskConfig, TaskConfigError
from strata.worker.failures import is_oom


class UserCodeError(Exception):
    """The job's own code raised. ``str()`` is one line; ``details`` the user's traceback."""

    def __init__(self, what: str, exc: BaseException):
        self.what = what
        frames = traceback.extract_tb(exc.__traceback__)
        # the user's frames only: Strata's own call into it says nothing to them
        mine = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        user = [f for f in frames if not os.path.abspath(f.filename).startswith(mine)]
        self.details = "".join(traceback.format_list(user or frames)) + "".join(
            traceback.format_exception_only(type(exc), exc))
        where = f" at {os.path.basename(user[-1].filename)}:{user[-1].lineno}" if user else ""
        super().__init__(f"{what} raised {type(exc).__name__}: {exc}{where}")


def code_dir(cfg: TaskConfig) -> str:
    """The unpacked project directory (unpacked on first use)."""
    code = cfg.spec.code
    dest = os.path.abspath(os.path.join("code", os.path.basename(str(code["dir_name"])) or "code"))
    if os.path.isdir(dest):
        return dest
    archive = os.path.join(cfg.agent.blob_dir or ".", f"{code['sha256']}.tar.gz")
    if not os.path.isfile(archive):
        raise TaskConfigError("code.dir", f"the agent has no copy of the uploaded code ({archive})")
    tmp = dest + ".part"
    os.makedirs(tmp, exist_ok=True)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for m in tar.getmembers():
                target = os.path.abspath(os.path.join(tmp, m.name))
                if not target.startswith(os.path.abspath(tmp) + os.sep) or not (
                        m.isfile() or m.isdir()):
                    continue  # outside the directory, a link or a device: never unpacked
                if m.isdir():
                    os.makedirs(target, exist_ok=True)
                    continue
                os.makedirs(os.path.dirname(target), exist_ok=True)
                src = tar.extractfile(m)
                if src is None:
                    continue
                with src, open(target, "wb") as out:
                    while True:
                        data = src.read(1 << 20)
                        if not data:
                            break
                        out.write(data)
    except (tarfile.TarError, OSError) as e:
        raise TaskConfigError("code.dir", f"cannot unpack the uploaded code: {e}") from None
    os.replace(tmp, dest)
    return dest


def load_callable(cfg: TaskConfig, ref: str, field: str) -> Callable[..., Any]:
    """``module:function`` from the job's code."""
    path = code_dir(cfg)
    if path not in sys.path:
        sys.path.insert(0, path)
    module_name, _, fn_name = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name or module_name.startswith(f"{e.name}."):
            raise TaskConfigError(field, f"no module {module_name!r} in "
                                         f"{cfg.spec.code['dir_name']}") from None
        raise UserCodeError(f"importing {module_name}", e) from None
    except Exception as e:  # noqa: BLE001 - the user's module failed to import
        raise UserCodeError(f"importing {module_name}", e) from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise TaskConfigError(field, f"{module_name} has no function {fn_name!r}")
    return fn


def call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, whatever it raises the user's failure (``UserCodeError``),
    but for running out of memory: that is the task's budget, not the code (a model built in
    a probe's first small budget: ``Coordinator._grow_probe`` gives the next probe more)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever the user's code raises is its failure
        if is_oom(e):
            raise
        raise UserCodeError(what, e) from None


def failed_batch_check(e: BaseException) -> str | None:
    """The words of ``user_dataset``'s check on each batch when ``e`` (TensorFlow's error, its
    assertion's message in brackets) is that check failing; else None."""
    m = re.search(r"\[(code\.dataset: [^\]]*)\]", str(e))
    return m.group(1) if m else None


#: parameter names that mean "the ``tf.distribute.InputContext``"
CONTEXT_NAMES = ("input_context", "context", "ctx", "input_ctx", "inputcontext")


@dataclasses.dataclass(frozen=True)
class DatasetCall:
    """How a ``code.dataset`` function is called, read off its parameters, as
    ``tf.distribute`` users write them:

    - ``(input_context, split)``, or ``(input_context)``: the function builds each replica's
      input (``distribute_datasets_from_function``): it shards by the context and batches by
      ``input_context.get_per_replica_batch_size(...)``;
    - ``(batch_size)`` (one parameter that is not a context: TensorFlow's multi-worker tutorial
      writes ``mnist_dataset(global_batch_size)``), or no parameter: the function builds the
      whole input (``experimental_distribute_dataset``), its batches the global batch; the
      strategy shards it across the workers (its auto-shard policy) and splits each batch
      among the replicas.

    Either may yield elements not yet batched; Strata batches them (per replica, or by the
    global batch). A function that takes ``split`` (a parameter of that name, or a second
    one) is called for ``"train"`` and ``"test"``; one that does not gives the training data
    only, and the job has no test figures."""

    context: bool
    batch: bool
    split: str  # "": takes none; "keyword": split=...; "positional": a second argument

    @classmethod
    def of(cls, fn: Callable[..., Any], what: str) -> "DatasetCall":
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            return cls(context=True, batch=False, split="positional")  # as before
        required = [p for p in params if p.default is p.empty and p.kind in (
            p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        others = [p for p in required if p.name != "split"]
        if any(p.name == "split" for p in params):
            split = "keyword"
        elif len(others) == 2:
            split, others = "positional", others[:1]
        else:
            split = ""
        if len(others) > 1:
            raise TaskConfigError("code.dataset", f"{what} takes {len(required)} arguments; a "
                                                  "dataset function takes an input_context (or "
                                                  "the batch size, or nothing), and the split")
        first = others[0] if others else None
        context = first is not None and (first.name.lower() in CONTEXT_NAMES
                                         or "InputContext" in str(first.annotation)
                                         or split == "positional")
        return cls(context=context, batch=first is not None and not context, split=split)

    def call(self, fn: Callable[..., Any], what: str, ctx: Any, split: str,
             global_batch: int) -> Any:
        args: list[Any] = [ctx] if self.context else [global_batch] if self.batch else []
        if self.split == "positional":
            return call(what, fn, *args, split)
        if self.split == "keyword":
            return call(what, fn, *args, split=split)
        return call(what, fn, *args)


def batched(tf: Any, ds: Any, model_rank: int | None, batch: int) -> tuple[Any, bool]:
    """``ds`` batched by ``batch`` if its elements are single examples (their features one
    axis short of the model's input); returns it and whether it was batched here."""
    if model_rank is None:
        return ds, False
    features = tf.nest.flatten(ds.element_spec[0] if isinstance(ds.element_spec, tuple)
                               else ds.element_spec)[0]
    rank = features.shape.rank
    if rank is not None and rank == model_rank - 1:
        return ds.batch(batch, drop_remainder=True), True
    return ds, False


def reads_whole(tf: Any, ds: Any) -> bool:
    """Whether nothing in ``ds``'s pipeline shards it and the strategy is told not to
    (``AutoShardPolicy.OFF``) or cannot (a function's per-replica input): every worker then
    reads all of it. Looks for a ``shard`` among the pipeline's stages (``_inputs``: TF's
    own walk; a TF without it says nothing)."""
    def sharded(d: Any, depth: int = 0) -> bool:
        if depth > 500:
            return True
        if "Shard" in type(d).__name__:
            return True
        inputs = getattr(d, "_inputs", None)
        try:
            return any(sharded(x, depth + 1) for x in (inputs() if inputs else []))
        except Exception:  # noqa: BLE001 - an internal walk: unknown means "do not warn"
            return True
    return not sharded(ds)


def user_dataset(tf: Any, what: str, fn: Callable[..., Any], ctx: Any, split: str,
                 max_rows: int | None = None, loss: str = "",
                 how: DatasetCall | None = None, global_batch: int = 0,
                 model_rank: int | None = None, batch: int = 0) -> Any:
    """The job's ``code.dataset`` called for ``split``, checked to be what Keras's ``fit``
    takes: a ``tf.data.Dataset`` of ``(features, labels)`` or ``(features, labels,
    sample_weights)`` batches (features and labels may be dicts or tuples of tensors). Anything
    else fails the task as BAD_CONFIG naming ``code.dataset`` and what the elements were, before
    a step is traced.

    With ``max_rows`` (the batch the task's memory was planned for), a batch of more rows is
    refused too: when its size is in the dataset's type, here (BAD_CONFIG); otherwise by a
    check on each batch, which fails the step with the same words. A larger batch would run
    past the budget's plan and end as an out-of-memory failure that hides the cause.

    With ``loss`` (``training.loss``), labels of the other cross-entropy's kind (one-hot rows
    for the sparse one, class indices for the other) are refused naming ``training.loss``,
    rather than failing inside the traced step in TensorFlow's words.

    ``how`` says how the function is called (``DatasetCall``; by default ``(input_context,
    split)``), with ``global_batch`` for one that takes the batch size. Elements that are
    single examples (features one axis short of ``model_rank``, the model's input's) are
    batched here by ``batch``."""
    how = how or DatasetCall(context=True, batch=False, split="positional")
    ds = how.call(fn, what, ctx, split, global_batch)
    if not isinstance(ds, tf.data.Dataset):
        raise TaskConfigError("code.dataset", f"{what} returned {type(ds).__name__} for the "
                                              f"{split!r} split, not a tf.data.Dataset")
    spec = ds.element_spec
    if not isinstance(spec, tuple) or len(spec) not in (2, 3):
        got = f"tuples of {len(spec)}" if isinstance(spec, tuple) else type(spec).__name__
        raise TaskConfigError("code.dataset", f"{what} for the {split!r} split yields {got}, "
                                              "not (features, labels) or (features, labels, "
                                              "sample_weights) batches")
    if batch:
        ds, _ = batched(tf, ds, model_rank, batch)
        spec = ds.element_spec
    _check_labels(what, split, spec[1], loss)
    if max_rows is None:
        return ds
    advice = (f"batches of at most {max_rows} rows are planned for: batch by "
              + ("input_context.get_per_replica_batch_size(data.batch_size)" if how.context
                 else "data.batch_size, the global batch"))
    first = tf.nest.flatten(spec[1])[0]
    rows = first.shape[0] if first.shape.rank else None
    if rows is not None and rows > max_rows:
        raise TaskConfigError("code.dataset", f"{what} yields batches of {rows} rows for the "
                                              f"{split!r} split; {advice}")
    if rows is not None:
        return ds

    def check(*element: Any) -> Any:
        n = tf.shape(tf.nest.flatten(element[1])[0])[0]
        with tf.control_dependencies([tf.debugging.assert_less_equal(
                n, tf.constant(max_rows, n.dtype),
                message=f"code.dataset: {what} yielded a batch of more rows than planned; "
                        f"{advice}")]):
            return tf.nest.map_structure(tf.identity, element)
    return ds.map(check)


def _check_labels(what: str, split: str, labels: Any, loss: str) -> None:
    """One-hot rows are float (``tf.one_hot``, ``to_categorical``); integer labels of rank 2
    may be a sequence's class indices, which the sparse loss takes, so only float ones are
    judged one-hot."""
    shape = getattr(labels, "shape", None)
    if shape is None or shape.rank is None or not shape.rank:
        return
    last = shape[-1] if shape.rank >= 2 else None
    where = f"{what} yields labels of shape {[d for d in shape]} for the {split!r} split"
    if loss == "sparse_categorical_crossentropy" and last is not None and last > 1 \
            and labels.dtype.is_floating:
        raise TaskConfigError("training.loss", f"{where}: one-hot rows, but "
                                               "sparse_categorical_crossentropy takes class "
                                               "indices; set training.loss: "
                                               "categorical_crossentropy")
    if loss == "categorical_crossentropy" and (shape.rank == 1 or last == 1):
        raise TaskConfigError("training.loss", f"{where}: class indices, but "
                                               "categorical_crossentropy takes one-hot rows; set "
                                               "training.loss: sparse_categorical_crossentropy")
