"""The driver of ``pipeline`` and ``hybrid`` jobs: GPipe model parallelism over TensorFlow's own
distributed runtime, run by the job's chief task (the ``pipeline`` and ``hybrid`` strategies'
runner for role ``chief``; ``PipelineDriver`` follows ``strata.worker.runner``'s skeleton).

Tasks and placement
-------------------
A job of ``S`` stages and ``R`` replicas (``pipeline``: R = 1) has ``R x S`` stage tasks. The
task config's ``stage_layout`` says which task holds replica r's stage s and its layers
``[first_layer, last_layer)`` (indices into ``strata.modelspec.profile_model``'s layers, as
``strata.planner`` split them). Replica 0's stage 0 is this process, the chief
(``/job:chief/replica:0/task:0``); every other stage is a ``worker:K`` task running
``worker.server`` (a plain ``tf.distribute.Server``). The chief connects to the cluster with
``tf.config.experimental_connect_to_cluster(..., job_name="chief")`` and then drives
everything: it never builds the whole model. Each stage's Keras layers are deserialized one by
one (the builtin MLP's layers, or the layer configs of a Sequential or linear Functional
``keras_json`` model) and created AND called under ``tf.device(<the stage's task>)``, so their
variables, their Keras optimizer (one per stage and replica, its slots next to the variables),
the forward and backward ops and the gradient accumulators all live on that task. What crosses
the wire is only: the input micro-batches (chief -> each replica's first stage; for replica 0
that is local), the labels (chief -> last stages), the activations at stage boundaries
(forward) and their gradients (backward), a few scalars (losses, the float16 finiteness
flags), and, with R > 1, each stage's accumulated gradient once per step from every replica's
task to the other replicas' tasks of that stage. The chief reads only its own allocator for
the ``memory`` it reports; each server reports its own (``worker.server``).

The training step (one ``tf.function``, GPipe)
----------------------------------------------
The chief draws the global batch (the training set stays a NumPy array in the chief's host
memory; each step's rows become one tensor there) and splits it into ``R x M`` micro-batches
of ``m`` rows; replica r takes micro-batches ``r*M .. r*M+M-1``. Every micro-batch goes
forward through the stages; the last stage computes the loss ``sum(per-example loss) /
(m * M)`` (the replica's mean loss); then the backward passes run in REVERSE micro-batch
order (GPipe: all forwards, then all backwards) and each stage sums its micro-batches'
parameter gradients into one accumulator, so the result is the gradient of the replica's mean
loss over its m x M rows. The optimizer step follows on every stage at once.
Control dependencies fix the order WITHIN a stage task (forward of micro-batch i after i-1;
backward of i after the accumulation of i+1, so one micro-batch's gradients are alive at a
time); nothing orders different tasks, so TensorFlow's executor runs stage s on micro-batch i
while stage s+1 works on i-1: the pipeline overlap comes from the dataflow graph itself.
``bench/pipeline_throughput.py`` measures it (and the bubble).

Hybrid (R > 1): the replicas start identical (replica 0's initial values are copied to the
others, seed-generator states excepted) and stay identical. The gradients are averaged per
stage ON THE STAGE'S OWN TASKS: every replica's task of stage s receives the other replicas'
accumulated gradients of that stage and computes ``add_n(all R, in replica order) / R`` (the
mean of the replicas' mean losses: the gradient of the mean loss over the global batch); the
same op on the same bits gives the same mean everywhere, and each replica's own optimizer
(identical state) applies it. Each task sums into its own accumulator only after the others
have received it, so every replica holds the same buffers (R gradient sizes at the peak; no
task is a hot spot; R - 1 transfers in and out per task: for R = 2 as cheap as a reduce and
broadcast through one task, and symmetric in memory, which keeps the planner's one estimate
per stage right for every replica). Non-trainable float state (BatchNormalization moving
statistics) is averaged on replica 0's task and assigned everywhere at the end of the step;
each replica's dropout seed state stays its own. Every step therefore leaves bit-identical
weights on all replicas; the ``result`` event carries one digest per replica
(``replica_weights_sha256``) so anyone can check.

Layer state: every layer with non-trainable variables (BatchNormalization statistics, a
Dropout seed) runs in a ``keras.StatelessScope`` with its state threaded from micro-batch to
micro-batch and written back once at the end of the step. This keeps recomputation exact
(below) and the replicas' averaging simple.

Activation recomputation (``memory.recompute``)
----------------------------------------------
Without it, each stage's forward for each micro-batch is recorded on a ``tf.GradientTape``
whose saved activations stay alive until that micro-batch's backward (all M micro-batches at
the peak, as GPipe). With it, the forward runs without a tape (its intermediate activations
are freed at once) and each stage keeps only its input per micro-batch; the backward re-runs
that micro-batch's forward under a tape from the kept input and the kept layer state, then
back-propagates: one micro-batch's activations at a time, for one more forward pass.
``tf.recompute_grad`` was tried first: it runs with Keras 3 layers on remote devices, but it
re-runs Dropout with the seed generator advanced (the recomputed mask differs from the one the
forward used, so the gradient is wrong) and would update BatchNormalization statistics twice;
the explicit form above replays the same state, so it is exact.

Mixed precision (``memory.mixed_precision``)
-------------------------------------------
Layers get the Keras ``mixed_bfloat16`` / ``mixed_float16`` policy as in ``worker.models``
(variables float32, compute 16-bit; the model's last layer float32 so logits and the loss
are float32), so boundary activations and their gradients cross the wire in 16 bits. Keras
casts a layer's weights to 16 bits on every call, and each micro-batch's tape would keep its
own copy until its backward pass (measured: 2 bytes per parameter per micro-batch); the step
instead casts each weight once and feeds that copy to every micro-batch (through the stateless
scope), differentiates with respect to it and casts the gradient back to float32, which is
exactly what the gradient of Keras' own cast does.
float16 needs loss scaling, and the scale must be ONE for the whole pipeline (a stage cannot
unscale by a factor another stage did not use), so instead of a ``LossScaleOptimizer`` per
stage the driver keeps one dynamic scale (a variable on the chief, Keras' defaults: 2**15,
halved on overflow, doubled after 2,000 finite steps): the last stage scales the loss, each
stage unscales its averaged gradient, and the step is applied on every stage only when all
gradients of all stages are finite.

Checkpoints
-----------
With ``checkpoint.every_steps`` (``strata.worker.checkpoints``) the driver saves every
replica's layers (by replica and layer name), every stage's optimizer and the float16 loss
scale at each multiple of ``every_steps``; the variables stay where they live and each stage
task writes its own shard to the shared storage (nothing is gathered on the chief). A resumed
driver fast-forwards ``_batch_indices`` by the restored step (the batches are a function of
``training.seed``), so a run resumed on the same layout ends bit-identical to an uninterrupted
one. On another replica count replica 0's layers and optimizers are restored into every
replica; on another stage split only the layers' weights are restored (by name) and the
optimizers start afresh.

Events and result
-----------------
As every training runner: ``started`` (cluster connected), ``first_step``, ``progress`` (the global
mean loss, examples/s, this chief's allocator memory), ``result`` (test accuracy and loss over
the full test split, evaluated through replica 0's pipeline; ``weights_sha256`` over replica
0's weights in layer order as float32 bytes, like ``strata.worker.trainers.data_parallel``; ``replica_weights_sha256``;
``model_path``: the whole model as one ``.keras`` file, assembled by the chief from replica
0's stages, each variable read a slice at a time (``worker.models.write_keras_file``: no task
ever holds the whole model, nor a whole remote kernel), then ``exit_task(0)``. Config problems raise ``TaskConfigError``; an out-of-memory op on any stage
reaches the chief as ``ResourceExhaustedError`` (checked), which ``strata.worker.task`` reports as
kind ``oom``.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass

from typing import Any, Callable

from strata.modelspec import ModelSpecError
from strata.taskconfig import PipelineSection, StageAssignment, TaskConfig, TaskConfigError
from strata.worker.cluster import cluster_from_tf_config, reachable
from strata.worker.events import Events, format_mib, log
from strata.worker.losses import eval_sums
from strata.worker.exchange import wire_dtype
from strata.worker.runner import TrainingRunner

CONNECT_TIMEOUT_S = 120.0          # STRATA_PIPELINE_CONNECT_TIMEOUT_S overrides
LOSS_SCALE_INITIAL = 2.0 ** 15     # float16: Keras LossScaleOptimizer's defaults
LOSS_SCALE_GROWTH_STEPS = 2000
HASH_CHUNK_ELEMS = 1 << 18         # weights are read for hashing 1 MiB at a time (chief memory)


# --------------------------------------------------------------------------------------------
# the layout (checked before TensorFlow is imported)


@dataclass(frozen=True)
class Layout:
    stages: int
    replicas: int
    microbatches: int
    microbatch: int
    places: dict

    def at(self, replica: int, stage: int) -> StageAssignment:
        return self.places[(replica, stage)]


def parse_layout(cfg: TaskConfig, layer_names: list[str],
                 cut_points: tuple[int, ...] | None = None) -> Layout:
    """The contract's pipeline section, checked against the spec and the model's layers (the
    one check on this side: a layout that does not match the model would train the wrong
    thing). Raises ``TaskConfigError``."""
    spec = cfg.spec
    p = cfg.section
    if not isinstance(p, PipelineSection):
        raise TaskConfigError("stage_layout", "the chief of a pipeline or hybrid job needs the pipeline "
                                    "section (stages, replicas, microbatches, layout)")
    for k in ("stages", "replicas", "microbatches", "microbatch"):
        if getattr(p, k) < 1:
            raise TaskConfigError(f"stage_layout.{k}", f"must be a positive integer, got {getattr(p, k)!r}")
    S, R, M, m = p.stages, p.replicas, p.microbatches, p.microbatch
    if spec.workers != R:
        raise TaskConfigError("stage_layout.replicas", f"{R} replicas, the spec has {spec.workers} workers")
    if spec.microbatches != M:
        raise TaskConfigError("stage_layout.microbatches", f"{M} differs from the spec's {spec.microbatches}")
    gb = spec.data.batch_size
    if m * M * R != gb:
        raise TaskConfigError("stage_layout.microbatch", f"{R} replicas x {M} micro-batches x {m} rows = "
                                               f"{R * M * m}, not the global batch {gb}")
    L = len(layer_names)
    if S > L:
        raise TaskConfigError("stage_layout.stages", f"{S} stages for a model of {L} layers")
    if len(p.layout) != R * S:
        raise TaskConfigError("stage_layout.layout", f"needs {R * S} entries ({R} replicas x {S} stages), "
                                           f"got {len(p.layout)}")
    places: dict = {}
    tasks_seen: set = set()
    for e in p.layout:
        r, s = e.replica, e.stage
        if not (0 <= r < R and 0 <= s < S):
            raise TaskConfigError("stage_layout.layout", f"entry has replica {r!r} stage {s!r}; replicas run "
                                               f"0..{R - 1}, stages 0..{S - 1}")
        if (r, s) in places:
            raise TaskConfigError("stage_layout.layout", f"replica {r} stage {s} appears twice")
        task = e.task_name
        if (r, s) == (0, 0) and task != "chief:0":
            raise TaskConfigError("stage_layout.layout", f"replica 0 stage 0 must be the chief (chief:0), "
                                               f"got {task!r}")
        if (r, s) != (0, 0) and e.role != "worker":
            raise TaskConfigError("stage_layout.layout", f"replica {r} stage {s} must be a worker task, "
                                               f"got {task!r}")
        if task in tasks_seen:
            raise TaskConfigError("stage_layout.layout", f"task {task} holds two stages")
        tasks_seen.add(task)
        a, b = e.first_layer, e.last_layer
        if not 0 <= a < b <= L:
            raise TaskConfigError("stage_layout.layout", f"replica {r} stage {s}: layers [{a!r}, {b!r}) are "
                                               f"not a non-empty range of 0..{L}")
        if tuple(e.layers) != tuple(layer_names[a:b]):
            raise TaskConfigError("stage_layout.layout", f"replica {r} stage {s}: layers {list(e.layers)} "
                                               f"are not the model's layers {a}..{b - 1} "
                                               f"{layer_names[a:b]}")
        places[(r, s)] = e
    for r in range(R):
        if places[(r, 0)].first_layer != 0 or places[(r, S - 1)].last_layer != L:
            raise TaskConfigError("stage_layout.layout", f"replica {r}'s stages must cover layers 0..{L - 1}")
        for s in range(S):
            here, base = places[(r, s)], places[(0, s)]
            if (here.first_layer, here.last_layer) != (base.first_layer, base.last_layer):
                raise TaskConfigError("stage_layout.layout", f"stage {s} has different layers on replica {r} "
                                                   "and replica 0")
            if s + 1 < S and here.last_layer != places[(r, s + 1)].first_layer:
                raise TaskConfigError("stage_layout.layout", f"replica {r}: stage {s + 1} does not start "
                                                   f"where stage {s} ends")
            if s + 1 < S and cut_points is not None and here.last_layer not in cut_points:
                raise TaskConfigError("stage_layout.layout", f"stage {s} ends after layer "
                                      f"{layer_names[here.last_layer - 1]!r}, where more than "
                                      "one tensor crosses (not a cut point of the model)")
    return Layout(S, R, M, m, places)


def read_cluster(layout: Layout) -> dict[str, list[str]]:
    cluster, role, index = cluster_from_tf_config()
    if (role, index) != ("chief", 0) or len(cluster.get("chief", [])) != 1:
        raise TaskConfigError("TF_CONFIG", f"the pipeline driver must be the one chief task (chief:0), "
                                     f"TF_CONFIG says {role}:{index}")
    for pl in layout.places.values():
        if pl.index >= len(cluster.get(pl.role, [])):
            raise TaskConfigError("TF_CONFIG", f"stage task {pl.task_name} (replica {pl.replica} stage "
                                         f"{pl.stage}) is not in the cluster")
    return cluster


# --------------------------------------------------------------------------------------------
# layers


def _layer_entries(model_spec: dict, mixed: str, names: list[str]) -> tuple[list, dict]:
    """One zero-argument factory per layer, in the profile's order (``names``), and how each
    layer is called (``strata.modelspec.layer_calls``: its inputs as ``TensorRef``)."""
    import keras

    from strata.modelspec import TensorRef, layer_calls, layer_entries
    from strata.worker.models import POLICIES, _policy_json

    policy = POLICIES[mixed]
    if model_spec.get("builtin"):
        b = model_spec["builtin"]
        shape = [int(d) for d in b["input_shape"]]
        out = []
        if len(shape) > 1:
            out.append(lambda: keras.layers.Flatten(name="flatten", dtype=policy))
        for i, units in enumerate(b["hidden"]):
            out.append(lambda i=i, u=int(units): keras.layers.Dense(
                u, activation="relu", name=f"hidden_{i}", kernel_initializer="he_uniform",
                dtype=policy))  # as worker.models builds the builtin MLP
        out.append(lambda: keras.layers.Dense(int(b["classes"]), name="logits", dtype="float32"))
        calls, prev = {}, "input"
        for n in names:
            calls[n] = ([TensorRef(prev)], {})
            prev = n
        return out, calls
    field = "model.keras_file" if model_spec.get("keras_file") else "model.keras_json"
    try:
        entries = layer_entries(model_spec)
        calls = layer_calls(model_spec)
    except ModelSpecError as e:
        raise TaskConfigError(e.field, e.message) from None
    out = []
    for i, name in enumerate(names):
        d = json.loads(json.dumps(entries[name]))
        if policy != "float32" and isinstance(d.get("config"), dict):
            # the output layer keeps float32 so outputs and the loss stay float32
            d["config"]["dtype"] = _policy_json("float32" if i == len(names) - 1 else policy)

        def make(d=d):
            try:
                layer = keras.saving.deserialize_keras_object(d, safe_mode=True)
            except Exception as e:  # Keras raises ValueError/TypeError for what it refuses
                raise TaskConfigError(field, f"Keras cannot build layer "
                                             f"{d.get('config', {}).get('name')!r}: "
                                             f"{type(e).__name__}: {e}") from None
            if not isinstance(layer, keras.layers.Layer):
                raise TaskConfigError(field, f"{d.get('class_name')} is not a layer")
            return layer
        out.append(make)
    return out, calls


def call_layer(layer, call: tuple, env: dict, training: bool):
    """Calls ``layer`` as the model's graph does, its input tensors taken from ``env`` (by
    ``TensorRef``); stores its output(s) in ``env`` and returns the first."""
    from strata.modelspec import TensorRef

    def sub(v):
        if isinstance(v, TensorRef):
            return env[str(v)]
        if isinstance(v, list):
            return [sub(x) for x in v]
        if isinstance(v, dict):
            return {k: sub(x) for k, x in v.items()}
        return v

    args, kwargs = call
    a = sub(args)
    kw = {k: v for k, v in sub(kwargs).items() if k != "training"}
    out = layer(*a, training=training, **kw)
    if isinstance(out, (list, tuple)):
        for i, t in enumerate(out):
            env[layer.name if i == 0 else f"{layer.name}:{i}"] = t
        return out[0]
    env[layer.name] = out
    return out


class Stage:
    """One stage task's share of one replica: its layers, variables and optimizer."""

    def __init__(self, place: StageAssignment, device: str, layers: list, calls: list,
                 input_ref: str):
        self.place = place
        self.device = device
        self.layers = layers
        self.calls = calls            # per layer: how the graph calls it (``call_layer``)
        self.input_ref = input_ref    # the one tensor entering the stage

        self.tvars = [v for l in layers for v in l.trainable_variables]
        # per layer: its non-trainable variables (BN statistics, seed generator states)
        self.nt = [list(l.non_trainable_variables) for l in layers]
        # mixed precision: the variables Keras would cast to the layer's compute dtype on every
        # call (as Layer.__call__'s AutocastScope does), with that dtype
        self.casts = {}
        for l in layers:
            if l.autocast and l.compute_dtype != l.variable_dtype and "float" in l.compute_dtype:
                for v in l.trainable_variables:
                    if getattr(v, "_autocast", False) and _is_float(v):
                        self.casts[id(v)] = l.compute_dtype
        self.optimizer = None


