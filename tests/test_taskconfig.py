"""The task contract: one typed, versioned message, passed through by the agent, read once."""

from __future__ import annotations

import json

import pytest

from strata import convert
from strata.protos import strata_pb2 as pb
from strata.spec import parse_job_spec
from strata.taskconfig import (
    TASK_CONFIG_VERSION,
    AgentSettings,
    ParameterServerSection,
    PipelineSection,
    StageAssignment,
    TaskConfig,
    TaskConfigError,
)
from strata.convert import read_task_config, write_task_config

SPEC = parse_job_spec({"name": "p", "strategy": "pipeline", "stages": 2, "microbatches": 2,
                       "model": {"builtin": {"hidden": [16, 16]}}, "data": {"batch_size": 8},
                       "training": {"steps": 3}})
PIPE = TaskConfig(
    job_id="p-1", role="chief", index=0, spec=SPEC, memory_budget_bytes=64 << 20,
    section=PipelineSection(stages=2, replicas=1, microbatches=2, microbatch=4, layout=(
        StageAssignment(0, 0, "chief", 0, 0, 2, ("hidden_0", "hidden_1"), 10, 20),
        StageAssignment(0, 1, "worker", 0, 2, 3, ("logits",), 5, 6))))


@pytest.mark.parametrize("config", [
    PIPE,
    TaskConfig(job_id="x", role="ps", index=1, spec=SPEC,
               section=ParameterServerSection({"hidden_0": 0, "logits": 1}, (1, 2))),
    TaskConfig(job_id="x", role="worker", index=0, spec=SPEC, agent=AgentSettings("/o", 2, "GPU:0")),
])
def test_round_trip(config):
    assert convert.task_config_from_proto(convert.task_config_to_proto(config)) == config


def test_the_agent_changes_only_its_own_settings():
    msg = convert.task_config_to_proto(PIPE)
    out = convert.with_agent_settings(msg, AgentSettings("/work/out", 1, "CPU"))
    assert out.agent.output_dir == "/work/out" and out.agent.threads == 1
    out.ClearField("agent")
    before = pb.TaskConfig()
    before.CopyFrom(msg)
    before.ClearField("agent")
    assert out == before
    assert msg.agent.output_dir == ""  # the coordinator's message is untouched


def test_read_binary_and_json_forms(tmp_path):
    path = str(tmp_path / "c.pb")
    write_task_config(path, PIPE)
    assert read_task_config(path) == PIPE
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"version": TASK_CONFIG_VERSION, "job_id": "j", "role": "worker",
                             "index": 0, "spec": SPEC.to_dict(),
                             "agent": {"threads": 3}}))
    cfg = read_task_config(str(j))
    assert cfg.agent.threads == 3 and cfg.agent.device == "CPU"
    assert cfg.report_interval_s == TaskConfig.report_interval_s  # one default, in one place


@pytest.mark.parametrize("body,field", [
    ({"version": TASK_CONFIG_VERSION + 1}, "version"),
    ({"version": TASK_CONFIG_VERSION, "spec": {"name": "a", "strategy": "warp"}}, "strategy"),
    ({"version": TASK_CONFIG_VERSION, "bogus": 1}, "--config"),
])
def test_unreadable_configs_name_the_field(tmp_path, body, field):
    j = tmp_path / "c.json"
    j.write_text(json.dumps(body))
    with pytest.raises(TaskConfigError) as e:
        read_task_config(str(j))
    assert e.value.field == field, e.value
    with pytest.raises(TaskConfigError) as e:
        read_task_config(str(tmp_path / "missing.pb"))
    assert e.value.field == "--config"


@pytest.mark.parametrize("raw", [
    {"name": "a", "model": {"builtin": {"hidden": [8]}}},
    {"name": "b", "strategy": "parameter_server", "parameter_servers": 2, "workers": 3,
     "data": {"source": "synthetic", "examples": 512, "batch_size": 96},
     "training": {"optimizer": {"name": "sgd", "learning_rate": 0.1}, "steps": 7, "seed": 3},
     "memory": {"per_task_budget": "64MiB", "mixed_precision": "bfloat16"},
     "model": {"builtin": {"hidden": [8, 4]}}},
    {"name": "c", "strategy": "hybrid", "workers": 2, "stages": 2, "microbatches": 4,
     "memory": {"recompute": True}, "checkpoint": {"every_steps": 5},
     "restart": {"max_restarts": 2}, "model": {"builtin": {"hidden": [8, 8]}}},
])
def test_an_accepted_spec_decodes_without_validation(raw):
    spec = parse_job_spec(raw)
    assert convert.accepted_spec_from_proto(convert.spec_to_proto(spec)) == spec
    assert convert.spec_from_proto(convert.spec_to_proto(spec)) == spec
