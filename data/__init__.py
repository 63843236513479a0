"""TRACE data: task table, loader, metrics and the embedded synthetic benchmark."""

from data.tasks import TASK_ORDER, TASKS, Task, get_task, parse_tasks
from data.trace import Example, filter_overlong, filter_report, load_task, read_trace_file
from data.metrics import METRICS, acc_bwt, sari, score

__all__ = ["TASK_ORDER", "TASKS", "Task", "get_task", "parse_tasks", "Example", "filter_overlong", "filter_report",
           "load_task", "read_trace_file", "METRICS", "acc_bwt", "sari", "score"]
