"""The stage layout of a ``pipeline`` or ``hybrid`` job, as the chief's driver
(``strata.worker.trainers.gpipe``) takes it: the task config's pipeline section checked against
the job spec, the model's layers (and cut points) and ``TF_CONFIG``'s cluster. ``parse_layout``
and ``read_cluster`` raise ``TaskConfigError``; nothing here imports TensorFlow.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.taskconfig import PipelineSection, StageAssignment, TaskConfig, TaskConfigError
from strata.worker.cluster import cluster_from_tf_config


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
