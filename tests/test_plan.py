"""`strata plan` for pipeline and hybrid specs over real agents' free budgets (no TF started)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from strata.local import LocalCluster

pytestmark = pytest.mark.integration  # starts coordinator, agent or TensorFlow processes

MiB = 1 << 20
DEEP = {
    "name": "deep", "strategy": "pipeline", "stages": 0, "microbatches": 8,
    "model": {"builtin": {"kind": "mlp", "input_shape": [784], "hidden": [2048] * 8, "classes": 10}},
    "data": {"source": "synthetic", "batch_size": 256}, "training": {"steps": 10},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(workers=4, memory_budget="400MiB", state_dir=str(tmp_path_factory.mktemp("plan")))
    c.start()
    yield c
    c.stop()


def plan(cluster, tmp_path, *sets):
    path = tmp_path / "deep.json"
    path.write_text(json.dumps(DEEP))
    r = subprocess.run([sys.executable, "-m", "strata.cli", "plan", str(path), "--json",
                        "--coordinator", cluster.address, *[a for s in sets for a in ("--set", s)]],
                       capture_output=True, text=True, timeout=60)
    assert "Traceback" not in r.stderr
    return r.returncode, (json.loads(r.stdout) if r.stdout.strip() else None), r.stderr


def test_pipeline_plan_fits_every_stage_on_its_own_worker(cluster, tmp_path):
    rc, p, _ = plan(cluster, tmp_path)
    assert rc == 0 and p["feasible"], p
    stages = sorted(p["tasks"], key=lambda t: t["stage"])
    assert 2 <= len(stages) <= 4
    assert len({t["worker"] for t in stages}) == len(stages)
    layers = [name for t in stages for name in t["layers"]]
    assert layers == [f"dense_{i}" for i in range(8)] + ["logits"] or len(layers) == 9
    for t in stages:
        assert t["estimated_memory_bytes"] <= t["memory_budget_bytes"] <= 400 * MiB


def test_mirrored_refuses_what_the_pipeline_plan_holds(cluster, tmp_path):
    rc, p, _ = plan(cluster, tmp_path, "strategy=multi_worker_mirrored", "stages=0", "microbatches=1")
    assert rc == 1 and not p["feasible"] and "fits no worker" in p["reason"]
    # the refusal names the pipeline depth whose stages would fit
    assert "it fits as a pipeline: strategy: pipeline, stages: 3" in p["reason"], p["reason"]


def test_hybrid_and_infeasible_plans(cluster, tmp_path):
    rc, p, _ = plan(cluster, tmp_path, "strategy=hybrid", "workers=2", "stages=2",
                    "model.builtin.hidden=[2048, 2048, 2048, 2048, 2048]")
    assert rc == 0 and p["feasible"], p
    assert len(p["tasks"]) == 4 and len({t["worker"] for t in p["tasks"]}) == 4
    assert sorted(t["stage"] for t in p["tasks"]) == [0, 0, 1, 1]
    rc, p, _ = plan(cluster, tmp_path, "stages=6")
    assert rc == 1 and not p["feasible"] and "4" in p["reason"]
    rc, p, err = plan(cluster, tmp_path, "microbatches=7")
    assert rc == 2 and "microbatches" in err
