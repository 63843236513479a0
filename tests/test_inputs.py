"""pipeline/inputs.py: the epochs of each stage from a preset's table, --epochs' comma list or the task table."""
import pytest


def test_epochs_per_task_reads_a_presets_table_a_comma_list_or_the_task_table():
    """A preset's {task: epochs} follows the tasks by name whatever their order, the task table filling in tasks it
    does not name; --epochs' comma list is one value for all or one per task in the order given."""
    from common.errors import UserError
    from pipeline.inputs import epochs_per_task
    from run import PRESETS
    tiny = PRESETS["tiny"].epochs
    assert epochs_per_task(tiny, ["NumGLUE-ds", "20Minuten", "FOMC"]) == {"NumGLUE-ds": 10, "20Minuten": 3, "FOMC": 6}
    assert epochs_per_task({"FOMC": 9}, ["FOMC", "Py150"]) == {"FOMC": 9, "Py150": 5}  # Py150: the task table's 5
    assert epochs_per_task(None, ["C-STANCE", "ScienceQA"]) == {"C-STANCE": 5, "ScienceQA": 3}
    assert epochs_per_task("4", ["FOMC", "Py150"]) == {"FOMC": 4, "Py150": 4}
    assert epochs_per_task("4,7", ["Py150", "FOMC"]) == {"Py150": 4, "FOMC": 7}
    with pytest.raises(UserError, match="3 values for 2 tasks"):
        epochs_per_task("1,2,3", ["FOMC", "Py150"])
    # the default: the letter and arithmetic tasks at twice the task table's epochs, the generative ones at 3
    from data.tasks import TASKS
    assert {t: tiny[t] for t in TASKS} == {t: 3 if TASKS[t].metric in ("rouge_l", "code_fuzz", "sari")
                                          else 2 * TASKS[t].epochs for t in TASKS}
    assert PRESETS["tiny"].first_epochs == 24
