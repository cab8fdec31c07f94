"""Tasks with verifiable rewards, looked up by name in a registry."""
from streamrl.tasks.registry import Problem, Task, available_tasks, get_task, register_task

# Importing the modules registers their tasks.
from streamrl.tasks import arithmetic, digits  # noqa: E402,F401

__all__ = ["Problem", "Task", "available_tasks", "get_task", "register_task"]