def _is_float(v) -> bool:
    return "float" in str(v.dtype)


# --------------------------------------------------------------------------------------------
# connecting


def connect(tf, cluster: dict, layout: Layout, timeout_s: float) -> float:
    """Connects the eager context to the cluster. ``experimental_connect_to_cluster`` returns
    at once; the context then blocks (GIL released) until every task answers, for ever, so the
    wait runs in a thread with a deadline. Returns the seconds it took."""
    t0 = time.time()
    deadline = t0 + timeout_s
    stage_addrs = {pl.task_name: cluster[pl.role][pl.index] for pl in layout.places.values()
                   if pl.role != "chief"}
    # first the cheap check: every stage server accepts TCP connections
    missing = dict(stage_addrs)
    last_log = 0.0
    while missing:
        missing = {t: a for t, a in missing.items() if not reachable(a, timeout=1.0)}
        if not missing:
            break
        now = time.time()
        if now >= deadline:
            raise RuntimeError(f"stage servers not reachable after {timeout_s:.0f} s: "
                               + ", ".join(f"{t} at {a}" for t, a in sorted(missing.items())))
        if now - last_log > 10:
            log(f"waiting for stage servers: {', '.join(sorted(missing))}")
            last_log = now
        time.sleep(0.25)
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster), job_name="chief")
    box: dict = {}

    def init() -> None:
        try:
            box["devices"] = tf.config.list_logical_devices()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            box["error"] = e

    th = threading.Thread(target=init, name="cluster-connect", daemon=True)
    th.start()
    th.join(max(1.0, deadline - time.time()))
    if th.is_alive():
        raise RuntimeError(f"could not connect to the cluster within {timeout_s:.0f} s (stage "
                           f"servers {', '.join(sorted(stage_addrs))} accept connections but "
                           "the TensorFlow runtime did not answer)")
    if "error" in box:
        raise box["error"]
    names = {d.name for d in box["devices"]}
    for pl in layout.places.values():
        want = f"/job:{pl.role}/replica:0/task:{pl.index}/"
        if not any(n.startswith(want) for n in names):
            raise RuntimeError(f"stage task {pl.task_name} has no device after connecting "
                               f"(devices: {sorted(names)})")
    return time.time() - t0


