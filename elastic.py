"""
Runs that outlive their failures, for train.py: what a cluster needs beyond exact resume.

    auto_resume       the same command line starts a run and, run again after a failure (torchrun --max-restarts,
                      SLURM's --requeue), goes on with it: auto_resumed() turns it into init_from='resume'
    checkpoint_minutes  ckpt.pt by the clock as well as at evaluations (CheckpointClock), so that a failure costs at
                      most that much training
    progress.json     how far the run got, written by rank 0 after every step (record_progress), so that a restart
                      says what the failure cost (restart_note)

docs/distributed.md has the cluster recipes (torchrun on many nodes, slurm/train.sbatch) that use them.
"""

import json
import os
from dataclasses import replace
from pathlib import Path

from checkpoint import run_files
from log import log

PROGRESS_FILE = "progress.json"  # in out_dir: {"iter_num", "seconds"} of the last step rank 0 took
JOB_KEY = "job"  # config.json's record of the launcher's job that started the run (launcher_job)


def launcher_job():
    """
    The job this process is part of, as its launcher names it across restarts: SLURM's job id (a requeued job keeps
    it), else torchrun's run id (its --rdzv_id, a fresh one for each --standalone launch); None in a plain process
    and for torchrun's default id ("none"), which every launch without --rdzv_id shares.
    """
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
    return job if job not in (None, "", "none") else None


def has_checkpoint(out_dir):
    """Whether out_dir holds a ckpt.pt to resume (a file or a sharded folder, or one a kill left as .ckpt.pt.old)."""
    folder = Path(out_dir)
    return (folder / "ckpt.pt").exists() or (folder / ".ckpt.pt.old").exists()


def auto_resumed(cfg):
    """
    The settings a run goes on with: with auto_resume, init_from='resume' where out_dir holds a checkpoint; where it
    holds only the files of an earlier attempt of this same job (launcher_job, kept in config.json) that stopped
    before its first checkpoint, overwrite=True to start it again. Any other cfg is returned as it is, so that a new
    run still refuses to start over a run it does not know (checkpoint.out_dir_problem).
    """
    if not cfg.auto_resume or cfg.init_from == "resume":
        return cfg
    if has_checkpoint(cfg.out_dir):
        return replace(cfg, init_from="resume")
    job, written = launcher_job(), Path(cfg.out_dir) / "config.json"
    if cfg.overwrite or job is None or not run_files(cfg.out_dir) or not written.is_file():
        return cfg
    try:
        started_by = json.loads(written.read_text(encoding="utf-8")).get(JOB_KEY)
    except (OSError, ValueError, AttributeError):  # unreadable, or not the JSON object train.py writes
        return cfg
    if started_by != job:
        return cfg
    log(f"note: job {job} stopped before the first checkpoint of its run in {cfg.out_dir}: starting that run again")
    return replace(cfg, overwrite=True)


class CheckpointClock:
    """
    When to save ckpt.pt by the clock (checkpoint_minutes): after each step whose time passed another multiple of the
    period of the run's time. The times are those the ranks agreed on (the mean of their clocks, summed with the
    step's target counts and stop votes in one all-reduce), so every rank decides alike without another collective.
    """

    def __init__(self, minutes, seconds):
        # seconds: the run's time at its start, a resume's saved time; a period of 0 never saves
        self.period, self.last = 60 * minutes, seconds

    def due(self, seconds):
        """Whether a step that began at `seconds` of the run's time passed a multiple of the period since the last."""
        passed = self.period > 0 and seconds // self.period > self.last // self.period
        self.last = seconds
        return passed


def record_progress(out_dir, iter_num, seconds):
    """
    Rank 0, after step iter_num that began at `seconds` of the run's time: out_dir/progress.json says how far the run
    got. Replaced whole (a reader never sees half of it) and not synced to disk: it must outlive the process, not the
    machine. About 50 us a step, and the host writes it while the GPU still computes.
    """
    tmp = Path(out_dir) / f".{PROGRESS_FILE}.tmp"
    tmp.write_text(json.dumps({"iter_num": iter_num, "seconds": round(seconds, 3)}) + "\n", encoding="utf-8")
    os.replace(tmp, tmp.with_name(PROGRESS_FILE))


def torchrun_note():
    """
    A note where torchrun will restart the ranks (--max-restarts) but cannot: PyTorch 2.13's rendezvous keeps one
    store for every round, without a prefix per attempt, so the restarted ranks read the dead ones' addresses and fail
    to connect, and a node that replaces a lost one waits for an address the others never write again. With
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment each round gets a store of its own. None otherwise.
    """
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    if not restarts or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return (
        f"note: torchrun's --max-restarts={restarts} will fail to restart the ranks (PyTorch 2.13 gives them a store "
        "shared with the last attempt): launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set "
        "(docs/distributed.md#elastic-restarts)"
    )


def launcher_restarts():
    """How this process's launchers restarted its job so far, in words ("torchrun's restart 1"); "" if they did not."""
    counts = {"SLURM's requeue": "SLURM_RESTART_COUNT", "torchrun's restart": "TORCHELASTIC_RESTART_COUNT"}
    said = [f"{what} {os.environ[name]}" for what, name in counts.items() if int(os.environ.get(name) or 0)]
    return " and ".join(said)


def restart_note(out_dir, ckpt):
    """
    The line a resume from ckpt (its checkpoint, loaded) says about how the run before it ended, or None where there
    is nothing to say: after a failure (the run had gone past its checkpoint, or a launcher restarted it), from which
    iteration it goes on and how many steps, and minutes of training, were lost.
    """
    try:
        reached = json.loads((Path(out_dir) / PROGRESS_FILE).read_text(encoding="utf-8"))
        iter_num, seconds = int(reached["iter_num"]), float(reached["seconds"])
    except (OSError, ValueError, KeyError, TypeError):  # none yet (a run from before it existed), or damaged
        iter_num, seconds = ckpt["iter_num"], ckpt.get("train_seconds", 0.0)
    lost = max(0, iter_num - ckpt["iter_num"])
    restarts = launcher_restarts()
    if not lost:
        # a launcher restarts a job after a failure or a stop (SLURM's time limit); a resume without one said it all
        return f"resumed after {restarts} from iteration {ckpt['iter_num']:,}: no step lost" if restarts else None
    minutes = max(0.0, seconds - ckpt.get("train_seconds", 0.0)) / 60
    return (
        f"resumed after a failure{f' ({restarts})' if restarts else ''} from iteration {ckpt['iter_num']:,}: the run "
        f"had reached iteration {iter_num:,}, so {lost:,} step(s), about {minutes:.1f} minutes of training, were lost "
        "and are trained again"
    )
