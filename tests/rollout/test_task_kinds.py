"""How tasks are told apart in a run's logs: the ``kind`` tag of a trajectory (``reward/<kind>``
per step) and the start-up report of the tasks a backend cannot run."""

from __future__ import annotations

from types import SimpleNamespace

from miles_engine.environments.admission import ExcludedTask, TaskAdmission
from miles_engine.rollout.episodes import task_tags


def test_kind_is_the_tasks_own_else_the_task_set_it_came_from():
    assert task_tags(SimpleNamespace(metadata={"kind": "calc", "source": "drills", "difficulty": 2})) == {
        "kind": "calc", "difficulty": "2"}
    assert task_tags(SimpleNamespace(metadata={"source": "harbor"})) == {"kind": "harbor"}
    assert task_tags(SimpleNamespace(metadata={})) == {}
    assert task_tags(object()) == {}


def test_a_task_listed_many_times_is_reported_once_with_its_count():
    admission = TaskAdmission("mixture", "docker", admitted=["0/a"])
    admission.excluded += [ExcludedTask(f"1/gpu{f'#{k}' if k else ''}", "backend", "needs 1 GPU(s)") for k in range(5)]
    admission.excluded += [ExcludedTask("1/steps", "unsupported", "multi-step"),
                           ExcludedTask("1/steps#1", "unsupported", "multi-step")]
    report = admission.report(limit=1).splitlines()
    assert report[0] == ("environment 'mixture': 7 of 8 task(s) excluded on sandbox backend 'docker' "
                         "(5 the backend cannot run, 2 unsupported); 1 left")
    assert report[1] == "  - 1/gpu (listed 5 times) [backend]: needs 1 GPU(s)"
    assert report[2] == "  … and 1 more excluded task(s)"
    assert admission.report().splitlines()[2] == "  - 1/steps (listed 2 times) [unsupported]: multi-step"
    assert admission.metrics()["environment/tasks_excluded"] == 7.0
