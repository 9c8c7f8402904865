"""
Performance numbers in one table: training throughput (and MFU on a GPU), time to a target validation loss,
the best validation loss within a time budget, sampling speed with and without the KV cache, the training step
on a GPU beside nanoGPT's, and serve.py under concurrent streaming clients.

    python tools/bench.py                                  # the quick start, configs/shakespeare.py
    python tools/bench.py --config=configs/shakespeare.py,old.py --parts=train   # two configs side by side, in turns
    python tools/bench.py --config=configs/shakespeare_gpu.py --target_loss=1.47 --budget=600
    python tools/bench.py --parts=sample --out_dir=out-shakespeare
    python tools/bench.py --parts=step --cases="configs/gpt2.py;configs/gpt2.py --batch_size=24" --profile=true
    python tools/bench.py --parts=gpu --nanogpt=/path/to/nanoGPT   # every GPU measurement, beside nanoGPT's own runs
    python tools/bench.py --parts=serve                    # serve.py: 1, 8 and 16 streaming clients, two model shapes

Each training run is a real `python train.py CONFIG` process, timed from its launch, so compilation, data
preparation and evaluation all count; each number is the median of several, with the spread, and several configs
are run in turns, a column each. The step part instead times train.py's own training step inside a process of its
own for each case (docs/performance.md, "GPUs").

This file is the command line: its options (BenchConfig), the --parts=gpu plan and the tables. Each part lives beside
it in a file of its own: bench_train.py (train), bench_sample.py, bench_step.py (step, the core of gpu),
bench_serve.py (serve), and bench_common.py what they share.
"""

import sys
from pathlib import Path

# tools/ holds plain scripts, not a package: `python tools/bench.py`, run from any directory, puts tools/ first on
# sys.path, so the bench's own modules import by name; this line puts the project's root after it, so that the
# project's modules (train, model, ...) import too (tests/conftest.py puts both there for the tests)
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import re
import shlex
import tempfile
import time
from dataclasses import dataclass, replace

import torch

from bench_common import ROOT
from bench_sample import bench_sampling, sampling_device
from bench_serve import SERVED_SHAPES, bench_serving
from bench_step import NANOGPT_STEP, bench_steps, measure_case
from bench_train import NANOGPT_RACE, training_table
from config import parse_config
from runtime import DTYPES, resolve_dtype

PARTS = ("train", "sample", "step", "gpu", "serve")

# --parts=gpu: every GPU measurement in one call (its length: docs/performance.md#gpus), most important first, each
# table printed when done (plans need no GPU: train.py --plan --plan_device=H100 gives the same prediction anywhere;
# --plan=true adds this machine's to stages 1 and 3, after their timings). train_args go to every case and race run:
# 1. GPT-2 124M's shape as nanoGPT runs it, 12 x 1024 x 4 a step, beside nanoGPT's own train.py: ours compiled cold,
#    then again from the cache it left (the warm launch), at batch 24, and the modern recipe; profiled. In turns
#    with nanoGPT's run, `rounds` times, each round from empty compile caches.
# 2. configs/shakespeare_gpu.py from its launch to val loss 1.47 (stopped there), beside nanoGPT's recipe for it, in
#    turns, `rounds` times, every run compiling into an empty cache of its own.
# 3. both GPT-2 recipes at the configs' 40 micro-batches a step, and shakespeare_gpu's step with CUDA graphs.
GPT2 = "configs/gpt2.py --dataset=shakespeare --gradient_accumulation_steps=4"
GPU_CASES = ";".join(
    [
        GPT2,
        GPT2,
        f"{GPT2} --batch_size=24 --gradient_accumulation_steps=2",
        "configs/gpt2_modern.py --dataset=shakespeare --gradient_accumulation_steps=4",
    ]
)
GPU_MORE_CASES = ";".join(
    [
        "configs/gpt2.py --dataset=shakespeare",  # 40 micro-batches, as the config trains
        "configs/gpt2_modern.py --dataset=shakespeare",
        "configs/shakespeare_gpu.py",
        "configs/shakespeare_gpu.py --cuda_graphs=true",
    ]
)


