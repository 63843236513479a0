"""data/tasks.py: TRACE's task table (order, metrics, epochs) and task lists parsed from the command line. A
manifest's own tasks: test_manifest.py."""
import pytest

from data.metrics import METRICS
from data.tasks import TASK_ORDER, TASKS, parse_tasks


def test_task_table():
    assert TASK_ORDER == ["C-STANCE", "FOMC", "MeetingBank", "Py150", "ScienceQA", "NumGLUE-cm", "NumGLUE-ds",
                          "20Minuten"]
    assert [TASKS[t].epochs for t in TASK_ORDER] == [5, 3, 7, 5, 3, 5, 5, 7]
    assert all(TASKS[t].metric in METRICS for t in TASK_ORDER)
    assert parse_tasks("FOMC,NumGLUE-cm") == ["FOMC", "NumGLUE-cm"]
    assert parse_tasks(" fomc , 20minuten ") == ["FOMC", "20Minuten"]
    assert parse_tasks(None) == TASK_ORDER and parse_tasks("all") == TASK_ORDER
    with pytest.raises(ValueError, match=r"unknown task 'FOMX'.*valid tasks: C-STANCE, FOMC"):
        parse_tasks("FOMC,FOMX")
    with pytest.raises(ValueError, match="twice"):
        parse_tasks("FOMC,FOMC")
