"""The evaluation task interface: one definition per task, from which the suite section, the
``rope-extend eval TASK`` command and the report's tables and plots all come (as lm-eval's ``LM`` and
``@register_model``).

A task is a ``Task``: a name, an options dataclass whose fields carry their help (``schema.option``), and
four functions:

- ``run(model, tokenizer, options, context) -> records``: the measurement, one record per trial, appended to
  ``context.records`` as it goes (``evaluation.runner``); each record's ``task`` is the task's name;
- ``summarize(records) -> {section: rows}``: the task's records (all runs) as summary rows;
- ``render(summary) -> lines``: its markdown from the summary (empty when its sections are absent);
- ``plot(summary, out) -> {name: path}``: its pictures (none by default).

``TASKS.register(task)`` adds it (``TASKS`` is a ``rope_extend.registry.Registry``); from then on a suite takes
a section of that name, ``rope-extend eval`` has a subcommand of that name, and reports show it. Options that
subclass ``TextOptions`` read texts (the one document reader) before the model is loaded, so bad data fails early.

The built-in tasks are ``passkey``, ``niah``, ``perplexity`` and ``ruler``: one module each
(``evaluation.passkey``, ``evaluation.niah``, ``evaluation.perplexity``, ``evaluation.ruler.harness``) holding
the task's options dataclass, its harness (which takes those options: ``options=``, or keywords built into them by
``options_for``) and its ``TASK``, listed in ``TASKS`` by module path, so that their names are known before their
modules are imported. The layers point one way: a task module imports this package, which never imports a task
(as lm-evaluation-harness's registry never imports a model it lists by path).

This package imports neither torch nor transformers, nor any task.
"""

from .base import (
    READING,
    TASKS,
    WINDOW_HELP,
    Context,
    Task,
    TextOptions,
    check_lengths,
    check_positive,
    get_task,
    load_task_texts,
    options_for,
    register_task,
    tasks,
    unregister_task,
)

__all__ = [
    "READING",
    "TASKS",
    "WINDOW_HELP",
    "Context",
    "Task",
    "TextOptions",
    "check_lengths",
    "check_positive",
    "get_task",
    "load_task_texts",
    "options_for",
    "register_task",
    "tasks",
    "unregister_task",
]