@dataclass
class BenchConfig:
    config: str = "configs/shakespeare.py"  # the training config to measure; several, comma-separated: in turns
    runs: int = 3  # full training runs, for time-to-target and best loss (median and spread over them)
    target_loss: float = 1.88  # time-to-quality: seconds until the first evaluation at or below this val loss
    stop_at_target: bool = False  # train: stop each run at its first evaluation at or below target_loss
    budget: float = 120.0  # best val loss among evaluations within this many seconds of the launch
    train_args: str = ""  # extra train.py overrides for every run and step case, e.g. "--device=cpu --compile=true"
    parts: str = "train,sample"  # what to measure, comma-separated: train (the runs above), sample, step, gpu, serve
    out_dir: str = ""  # sample only: a checkpoint folder to sample from; "": the last training run's
    samples: int = 5  # sampling: continuations drawn
    sample_tokens: int = 500  # sampling: tokens per continuation
    repeats: int = 5  # sampling and serve: timed repeats of each way of sampling, or rounds of clients
    dtype: str = "auto"  # sampling: autocast as sample.py's --dtype; "auto": bfloat16 on recent GPUs, else float32
    cases: str = ""  # step: ';'-separated cases "CONFIG [--key=value ...]", a column each, + train_args; "": --config
    steps: int = 20  # step: timed optimizer steps per case (fewer if step_seconds runs out first; at least 3)
    rounds: int = 2  # step: the cases, then nanoGPT's, in turns this many times (1, 2, nanoGPT, 1, ...); gpu: races too
    step_seconds: float = 10.0  # step: the most seconds of timed steps per case
    warmup: int = 3  # step: untimed steps first (compilation, the allocator's first blocks)
    profile: bool = False  # step: also profile 3 steps of each case: GPU busy share, time by kernel kind
    cold: str = ""  # step: cases (1-based, comma-separated) compiled in an empty cache of their own; the rest share one
    case_timeout: float = 300.0  # step: seconds a case may take, from its launch, before it is stopped
    plan: bool = False  # step: also train.py --plan each case on this machine: predicted peak and step time
    nanogpt: str = ""  # a nanoGPT checkout to measure beside: its train.py at nanogpt_step (step) and nanogpt_race
    nanogpt_step: str = NANOGPT_STEP  # step: nanoGPT's train.py arguments for its column ("": no column)
    nanogpt_race: str = NANOGPT_RACE  # train: nanoGPT's train.py arguments, timed to target_loss ("": no column)
    race_target: float = 1.47  # gpu: the race's target_loss, configs/shakespeare_gpu.py's and nanoGPT's recipe's
    child: str = ""  # internal: the one case a child process measures (the step part starts one per case)
    # serve: the models served, a column each: "quick" (the quick start's, trained a few steps), "gpt2" (GPT-2 124M's
    # shape, untrained: speed does not depend on the weights), or checkpoint files
    serve_models: str = "quick,gpt2"
    serve_clients: str = "1,8,16"  # serve: how many clients stream at once, a row each
    serve_tokens: int = 60  # serve: tokens each client asks for (the quick start's context is 64)

    def __post_init__(self):
        # checked before any run: a typo in parts would otherwise surface after minutes of training
        unknown = set(self.parts.split(",")) - set(PARTS)
        if unknown:
            raise ValueError(f"parts: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        resolve_dtype(self.dtype, sampling_device())  # one this machine cannot sample in (float16 on a CPU) fails now
        if min(self.repeats, self.runs, self.steps, self.rounds, self.warmup) < 1:
            raise ValueError("runs, repeats, steps, rounds and warmup must be at least 1")
        if not re.fullmatch(r"[1-9]\d*(,[1-9]\d*)*", self.serve_clients) or self.serve_tokens < 1:
            raise ValueError("serve_clients takes client counts, e.g. --serve_clients=1,4,16; serve_tokens at least 1")
        files = [m for m in self.serve_models.split(",") if m not in SERVED_SHAPES and not Path(m).is_file()]
        if files:
            raise ValueError(f"serve_models: {files[0]} is neither {' nor '.join(SERVED_SHAPES)} nor a checkpoint file")
        if not re.fullmatch(r"(\d+(,\d+)*)?", self.cold):
            raise ValueError(f"cold={self.cold!r}: give case numbers, e.g. --cold=1,3 (or --cold= for none)")
        missing = [c for c in self.configs if not (ROOT / c).is_file()]
        if missing:
            raise ValueError(f"config {missing[0]} not found; pass --config=PATH[,PATH...] of train.py configs")
        missing = [words[0] for words in self.step_cases if not (ROOT / words[0]).is_file()]
        if self.cases and missing:
            raise ValueError(f"cases: config {missing[0]} not found; each case starts with a train.py config's path")

    @property
    def configs(self):
        """The training configs, in the order of the table's columns."""
        return [c.strip() for c in self.config.split(",") if c.strip()]

    @property
    def step_cases(self):
        """The step part's cases, each a train.py command line (a config, overrides, train_args) as a list of words."""
        cases = [case for case in self.cases.split(";") if case.strip()] if self.cases else self.configs
        return [[*shlex.split(case), *shlex.split(self.train_args)] for case in cases]


def print_table(header, rows):
    """A Markdown table, ready to paste into the README or an issue; rows: (name, [one value per column])."""
    width = max(len(name) for name, _ in [(header[0], None), *rows])
    print("| " + " | ".join([f"{header[0]:<{width}}", *header[1:]]) + " |")
    print("|" + "|".join(["-" * (width + 2), *("-" * (len(h) + 2) for h in header[1:])]) + "|")
    for name, values in rows:
        print("| " + " | ".join([f"{name:<{width}}", *values]) + " |")


def bench_gpu(cfg, work, show):
    """--parts=gpu: the three stages of the GPU_CASES comment, each table shown as soon as it is measured. Every
    stage takes train_args, so that tests/test_bench.py dry-runs this same call on a CPU at tiny shapes."""
    defaults = BenchConfig()
    # these options keep the command line's values; every other option is the stage's own
    given = {k: getattr(cfg, k) for k in ("steps", "step_seconds", "warmup", "case_timeout", "rounds", "plan")}
    given.update(train_args=cfg.train_args, nanogpt=cfg.nanogpt)
    core = replace(defaults, **given, cases=cfg.cases or GPU_CASES, profile=True, nanogpt_step=cfg.nanogpt_step)
    show(bench_steps(core, work / "core"))
    race = replace(defaults, config="configs/shakespeare_gpu.py", target_loss=cfg.race_target, runs=cfg.rounds)
    race = replace(race, stop_at_target=True, train_args=cfg.train_args, nanogpt=cfg.nanogpt)
    show(training_table(replace(race, nanogpt_race=cfg.nanogpt_race), work / "race"))
    show(bench_steps(replace(core, cases=GPU_MORE_CASES, nanogpt_step=""), work / "more"))


def main(cfg):
    """Measure what cfg.parts names and print tables: each value a median with its spread, a column per config."""
    if cfg.child:
        return measure_case(cfg)
    # checked before any run: a wrong folder would otherwise surface after minutes of measuring
    if cfg.nanogpt and not (Path(cfg.nanogpt) / "train.py").is_file():
        raise SystemExit(f"bench.py: error: nanogpt={cfg.nanogpt}: no train.py there; pass a nanoGPT checkout's folder")
    parts = set(cfg.parts.split(","))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    stamp = f"{device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    print(f"device: {stamp}", flush=True)

    def show(table):  # each table as soon as it is measured: a long benchmark cut short keeps what it has
        header, rows = table
        print(f"\n{stamp}")
        print_table(header, [(name, values if isinstance(values, list) else [values]) for name, values in rows])
        print(flush=True)

    # runs, checkpoints and compile caches live in a temporary folder, removed at the end
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        if "gpu" in parts:
            bench_gpu(cfg, work, show)
        if "step" in parts:  # before the training runs, which would warm the compile caches of cold cases
            show(bench_steps(cfg, work / "step"))
        if "train" in parts:
            header, rows = training_table(cfg, work)
            if "sample" in parts and not cfg.out_dir:  # each config's last run's checkpoint, still in work
                folders = [work / f"config{i}-run{cfg.runs - 1}" for i in range(len(cfg.configs))]
                by_config = [bench_sampling(cfg, folder) for folder in folders]
                rows += [(name, [rs[j][1] for rs in by_config]) for j, (name, _) in enumerate(by_config[0])]
            show((header, rows))
        if "sample" in parts and cfg.out_dir:  # one given checkpoint: a table of its own
            show((["measure", f"{cfg.out_dir} median (min-max)"], bench_sampling(cfg, cfg.out_dir)))
        if "serve" in parts:
            show(bench_serving(cfg, work / "serve"))


def cli(argv):
    """The command line; returns the exit status: 2 with a one-line message for bad settings."""
    try:
        cfg = parse_config(BenchConfig, argv)
    except ValueError as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2
    try:
        main(cfg)
    except KeyboardInterrupt:  # Ctrl-C: one line; each case ran in a process and a folder of its own, now left
        print("bench.py: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
