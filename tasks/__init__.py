"""
The tasks, one file each, for one kind of model and data: tasks/base.py holds the contract (Task); lm.py,
masked_lm.py, seq2seq.py and chat.py the tasks. A task is found by its file
name (TASKS, config.Plugins), and only the task a run names is imported: to add one, add a file (docs/training.md,
"Tasks").
"""

from config import ConfigError, Plugins
from tasks.base import Task

TASKS = Plugins(__name__, __path__, Task)

# the task each architecture trains on each kind of data when a run says task="auto" (the first of an architecture
# is its default on data of other kinds, where make_task then says what fits)
DEFAULTS = {
    ("gpt", "lm"): "lm",
    ("gpt", "chat"): "chat",
    ("encoder", "lm"): "masked_lm",
    ("encoder_decoder", "seq2seq"): "seq2seq",
}


def make_task(name, arch, meta, mask_prob=0.15, label_smoothing=0.0):
    """
    Task `name` ("auto": the default task of arch on the data's kind, meta["kind"]) of a model of arch trained on a
    dataset with this meta; ConfigError where they do not go together.
    """
    kind, dataset = meta.get("kind", "lm"), meta.get("name", "this dataset")
    if name == "auto":
        if kind == "chat" and arch != "gpt":
            raise ConfigError(
                f"{dataset} is chat data, which only arch=gpt trains on (a reply is the next tokens of the "
                f"conversation); arch={arch} needs another dataset"
            )
        name = DEFAULTS.get((arch, kind)) or next(task for (a, _), task in DEFAULTS.items() if a == arch)
    if name not in TASKS:  # a checkpoint of a task whose file is not here, say
        raise ConfigError(f"task={name!r} is not one of the tasks ({', '.join(TASKS)}): add its file to tasks/")
    task = TASKS[name]
    if arch != task.arch:
        raise ConfigError(f"task={name} trains arch={task.arch!r}, not arch={arch!r}")
    if kind != task.kind:
        fits = [t.name for t in TASKS.values() if t.arch == arch and t.kind == kind]
        fix = f"--task={fits[0]} (or auto)" if fits else f"a {task.kind} dataset ({task.examples})"
        raise ConfigError(f"task={name} trains on {task.kind} data, and {dataset} is {kind} data: use {fix}")
    return task.for_run(meta, label_smoothing=label_smoothing, mask_prob=mask_prob)
