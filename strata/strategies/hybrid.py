"""``hybrid``: data-parallel replicas of a pipeline.

``workers`` replicas of the same stage split (``strata.strategies.pipeline``), each replica's
stages on their own workers; the driver averages every stage's gradients over the replicas on
the stages' own tasks, so the replicas stay bit-identical. Everything else is the pipeline's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from strata.errors import SpecError
from strata.strategies import register
from strata.strategies.pipeline import Pipeline

if TYPE_CHECKING:
    from strata.jobspec import JobSpec


@register
class Hybrid(Pipeline):
    name = "hybrid"
    elastic = True
    summary = "data-parallel replicas of a pipeline"
    fields = Pipeline.fields | {"gradients.compression"}

    def validate(self, spec: JobSpec) -> None:
        # any number of replicas; an elastic job's replicas are of one split, so its depth is
        # given: a resize changes how many replicas run, never the stages of one
        if spec.elastic and spec.stages < 1:
            raise SpecError("stages", "an elastic hybrid job names its stages (workers: {min, "
                                      "max} counts replicas of that many stages)")

    def batch_share(self, spec: JobSpec) -> str:
        return f"{spec.data.batch_size // max(1, spec.workers)} examples per replica"

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