# --------------------------------------------------------------------------------------------
# the driver


class PipelineDriver(TrainingRunner):
    memory_label = "mem"

    def check(self) -> None:
        self.layer_names = [l.name for l in self.profile.layers]
        self.layout = parse_layout(self.cfg, self.layer_names, self.profile.cut_points)
        self.cluster = read_cluster(self.layout)

    def join(self) -> dict[str, Any]:
        tf, cfg, layout, cluster = self.tf, self.cfg, self.layout, self.cluster
        timeout = float(os.environ.get("STRATA_PIPELINE_CONNECT_TIMEOUT_S", CONNECT_TIMEOUT_S))
        waited = connect(tf, cluster, layout, timeout)
        kind = "GPU" if cfg.agent.device.startswith("GPU") else "CPU"
        self.dev_of = lambda pl: f"/job:{pl.role}/replica:0/task:{pl.index}/device:{kind}:0"
        self.chief_dev = self.dev_of(layout.at(0, 0))
        return {"stages": layout.stages, "replicas": layout.replicas,
                "microbatches": layout.microbatches, "microbatch": layout.microbatch,
                "recompute": self.spec.memory.recompute, "connect_s": round(waited, 1)}

    def build(self) -> None:
        import keras
        import numpy as np

        from strata.worker import models as wmodels

        tf, spec, profile, layout, d = self.tf, self.spec, self.profile, self.layout, self.data
        assert d is not None
        S, R, M, m = layout.stages, layout.replicas, layout.microbatches, layout.microbatch
        mixed, recompute, seed, gb = self.mixed, spec.memory.recompute, self.seed, self.gb
        wire = wire_dtype(tf, spec.gradients.compression)  # hybrid: the exchange's dtype
        layer_names, dev_of, chief_dev = self.layer_names, self.dev_of, self.chief_dev
        loss_name = spec.training.loss_used
        n_train = d.n_train

        # ---- layers, stage by stage (never the whole model in one place)
        keras.utils.set_random_seed(seed)
        factories, calls = _layer_entries(spec.model, mixed, layer_names)
        inputs = profile.model_inputs
        if len(inputs) != 1:
            raise TaskConfigError("model", f"the model has {len(inputs)} inputs; pipeline and "
                                           "hybrid jobs take one-input models")
        if len(factories) != len(layer_names):
            raise TaskConfigError("model", f"the model has {len(factories)} layers, its profile "
                                     f"{len(layer_names)}")
        stages: list[list[Stage]] = []
        for r in range(R):
            row = []
            h = tf.zeros((1,) + tuple(profile.input_shape), tf.float32)
            for s in range(S):
                pl = layout.at(r, s)
                dev = dev_of(pl)
                in_ref = inputs[0].name if pl.first_layer == 0 else \
                    layer_names[pl.first_layer - 1]
                with tf.device(dev):
                    layers = [factories[i]() for i in range(pl.first_layer, pl.last_layer)]
                    for layer in layers:
                        if getattr(layer, "activity_regularizer", None) is not None:
                            # its loss would be made inside the stage and dropped: refused
                            # rather than trained without it (weight regularizers are applied)
                            raise TaskConfigError("model", f"layer {layer.name!r} has an "
                                                           "activity_regularizer, which "
                                                           f"{spec.strategy} stages do not "
                                                           "apply; use multi_worker_mirrored "
                                                           "or remove it")
                    env = {in_ref: h}
                    for layer, want in zip(layers, pl.layers):
                        if layer.name != want:
                            raise TaskConfigError("stage_layout.layout", f"layer {layer.name!r} is where the "
                                                               f"layout has {want!r}")
                        # builds it here: its variables live on dev
                        h = call_layer(layer, calls[want], env, False)
                row.append(Stage(pl, dev, layers, [calls[n] for n in pl.layers], in_ref))
            stages.append(row)
        from_logits = _from_logits(spec.model)
        loss_fn = wmodels.build_loss(loss_name, from_logits)

        if spec.model.get("keras_file"):
            # the uploaded model's own weights, stage by stage, into replica 0 (copied below)
            try:
                wmodels.load_layer_weights([l for st in stages[0] for l in st.layers],
                                           spec.model, self.cfg.agent.blob_dir)
            except ModelSpecError as e:
                raise TaskConfigError(e.field, e.message) from None

        # replicas start identical: replica 0's values everywhere (seed states stay their own)
        for r in range(1, R):
            for s in range(S):
                src, dst = stages[0][s], stages[r][s]
                pairs = list(zip(src.tvars, dst.tvars)) + [
                    (a, b) for la, lb in zip(src.nt, dst.nt) for a, b in zip(la, lb) if _is_float(a)]
                with tf.device(dst.device):
                    for a, b in pairs:
                        b.assign(a)

        for row in stages:
            for st in row:
                with tf.device(st.device):
                    st.optimizer = wmodels.build_optimizer(spec.training.optimizer_used, "none")
                    st.optimizer.build(st.tvars)
        given = spec.training
        self.training_text = (
            f"optimizer {wmodels.describe_optimizer(stages[0][0].optimizer)} (one per stage) "
            f"from {'training.optimizer' if given.optimizer else 'the defaults'}; loss "
            f"{loss_name} (from_logits={from_logits}) from "
            f"{'training.loss' if given.loss else 'the defaults'}")

        scaled = mixed == "float16"
        with tf.device(chief_dev):
            loss_scale = tf.Variable(LOSS_SCALE_INITIAL, dtype=tf.float32, trainable=False,
                                     name="loss_scale")
            good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="good_steps")
        # a resumed driver's batches start where the restored step left them
        batches = _batch_indices(n_train, gb, seed, skip=self.start_step)
        self.loss_scale, self.good_steps = loss_scale, good_steps

        per_replica = m * M
        for s in range(S):
            pl = layout.at(0, s)
            n_params = sum(int(np.prod(v.shape)) for l in stages[0][s].layers for v in l.weights)
            log(f"stage {s}: layers {pl.first_layer}-{pl.last_layer - 1} ({pl.layers[0]} .. "
                f"{pl.layers[-1]}), "
                f"{n_params:,} params on {', '.join(stages[r][s].place.task_name for r in range(R))}"
                f"; estimate {format_mib(pl.estimated_memory_bytes)}, budget "
                f"{format_mib(pl.memory_budget_bytes)}")

        def run_layers(st: Stage, h, nt_vals, casts: dict, training: bool):
            """The stage's layers on ``h``. Layers with state run statelessly from ``nt_vals``
            (one list per layer) and return their new state; the variables are not touched.
            ``casts`` maps id(variable) to its 16-bit copy for this step (mixed precision)."""
            new = []
            env = {st.input_ref: h}
            for layer, call, vars_, vals in zip(st.layers, st.calls, st.nt, nt_vals):
                raw = [(v, casts[id(v)]) for v in layer.trainable_variables if id(v) in casts]
                if vars_ or raw:
                    scope = keras.StatelessScope(list(zip(vars_, vals)))
                    # StatelessScope casts mapped values back to the variable's dtype; the 16-bit
                    # copy goes in as it is (Keras' autocast then leaves it alone)
                    for v, val in raw:
                        scope.state_mapping[id(v)] = val
                    with scope:
                        h = call_layer(layer, call, env, training)
                    new.append([scope.get_current_value(v) for v in vars_])
                else:
                    h = call_layer(layer, call, env, training)
                    new.append([])
            return h, new

        def with_weight_regularizers(st: Stage, g: list) -> list:
            """``g`` (the step's mean gradients of ``st.tvars``) plus the gradients of the
            stage's weight regularizers (``kernel_regularizer`` and the like), once a step, as
            Keras's fit adds them to the mean loss."""
            regs = [(k, v) for k, v in enumerate(st.tvars)
                    if getattr(v, "regularizer", None) is not None]
            if not regs:
                return g
            with tf.GradientTape() as rt:
                vals = [tf.convert_to_tensor(v.value) for _, v in regs]
                rt.watch(vals)
                terms = [v.regularizer(val) for (_, v), val in zip(regs, vals)]
            out = list(g)
            for (k, _), d in zip(regs, rt.gradient(terms, vals)):
                if d is not None:
                    out[k] = out[k] + tf.cast(d, out[k].dtype)
            return out

        def mb_loss(out, y):
            per_example = loss_fn(y, tf.cast(out, tf.float32))
            return tf.reduce_sum(per_example) / float(per_replica)

        @tf.function
        def train_step(x, y):
            with tf.device(chief_dev):
                xs = tf.split(x, R * M)
                ys = tf.split(y, R * M)
                scale = loss_scale.read_value() if scaled else None
            losses = []
            acc = [[None] * S for _ in range(R)]
            nt_final = [[None] * S for _ in range(R)]
            for r in range(R):
                row = stages[r]
                state, casts, sources = [], [], []
                for st in row:
                    with tf.device(st.device):
                        state.append([[v.value for v in vs] for vs in st.nt])
                        # one 16-bit copy of each weight per step, shared by the micro-batches
                        # (Keras would cast on every call, and each micro-batch's tape would keep
                        # its own copy until its backward pass)
                        c = {id(v): tf.cast(v.value, st.casts[id(v)]) for v in st.tvars
                             if id(v) in st.casts}
                    casts.append(c)
                    sources.append([c.get(id(v), v) for v in st.tvars])
                saved = {}
                prev = [None] * S
                # forward: micro-batch i through every stage; in order within a stage
                for i in range(M):
                    h = xs[r * M + i]
                    y_mb = ys[r * M + i]
                    for s, st in enumerate(row):
                        last = s == S - 1
                        deps = [prev[s]] if prev[s] is not None else []
                        with tf.device(st.device), tf.control_dependencies(deps):
                            h_in = tf.identity(h)
                            nt_in = state[s]
                            loss = target = None
                            if recompute:
                                tape = None
                                out, state[s] = run_layers(st, h_in, nt_in, casts[s], True)
                                if last:
                                    loss = mb_loss(out, y_mb)
                            else:
                                tape = tf.GradientTape()
                                with tape:
                                    tape.watch(list(casts[s].values()) + ([h_in] if s > 0 else []))
                                    out, state[s] = run_layers(st, h_in, nt_in, casts[s], True)
                                    if last:
                                        loss = mb_loss(out, y_mb)
                                        target = loss * scale if scaled else loss
                        saved[(s, i)] = (h_in, nt_in, tape, out, loss, target)
                        prev[s] = loss if last else out
                        h = out
                    losses.append(saved[(S - 1, i)][4])
                # backward: reverse micro-batch order (GPipe); one micro-batch's grads at a time
                done = {}  # (s, i): stage s has summed micro-batch i's gradients
                sent_back = {}  # (s, i): the gradient of stage s's input for micro-batch i
                for i in reversed(range(M)):
                    dy = None
                    y_mb = ys[r * M + i]
                    for s in reversed(range(S)):
                        st = row[s]
                        last = s == S - 1
                        h_in, nt_in, tape, out, loss, target = saved.pop((s, i))
                        deps = list(acc[r][s]) if acc[r][s] is not None else []
                        if (s, i + 1) in sent_back:
                            # and for the gradient of its input that the previous micro-batch
                            # sends back: the weights' gradients can be summed before it is
                            # made, and this micro-batch's backward would run beside it.
                            # Measured on conv-small's last stage (max pool, dense; hybrid
                            # 2 x 2, batch 128): 60-81 MiB against a 65 MiB estimate and an
                            # 82 MiB budget before, 51-57 after; pipeline throughput 0.90-1.03
                            # of the unheld one on 2 cores
                            deps.append(sent_back[(s, i + 1)])
                        if recompute and not deps:
                            # the first re-run waits for the stage's last forward: its input
                            # is there from the start (the first stage's) or early, and run
                            # beside the forwards its activations would sit on top of theirs.
                            # It cannot finish before that anyway (its output gradient comes
                            # after every forward), so this costs no time.
                            deps = [prev[s]]
                        if s > 0 and (s - 1, i + 2) in done:
                            # the gradient this sends back waits until the stage below has
                            # finished micro-batch i + 2. A stage receives its output's
                            # gradients as soon as they are made (TF posts every Recv at the
                            # start of the step), so without this a lagging stage collects
                            # all M of them; with it, at most two (the one it is working on
                            # and the next), which is what the stage estimate counts
                            # (``strata.stagememory``). Before this and the re-run's wait
                            # above, a recomputing first stage once peaked 6.5 MiB over its
                            # estimate (three of its 1024 x 512 gradients' worth). In GPipe's
                            # schedule the stage below finished i + 2 a slot before this
                            # starts; measured on 2 cores, 0.93-1.0 of the throughput without
                            # it (one small control message per micro-batch and stage).
                            deps.append(done[(s - 1, i + 2)])
                        with tf.device(st.device), tf.control_dependencies(deps):
                            if recompute:
                                # re-run this micro-batch's forward from its kept input and state
                                tape = tf.GradientTape()
                                with tape:
                                    tape.watch(list(casts[s].values()) + ([h_in] if s > 0 else []))
                                    out, _ = run_layers(st, h_in, nt_in, casts[s], True)
                                    if last:
                                        rl = mb_loss(out, y_mb)
                                        target = rl * scale if scaled else rl
                            if last:
                                out_grad = None
                            else:
                                target, out_grad = out, dy
                            grads = tape.gradient(target, ([h_in] if s > 0 else []) + sources[s],
                                                  output_gradients=out_grad)
                            if s > 0:
                                dy, grads = grads[0], grads[1:]
                                sent_back[(s, i)] = dy
                            # float32 gradients (a 16-bit copy's gradient cast back, as the
                            # gradient of Keras' own cast would be)
                            grads = [tf.zeros_like(v) if g is None else
                                     tf.cast(tf.convert_to_tensor(g), v.dtype)
                                     for g, v in zip(grads, st.tvars)]
                            acc[r][s] = grads if acc[r][s] is None else \
                                [a + g for a, g in zip(acc[r][s], grads)]
                            if s < S - 1:
                                done[(s, i)] = tf.group(*acc[r][s])
                for s in range(S):
                    nt_final[r][s] = state[s]

            # average over the replicas: every replica's task of a stage receives the others'
            # accumulated gradients and sums all R in replica order (the same op on the same
            # values: bit-identical means, and the same memory on every replica); unscale.
            # gradients.compression: they travel as 16 bits, and each task sums the 16-bit
            # values (its own too, rounded alike) cast back to float32
            means = [[None] * S for _ in range(R)]
            finite = []
            for s in range(S):
                sent = [acc[r][s] for r in range(R)]  # as they travel, on their own tasks
                if wire is not None and R > 1:
                    for r in range(R):
                        with tf.device(stages[r][s].device):
                            sent[r] = [tf.cast(t, wire) for t in acc[r][s]]
                got = {}  # (q, r): replica r's accumulated gradients as received on q's task
                # a replica's gradients go to q only once q has summed its own micro-batches:
                # TF posts every Recv at the start of the step, so a gradient sent as soon as
                # it is ready lands beside q's backward pass (its gradient, accumulator and
                # their sum), one gradient size over the estimate. Measured on the first stage
                # of 784-4096-32-4096-10, hybrid 2 x 2, three runs of four configurations: up to
                # 1.23 x its estimate (81.0 of an 83 MiB budget) before, at most 0.94 after;
                # throughput of a 2 x 2 hybrid of 1024-wide layers 0.98 of the ungated one
                ready = []
                for q in range(R):
                    with tf.device(stages[q][s].device):
                        ready.append(tf.group(*acc[q][s]))
                for q in range(R):
                    for r in range(R):
                        if r == q:
                            continue
                        with tf.device(stages[r][s].device), \
                                tf.control_dependencies([ready[q]]):
                            out = [tf.identity(t) for t in sent[r]]
                        with tf.device(stages[q][s].device):
                            got[(q, r)] = [tf.identity(t) for t in out]
                    if sent[q] is not acc[q][s]:
                        with tf.device(stages[q][s].device):
                            dtypes = [t.dtype for t in acc[q][s]]
                            acc[q][s] = [tf.cast(t, d) for t, d in zip(sent[q], dtypes)]
                            for r in range(R):
                                if r != q:
                                    got[(q, r)] = [tf.cast(t, d)
                                                   for t, d in zip(got[(q, r)], dtypes)]
                for q in range(R):
                    st = stages[q][s]
                    with tf.device(st.device):
                        g = []
                        for k in range(len(st.tvars)):
                            if R == 1:
                                g.append(acc[q][s][k])
                                continue
                            # sum into our own accumulator only once the others have it: then
                            # nothing else holds it and the sum reuses its buffer (R gradient
                            # buffers here at the peak, on every replica alike)
                            sent = [got[(r, q)][k] for r in range(R) if r != q]
                            with tf.control_dependencies(sent):
                                terms = [acc[q][s][k] if r == q else got[(q, r)][k]
                                         for r in range(R)]
                                g.append(tf.add_n(terms) * (1.0 / R))
                        if scaled:
                            inv = 1.0 / scale
                            g = [t * inv for t in g]
                            finite.append(tf.reduce_all(
                                [tf.reduce_all(tf.math.is_finite(t)) for t in g]))
                        g = with_weight_regularizers(st, g)
                    means[q][s] = g

            if scaled:
                with tf.device(chief_dev):
                    ok = tf.reduce_all(tf.stack(finite))
            for r in range(R):
                for s in range(S):
                    st = stages[r][s]
                    with tf.device(st.device):
                        if scaled:
                            def apply(st=st, g=means[r][s]):
                                st.optimizer.apply_gradients(zip(g, st.tvars))
                                return tf.constant(True)
                            tf.cond(ok, apply, lambda: tf.constant(False))
                        else:
                            st.optimizer.apply_gradients(zip(means[r][s], st.tvars))
            # layer state: float state averaged over the replicas, seed states each their own
            for s in range(S):
                home = stages[0][s]
                for li, vars_ in enumerate(home.nt):
                    for k, v in enumerate(vars_):
                        vals = [nt_final[r][s][li][k] for r in range(R)]
                        if R > 1 and _is_float(v):
                            with tf.device(home.device):
                                mean = tf.add_n(vals) * (1.0 / R)
                            vals = [mean] * R
                        for r in range(R):
                            with tf.device(stages[r][s].device):
                                stages[r][s].nt[li][k].assign(vals[r])
            with tf.device(chief_dev):
                total = tf.add_n(losses) * (1.0 / R)
                if scaled:
                    grow = tf.logical_and(ok, good_steps + 1 >= LOSS_SCALE_GROWTH_STEPS)
                    new_scale = tf.where(ok, tf.where(grow, loss_scale * 2.0, loss_scale),
                                         tf.maximum(loss_scale * 0.5, 1.0))
                    loss_scale.assign(new_scale)
                    good_steps.assign(tf.where(ok, tf.where(grow, tf.constant(0, tf.int64),
                                                            good_steps + 1),
                                               tf.constant(0, tf.int64)))
            return total

        last_dev = stages[0][-1].device

        @tf.function(reduce_retracing=True)
        def eval_batch(x, y):
            # through replica 0's pipeline, whole batches, no micro-batching
            h = x
            for st in stages[0]:
                with tf.device(st.device):
                    env = {st.input_ref: h}
                    for layer, call in zip(st.layers, st.calls):
                        h = call_layer(layer, call, env, False)
            with tf.device(last_dev):
                out = tf.cast(h, tf.float32)
                return eval_sums(tf, loss_fn, y, out, d.classify)

        self.stages, self.batches = stages, batches
        self._train_step, self._eval_batch = train_step, eval_batch
        self.per_replica = per_replica

    # -- checkpoints

    def _layer_objects(self, r: int, saved_replica: int) -> dict[str, Any]:
        """Replica ``r``'s layers under the names replica ``saved_replica``'s were saved as."""
        return {f"r{saved_replica}_{layer.name}": layer
                for st in self.stages[r] for layer in st.layers}

    def _optimizer_objects(self, r: int, saved_replica: int) -> dict[str, Any]:
        return {f"r{saved_replica}_s{s}_optimizer": st.optimizer
                for s, st in enumerate(self.stages[r])}

    def checkpoint_objects(self) -> dict[str, Any]:
        out: dict[str, Any] = {"loss_scale": self.loss_scale, "good_steps": self.good_steps}
        for r in range(len(self.stages)):
            out.update(self._layer_objects(r, r))
            out.update(self._optimizer_objects(r, r))
        return out

    def _split(self) -> list[list[int]]:
        return [[st.place.first_layer, st.place.last_layer] for st in self.stages[0]]

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"strategy": self.spec.strategy, "stages": self.layout.stages,
                "replicas": self.layout.replicas, "split": self._split()}

    def checkpoint_device(self) -> str | None:
        return "/job:chief/replica:0/task:0/device:CPU:0"  # the step counter: on the chief

    def restore_checkpoint(self, found: Any) -> int:
        c = self.checkpointer
        assert c is not None
        meta = c.read_meta(self.tf, found)
        same_split = meta.get("split") in (None, self._split())
        if same_split and meta.get("replicas") in (None, self.layout.replicas):
            return c.restore(found)
        views = []
        for r in range(len(self.stages)):
            view = {"loss_scale": self.loss_scale, "good_steps": self.good_steps}
            view.update(self._layer_objects(r, 0))
            if same_split:
                view.update(self._optimizer_objects(r, 0))
            views.append(view)
        log(f"the checkpoint was written by {meta.get('replicas')} replicas of stages "
            f"{meta.get('split')}; this job has {self.layout.replicas} of {self._split()}: "
            "replica 0's " + ("layers and optimizers go" if same_split else
                              "layers' weights go (the optimizers start afresh)")
            + " to every replica")
        return c.restore(found, views)

    def train_step(self, step: int) -> Callable[[], float]:
        tf = self.tf
        assert self.data is not None
        idx = next(self.batches)
        with tf.device(self.chief_dev):
            xb = tf.constant(self.data.x_train[idx])
            yb = tf.constant(self.data.y_train[idx])
        total = self._train_step(xb, yb)
        return lambda: float(total)

    def eval_batch_size(self) -> int:
        return max(1, self.per_replica)

    def eval_batch(self, x: Any, y: Any) -> tuple[float, float]:
        tf = self.tf
        with tf.device(self.chief_dev):
            xb, yb = tf.constant(x), tf.constant(y)
        loss_sum, correct = self._eval_batch(xb, yb)
        return float(loss_sum), float(correct)

    def result_fields(self) -> dict[str, Any]:
        import numpy as np

        digests = [_digest(self.tf, np, row) for row in self.stages]
        R = self.layout.replicas
        same = "identical" if len(set(digests)) == 1 else "DIFFERENT"
        from strata.worker import models as wmodels

        model_path = None
        if not self.cfg.probe:  # a memory probe keeps figures, no model
            out_dir = self.cfg.agent.output_dir or os.getcwd()
            os.makedirs(out_dir, exist_ok=True)
            model_path = os.path.abspath(os.path.join(out_dir, "model.keras"))
            # the whole model, assembled from replica 0's stages a slice at a time
            wmodels.write_keras_file(model_path, self.spec.model,
                                     [(st.device, st.layers) for st in self.stages[0]], self.tf)
        log(f"weights {digests[0][:12]}" + (f" ({R} replicas {same})" if R > 1 else "")
            + (f"; model assembled from the {self.layout.stages} stages: {model_path}"
               if model_path else ""))
        return {"weights_sha256": digests[0], "replica_weights_sha256": digests,
                "model_path": model_path}


