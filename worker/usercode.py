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

import importlib
import os
import re
import sys
import tarfile
import traceback
from typing import Any, Callable

from strata.taskconfig import TaskConfig, TaskConfigError


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


def call(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - whatever the user's code raises is its failure
        raise UserCodeError(what, e) from None


def failed_batch_check(e: BaseException) -> str | None:
    """The words of ``user_dataset``'s check on each batch when ``e`` (TensorFlow's error, its
    assertion's message in brackets) is that check failing; else None."""
    m = re.search(r"\[(code\.dataset: [^\]]*)\]", str(e))
    return m.group(1) if m else None


def user_dataset(tf: Any, what: str, fn: Callable[..., Any], ctx: Any, split: str,
                 max_rows: int | None = None, loss: str = "") -> Any:
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
    rather than failing inside the traced step in TensorFlow's words."""
    ds = call(what, fn, ctx, split)
    if not isinstance(ds, tf.data.Dataset):
        raise TaskConfigError("code.dataset", f"{what} returned {type(ds).__name__} for the "
                                              f"{split!r} split, not a tf.data.Dataset")
    spec = ds.element_spec
    if not isinstance(spec, tuple) or len(spec) not in (2, 3):
        got = f"tuples of {len(spec)}" if isinstance(spec, tuple) else type(spec).__name__
        raise TaskConfigError("code.dataset", f"{what} for the {split!r} split yields {got}, "
                                              "not (features, labels) or (features, labels, "
                                              "sample_weights) batches")
    _check_labels(what, split, spec[1], loss)
    if max_rows is None:
        return ds
    advice = (f"batches of at most {max_rows} rows are planned for: batch by "
              "input_context.get_per_replica_batch_size(data.batch_size)")
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
