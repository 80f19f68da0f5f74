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
    from strata.spec import JobSpec


@register
class Hybrid(Pipeline):
    name = "hybrid"
    summary = "data-parallel replicas of a pipeline"

    def validate(self, spec: JobSpec) -> None:
        pass  # any number of replicas