def run_driver(cfg: TaskConfig, events: Events) -> int:
    return PipelineDriver(cfg, events).run()


def _batch_indices(n: int, batch: int, seed: int, skip: int = 0):
    """Endless global batches of row indices: every pass over the training set in a fresh
    random order, batches running on across passes (as ``worker.data.make_train_dataset``).
    ``skip``: batches left out first (a resumed driver; a function of ``seed`` alone, so the
    batches are those an uninterrupted run would draw next).
    The training set stays a NumPy array on the host; only each step's batch becomes a
    tensor, so the chief's allocator holds input batches, not the data set (a tf.data
    pipeline over the whole set as a constant holds it twice while its iterator is made)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    pending = np.empty(0, dtype=np.int64)
    for _ in range(skip):  # permutations only: cheap
        while pending.size < batch:
            pending = np.concatenate([pending, rng.permutation(n)])
        pending = pending[batch:]
    while True:
        while pending.size < batch:
            pending = np.concatenate([pending, rng.permutation(n)])
        idx, pending = pending[:batch], pending[batch:]
        yield np.sort(idx)


def _from_logits(model_spec: dict) -> bool:
    from strata.modelspec import final_activation

    return final_activation(model_spec) != "softmax"


def _digest(tf, np, row: list[Stage]) -> str:
    """SHA-256 over the replica's weights in layer order as float32 bytes (as
    ``strata.worker.trainers.data_parallel`` hashes ``model.weights``). Remote weights come over in chunks so the chief never holds a
    whole remote kernel."""
    h = hashlib.sha256()
    for st in row:
        for layer in st.layers:
            for w in layer.weights:
                n = int(np.prod(w.shape)) if len(w.shape) else 1
                with tf.device(st.device):
                    flat = tf.reshape(w.value, [-1])
                    for a in range(0, n, HASH_CHUNK_ELEMS):
                        piece = flat[a:a + HASH_CHUNK_ELEMS]
                        h.update(np.ascontiguousarray(
                            np.asarray(piece.numpy(), dtype=np.float32)).tobytes())
    return h.hexdigest()
