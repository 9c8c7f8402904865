"""
What the parts of tools/bench.py share: the project's root, the child processes launched from it (with compile caches
of their own), and the median (min-max) that a table's cell shows.
"""

import math
import os
import statistics
import subprocess
from pathlib import Path

# the project's root, above tools/: train.py runs with cwd=ROOT, so relative config paths work from any directory
ROOT = Path(__file__).resolve().parent.parent


def summary(values, fmt):
    """
    median (min-max) of values, each formatted with fmt; n/a when there are none. inf stands for a run that never
    got there (a target not reached, no evaluation within the budget): such runs are counted, not averaged.
    """
    if not values:
        return "n/a"
    # sorted: the spread's ends are finite[0] and finite[-1]
    finite = sorted(v for v in values if math.isfinite(v))
    never = f"never in {len(values) - len(finite)} of {len(values)} run(s)"
    if not finite:
        return never
    text = f"{fmt.format(statistics.median(finite))} ({fmt.format(finite[0])}-{fmt.format(finite[-1])})"
    return text if len(finite) == len(values) else f"{text}; {never}"


def launch(command, cwd=ROOT, env=None):
    """command's process, its stdout and stderr merged into one stream, to be read line by line as it runs."""
    return subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def compile_env(cache):
    """The environment of a child process that keeps Inductor's and Triton's compile caches in the folder cache."""
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}


def nanogpt_env(cache):
    """compile_env for nanoGPT's train.py, unbuffered: its prints (not flushed) reach the pipe as they are made."""
    return {**compile_env(cache), "PYTHONUNBUFFERED": "1"}
