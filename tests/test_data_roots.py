"""--data-root through a real cluster: a job reads its data only inside the agent's data
roots, a path outside is refused at submit whether or not the file exists (the same words),
and a link inside a root that leads outside fails the task before it opens anything."""

from __future__ import annotations

import os

import numpy as np
import pytest

from strata.client import JobRejected
from strata.local import LocalCluster
from strata.types import FailureKind, JobState

pytestmark = pytest.mark.integration

TIMEOUT_S = 240


def _npz(path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    np.savez(path, x_train=x[:192], y_train=y[:192], x_test=x[192:], y_test=y[192:])


def spec(path: str) -> dict:
    return {"name": "roots", "workers": 1,
            "model": {"builtin": {"kind": "mlp", "input_shape": [8], "hidden": [8],
                                  "classes": 2}},
            "data": {"source": "npz", "path": path, "batch_size": 64},
            "training": {"steps": 3}}


def test_data_is_read_only_inside_the_data_roots(tmp_path):
    root, outside = tmp_path / "data", tmp_path / "private"
    root.mkdir(), outside.mkdir()
    _npz(root / "ok.npz")
    _npz(outside / "secret.npz")
    os.symlink(outside / "secret.npz", root / "link.npz")
    c = LocalCluster(workers=1, state_dir=str(tmp_path / "cluster"), threads=1,
                     data_roots=[str(root)])
    c.start()
    try:
        with c.client() as client:
            assert client.workers()[0].data_roots == [str(root)]
            refusals = set()
            for path in (outside / "secret.npz", outside / "no-such-file.npz",
                         root / ".." / "private" / "secret.npz"):
                with pytest.raises(JobRejected) as e:
                    client.submit(spec(str(path)))
                assert e.value.field == "data.path"
                refusals.add(str(e.value))
            assert len(refusals) == 1, refusals          # existence is never told
            assert "data roots" in refusals.pop()
            # lexically inside, but the link leads out: the task refuses before reading
            job = client.wait(client.submit(spec(str(root / "link.npz"))).id, timeout=TIMEOUT_S)
            assert job.state == JobState.FAILED
            task = job.tasks[0]
            assert task.failure == FailureKind.BAD_CONFIG, job.message
            assert "data.path" in job.message and "data roots" in job.message
            assert "secret" not in job.message
            ok = client.wait(client.submit(spec(str(root / "ok.npz"))).id, timeout=TIMEOUT_S)
            assert ok.state == JobState.SUCCEEDED, ok.message
    finally:
        c.stop()
