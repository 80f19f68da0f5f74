"""The job and task lifecycles: every edge of the transition tables, legal and illegal."""

import itertools

import pytest

from strata.types import JOB_TRANSITIONS, TASK_TRANSITIONS, JobState, TaskState, can_transition

LEGAL_JOB = {
    (JobState.PENDING, JobState.SCHEDULED), (JobState.PENDING, JobState.FAILED),
    (JobState.PENDING, JobState.CANCELLED), (JobState.SCHEDULED, JobState.RUNNING),
    (JobState.SCHEDULED, JobState.SUCCEEDED), (JobState.SCHEDULED, JobState.FAILED),
    (JobState.SCHEDULED, JobState.CANCELLED), (JobState.RUNNING, JobState.SUCCEEDED),
    (JobState.RUNNING, JobState.FAILED), (JobState.RUNNING, JobState.CANCELLED),
    # restarts: a failed task stops the rest; the job is placed again, or given up
    (JobState.SCHEDULED, JobState.RESTARTING), (JobState.RUNNING, JobState.RESTARTING),
    (JobState.RESTARTING, JobState.SCHEDULED), (JobState.RESTARTING, JobState.FAILED),
    (JobState.RESTARTING, JobState.CANCELLED),
}


@pytest.mark.parametrize("a,b", list(itertools.product(JobState, JobState)),
                         ids=lambda s: s.value)
def test_job_edge(a, b):
    assert can_transition(a, b) == ((a, b) in LEGAL_JOB)


def test_final_job_states_have_no_way_out():
    for s in JobState:
        assert s.final == (not JOB_TRANSITIONS[s])


@pytest.mark.parametrize("a,b", list(itertools.product(TaskState, TaskState)), ids=lambda s: s.value)
def test_task_edge(a, b):
    forward = [TaskState.PENDING, TaskState.STARTING, TaskState.RUNNING]
    if a.final or a == b:
        expected = False
    elif b.final:
        expected = True
    else:
        expected = forward.index(b) > forward.index(a)
    assert can_transition(a, b) == expected


def test_every_state_has_a_row():
    assert set(JOB_TRANSITIONS) == set(JobState)
    assert set(TASK_TRANSITIONS) == set(TaskState)
