"""
tools/bench.py --parts=train: real train.py processes measured from outside (speed, MFU, the time to a target val
loss, the best loss within a time budget), with nanoGPT's race to the same target beside.
"""

import math
import re
import shlex
import sys
import time

from bench_common import ROOT, compile_env, launch, nanogpt_env, summary

# nanoGPT's train.py raced beside ours (--nanogpt): its character-level recipe, which configs/shakespeare_gpu.py
# follows (val loss 1.47 on a GPU), evaluating as that config does, so that both sides' evaluations cost alike: 50
# batches of 64 x 256 per split every 250 iterations (the recipe's own 200 cost four times as much: 53% of training's
# FLOPs against 13%)
NANOGPT_RACE = "config/train_shakespeare_char.py --eval_iters=50"


def timed_run(cfg, config, out_dir, cache):
    """
    One `python train.py config` process, compiling into the folder cache (empty: a cold start, as nanoGPT's race
    gets). Returns (evals: [(seconds since launch, iter, val loss)], tokens/s and MFU of each progress line, seconds).
    """
    # every run writes its own out_dir; train_args come last, so they override the config
    command = [sys.executable, str(ROOT / "train.py"), config, f"--out_dir={out_dir}", "--tensorboard=false"]
    command += cfg.train_args.split()
    # from before the launch: start-up, data preparation and compilation all count
    begin = time.perf_counter()
    evals, speeds, mfus = [], [], []
    # one merged stream, read line by line as the run goes, so each eval gets the time it was printed
    with launch(command, env=compile_env(cache)) as proc:
        for line in proc.stdout:
            # train.py's lines: 'eval N: ... val loss X', and progress lines holding '| N tok/s' and '| mfu X%'
            if m := re.match(r"eval (\d+): .*val loss ([\d.]+)", line):
                evals.append((time.perf_counter() - begin, int(m[1]), float(m[2])))
                if cfg.stop_at_target and evals[-1][2] <= cfg.target_loss:
                    proc.kill()  # the time to the target is known; the rest of the run is not waited for
                    return evals, speeds, mfus, time.perf_counter() - begin
            if m := re.search(r"\| ([\d,]+) tok/s", line):
                speeds.append(float(m[1].replace(",", "")))
            if m := re.search(r"\| mfu ([\d.]+)%", line):
                mfus.append(float(m[1]))
    if proc.returncode:
        raise SystemExit(f"bench.py: error: {' '.join(command)} failed with exit status {proc.returncode}")
    return evals, speeds, mfus, time.perf_counter() - begin


def bench_training(cfg, work):
    """Table rows for cfg.runs training runs of each config, in folders under work, a value per config (and
    nanoGPT's race where cfg says, in turns with them): speed, MFU, time to target, losses."""
    # per config: one entry per run (reached, best, finals, walls) or per progress line (speeds, mfus)
    stats = [{"reached": [], "best": [], "finals": [], "walls": [], "speeds": [], "mfus": []} for _ in cfg.configs]
    races = []  # nanoGPT's, one a run
    for run in range(cfg.runs):
        for i, config in enumerate(cfg.configs):  # in turns: run 1 of each config (and nanoGPT's), then run 2, ...
            folder = work / f"config{i}-run{run}"
            evals, speeds, mfus, wall = timed_run(cfg, config, folder, work / f"cache-config{i}-run{run}")
            s = stats[i]
            s["speeds"] += speeds[1:]  # the first progress line includes warm-up (and compilation)
            s["mfus"] += mfus[1:]
            # inf for a run that never got there (or had no eval within the budget): it shows in the spread
            hits = [seconds for seconds, _, loss in evals if loss <= cfg.target_loss]
            s["reached"].append(hits[0] if hits else float("inf"))
            s["best"].append(min((loss for seconds, _, loss in evals if seconds <= cfg.budget), default=float("inf")))
            s["finals"] += [evals[-1][2]] if evals else []  # the last evaluation's val loss
            s["walls"].append(wall)
        if cfg.nanogpt and cfg.nanogpt_race:
            races.append(nanogpt_race(cfg, work / f"nanogpt-run{run}"))

    def row(name, key, fmt):
        return name, [summary(s[key], fmt) for s in stats]

    rows = [row("training tokens/s (per progress line)", "speeds", "{:,.0f}")]
    if any(s["mfus"] for s in stats):
        rows.append(row("MFU %", "mfus", "{:.1f}"))
    rows.append(row(f"seconds to val loss <= {cfg.target_loss}", "reached", "{:.1f}"))
    if cfg.stop_at_target:  # the runs ended at the target: no best or final loss to report
        rows.append(row("val loss at the stop", "finals", "{:.4f}"))
    else:
        rows.append(row(f"best val loss within {cfg.budget:.0f} s", "best", "{:.4f}"))
        rows.append(row("final val loss", "finals", "{:.4f}"))
        rows.append(row("wall seconds per run", "walls", "{:.1f}"))
    return nanogpt_column(rows, races, cfg) if races else rows


def nanogpt_race(cfg, work):
    """
    nanoGPT's train.py at cfg.nanogpt_race, from its launch to its first evaluation at or below cfg.target_loss
    (then stopped: its run's best is not waited for), compiling into an empty cache under work, as ours do. Returns
    (seconds, iteration, val loss), or the exit status of a run that ended without reaching it.
    """
    command = [sys.executable, "train.py", *shlex.split(cfg.nanogpt_race), f"--out_dir={work / 'nanogpt-race'}"]
    begin = time.perf_counter()
    with launch(command, cfg.nanogpt, nanogpt_env(work / "cache-nanogpt-race")) as proc:
        for line in proc.stdout:
            # nanoGPT's evaluation line: "step 250: train loss 1.9, val loss 2.0"
            m = re.match(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", line)
            if m and float(m[2]) <= cfg.target_loss:
                proc.kill()
                return time.perf_counter() - begin, int(m[1]), float(m[2])
    return proc.returncode


def nanogpt_column(rows, races, cfg):
    """The training table's rows with nanoGPT's column: its time to the target over its races (nanogpt_race's
    results), the rest not measured (stopped there)."""
    target = f"seconds to val loss <= {cfg.target_loss}"
    # inf for a run that ended (or failed) first: summary counts it apart, and its exit status is said
    seconds = [race[0] if isinstance(race, tuple) else math.inf for race in races]
    mine = summary(seconds, "{:.1f}")
    iterations = [str(race[1]) for race in races if isinstance(race, tuple)]
    mine += f" (at iteration {', '.join(iterations)})" if iterations else ""
    ended = [str(race) for race in races if not isinstance(race, tuple)]
    mine += f" (ended first, exit status {', '.join(ended)})" if ended else ""
    return [(name, values + [mine if name == target else "not measured"]) for name, values in rows]


def training_table(cfg, work):
    """(header, rows) of cfg.runs training runs of each config, with nanoGPT's race beside where cfg says."""
    work.mkdir(parents=True, exist_ok=True)
    rows = bench_training(cfg, work)
    header = ["measure", *(f"{c} median (min-max)" for c in cfg.configs)]
    if cfg.nanogpt and cfg.nanogpt_race:  # nanoGPT's race to the same target, its own column
        header.append(f"nanoGPT: {cfg.nanogpt_race}")
    return header, rows
