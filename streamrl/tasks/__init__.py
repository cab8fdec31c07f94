"""Tasks with verifiable rewards, looked up by name in a registry."""
from streamrl.tasks.registry import Problem, Task, available_tasks, build_task, get_task, register_task

# Importing the modules registers their tasks (reasoning imports reasoning-gym only when used).
from streamrl.tasks import arithmetic, digits, long_sequence, reasoning  # noqa: E402,F401

__all__ = ["Problem", "Task", "available_tasks", "build_task", "get_task", "register_task"]
