"""``hybrid``: data-parallel replicas of a pipeline.

``workers`` replicas of the same stage split (``strata.strategies.pipeline``), each replica's
stages on their own workers; the driver averages every stage's gradients over the replicas on
the stages' own tasks, so the replicas stay bit-identical. Everything else is the pipeline's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from strata.strategies import register
from strata.strategies.pipeline import Pipeline

if TYPE_CHECKING:
    from strata.jobspec import JobSpec


@register
class Hybrid(Pipeline):
    name = "hybrid"
    summary = "data-parallel replicas of a pipeline"
    fields = Pipeline.fields | {"gradients.compression"}

    def validate(self, spec: JobSpec) -> None:
        pass  # any number of replicas

    def narrow(self, spec: JobSpec, workers: int) -> JobSpec:
        # fewer replicas of the same split, the global batch kept: a replica needs a worker per
        # stage and a batch share that its microbatches divide (with the planner choosing the
        # depth, the depth is not known here: the job waits for its workers instead)
        import dataclasses

        if spec.stages < 1:
            return spec
        most = workers // spec.stages
        if most >= spec.workers or most < 1:
            return spec
        fits = [r for r in range(1, most + 1)
                if spec.data.batch_size % (r * max(1, spec.microbatches)) == 0]
        return dataclasses.replace(spec, workers=max(fits)) if fits else spec
