"""
Performance numbers in one table: training throughput (and MFU on a GPU), time to a target validation loss,
the best validation loss within a time budget, sampling speed with and without the KV cache, GPT-2 BPE
tokenization speed, and each rank's memory with DDP and with FSDP.

    python tools/bench.py                                  # the quick start, configs/shakespeare.py
    python tools/bench.py --config=configs/shakespeare.py,old.py --parts=train   # two configs side by side, in turns
    python tools/bench.py --config=configs/shakespeare_gpu.py --target_loss=1.47 --budget=600
    python tools/bench.py --parts=sample --out_dir=out-shakespeare
    python tools/bench.py --parts=bpe                      # BPE tokens/s: 1 thread, all cores, prepare_data.py text
    python tools/bench.py --parts=memory --train_args="--n_layer=8 --n_embd=512"  # per-rank memory, DDP vs FSDP
    python tools/bench.py --parts=step --cases="configs/gpt2.py;configs/gpt2.py --batch_size=24" --profile=true
    python tools/bench.py --parts=gpu --nanogpt=/path/to/nanoGPT   # every GPU measurement, beside nanoGPT's own runs
    python tools/bench.py --parts=serve                    # serve.py: 1, 8 and 16 streaming clients, two model shapes
    python tools/bench.py --parts=llama --llama_cpp=DIR    # serve.py beside llama.cpp's servers on one export's GGUF

Each training run is a real `python train.py CONFIG` process, timed from its launch, so compilation, data
preparation and evaluation all count; each number is the median of several, with the spread, and several configs
are run in turns, a column each. The step part instead times train.py's own training step inside a process of its
own for each case (docs/performance.md, "GPUs").
"""

import sys
from pathlib import Path

# tools/ holds plain scripts, not a package: `python tools/bench.py`, run from any directory, puts tools/ first on
# sys.path, so the bench's own modules import by name; this line puts the project's root after it, so that the
# project's modules (train, model, ...) import too (tests/conftest.py puts both there for the tests)
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import contextlib
import json
import math
import os
import re
import shlex
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

import torch

import train
from checkpoint import load_checkpoint
from config import parse_config
from generate import generate
from log import one_line, resident_peak
from model import ModelConfig, build_model
from prepare_data import bpe_batches, prepare, shakespeare_file
from runtime import DTYPES, autocast, make_runtime, pick_threads, resolve_dtype
from start import model_from_checkpoint
from tokens import GPT2_META, data_root, load_meta, tiktoken_encoding

# train.py runs with cwd=ROOT, so relative config paths work from any directory
ROOT = Path(__file__).resolve().parent.parent
PARTS = ("train", "sample", "bpe", "memory", "step", "gpu", "serve", "llama")
# the models --parts=serve can make, by serve_models name, with their column titles
SERVED_SHAPES = {"quick": "quick start (2 x 128, 64 positions)", "gpt2": "GPT-2 124M shape (12 x 768, 1,024)"}
GPT2_END = (GPT2_META["special_tokens"]["eot"],)  # <|endoftext|>, banned where the bench's untrained models use it
# --parts=llama's model: one llama.cpp computes as trained (GPT-2's layout with its tanh GELU and 4 x n_embd MLP, on
# GPT-2's BPE: docs/export.md, "On to llama.cpp"), untrained: speed does not depend on the weights
LLAMA_SHAPE = ModelConfig(
    n_layer=6, n_head=6, n_embd=384, block_size=1024, vocab_size=50257, bias=True, activation="gelu_tanh"
)
# nanoGPT's train.py beside ours (--nanogpt): GPT-2 124M's shape on its BPE tiny Shakespeare, 12 x 1024 x 4 per step,
# as configs/gpt2.py --gradient_accumulation_steps=4 (its compile, bfloat16 and fused AdamW are its defaults on a GPU)
NANOGPT_STEP = (
    "config/train_gpt2.py --dataset=shakespeare --gradient_accumulation_steps=4 --eval_interval=1000000 "
    "--eval_iters=1 --log_interval=1 --wandb_log=False"
)
# and its character-level recipe, which configs/shakespeare_gpu.py follows (val loss 1.47 on a GPU), evaluating as
# that config does, so that both sides' evaluations cost alike: 50 batches of 64 x 256 per split every 250 iterations
# (the recipe's own 200 cost four times as much: 53% of training's FLOPs against 13%)
NANOGPT_RACE = "config/train_shakespeare_char.py --eval_iters=50"
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
    parts: str = "train,sample"  # what to measure: train (the runs above), sample (speed of generation), bpe
    out_dir: str = ""  # sample only: a checkpoint folder to sample from; "": the last training run's
    samples: int = 5  # sampling: continuations drawn
    sample_tokens: int = 500  # sampling: tokens per continuation
    repeats: int = 5  # sampling and bpe: timed repeats of each way of sampling or tokenizing
    dtype: str = "auto"  # sampling: autocast as sample.py's --dtype; "auto": bfloat16 on recent GPUs, else float32
    bpe_input: str = ""  # bpe: UTF-8 text to tokenize; "": tiny Shakespeare ($NANOFORMER_DATA_MIRROR, cache or web)
    bpe_size_mb: float = 10.0  # bpe: the text is repeated to about this many MB
    ranks: int = 2  # memory: torchrun processes, each run with DDP and with FSDP
    memory_iters: int = 3  # memory: training steps per run (then one evaluation and a save)
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
    # llama: serve.py beside llama.cpp on the GGUF of one export (docs/serving.md): a llama.cpp source folder (its
    # convert_hf_to_gguf.py, run by this Python), its llama-server binary, and a Python with llama-cpp-python[server]
    llama_cpp: str = ""
    llama_server: str = ""  # "": llama_cpp/build/bin/llama-server
    llama_python: str = ""  # "": no llama-cpp-python column

    def __post_init__(self):
        # checked before any run: a typo in parts would otherwise surface after minutes of training
        unknown = set(self.parts.split(",")) - set(PARTS)
        if unknown:
            raise ValueError(f"parts: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        resolve_dtype(self.dtype, sampling_device())  # one this machine cannot sample in (float16 on a CPU) fails now
        if min(self.repeats, self.runs, self.memory_iters, self.steps, self.rounds, self.warmup) < 1 or self.ranks < 2:
            raise ValueError(
                "runs, repeats, memory_iters, steps, rounds and warmup must be at least 1, ranks at least 2"
            )
        if not re.fullmatch(r"[1-9]\d*(,[1-9]\d*)*", self.serve_clients) or self.serve_tokens < 1:
            raise ValueError("serve_clients takes client counts, e.g. --serve_clients=1,4,16; serve_tokens at least 1")
        files = [m for m in self.serve_models.split(",") if m not in SERVED_SHAPES and not Path(m).is_file()]
        if files:
            raise ValueError(f"serve_models: {files[0]} is neither {' nor '.join(SERVED_SHAPES)} nor a checkpoint file")
        if "llama" in self.parts.split(","):
            self.check_llama()
        if not re.fullmatch(r"(\d+(,\d+)*)?", self.cold):
            raise ValueError(f"cold={self.cold!r}: give case numbers, e.g. --cold=1,3 (or --cold= for none)")
        missing = [c for c in self.configs if not (ROOT / c).is_file()]
        if missing:
            raise ValueError(f"config {missing[0]} not found; pass --config=PATH[,PATH...] of train.py configs")
        missing = [words[0] for words in self.step_cases if not (ROOT / words[0]).is_file()]
        if self.cases and missing:
            raise ValueError(f"cases: config {missing[0]} not found; each case starts with a train.py config's path")

    def check_llama(self):
        """--parts=llama's programs exist: a wrong path would otherwise surface after the export and conversion."""
        if not (Path(self.llama_cpp) / "convert_hf_to_gguf.py").is_file():
            raise ValueError(f"llama_cpp={self.llama_cpp!r}: no convert_hf_to_gguf.py there; pass a llama.cpp folder")
        self.llama_server = self.llama_server or str(Path(self.llama_cpp) / "build" / "bin" / "llama-server")
        if not os.access(self.llama_server, os.X_OK):
            raise ValueError(f"llama_server={self.llama_server}: not a program; build llama.cpp's llama-server")
        if self.llama_python and not os.access(self.llama_python, os.X_OK):
            raise ValueError(f"llama_python={self.llama_python}: not a program; pass a Python with llama-cpp-python")

    @property
    def configs(self):
        """The training configs, in the order of the table's columns."""
        return [c.strip() for c in self.config.split(",") if c.strip()]

    @property
    def step_cases(self):
        """The step part's cases, each a train.py command line (a config, overrides, train_args) as a list of words."""
        cases = [case for case in self.cases.split(";") if case.strip()] if self.cases else self.configs
        return [[*shlex.split(case), *shlex.split(self.train_args)] for case in cases]


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


def memory_run(cfg, config, fsdp, out_dir):
    """One `torchrun --nproc_per_node=ranks train.py config` of memory_iters steps, with fsdp on or off: its
    memory_lines."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.ranks}"]
    command += [str(ROOT / "train.py"), config, f"--out_dir={out_dir}", "--tensorboard=false", f"--fsdp={fsdp}"]
    steps = cfg.memory_iters
    command += [f"--max_iters={steps}", f"--eval_interval={steps}", "--eval_iters=1", f"--log_interval={steps}"]
    run = subprocess.run(command + cfg.train_args.split(), cwd=ROOT, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(
            f"bench.py: error: {' '.join(command)} failed with exit status {run.returncode}:\n{run.stderr[-2000:]}"
        )
    return memory_lines(run.stdout)


def memory_lines(log):
    """{rank: (weights + gradients + optimizer state, peak)} in MiB from train.py's closing memory lines in log."""
    number = r"([\d.]+) MiB"
    pattern = rf"memory rank (\d+): weights {number}, gradients {number}, optimizer state {number}, peak {number}"
    return {int(m[1]): (float(m[2]) + float(m[3]) + float(m[4]), float(m[5])) for m in re.finditer(pattern, log)}


def bench_memory(cfg, work):
    """(header, rows): each rank's memory_lines with DDP and with FSDP for each config, runs times in turns."""
    columns = [(config, fsdp) for config in cfg.configs for fsdp in (False, True)]
    measured = {column: {} for column in columns}  # {rank: [(state, peak) of each run]}
    for run in range(cfg.runs):
        for i, (config, fsdp) in enumerate(columns):
            for rank, values in memory_run(cfg, config, fsdp, work / f"memory{i}-run{run}").items():
                measured[(config, fsdp)].setdefault(rank, []).append(values)
    rows = []
    for rank in range(cfg.ranks):
        for j, what in enumerate(("weights + gradients + optimizer state MiB", "peak MiB")):
            values = [summary([v[j] for v in measured[column].get(rank, [])], "{:,.1f}") for column in columns]
            rows.append((f"rank {rank} {what}", values))
    peak = "CUDA allocated" if torch.cuda.is_available() else "process resident set"
    header = [f"measure (peak: {peak})", *(f"{c} {'FSDP' if fsdp else 'DDP'} median (min-max)" for c, fsdp in columns)]
    return header, rows


def sampling_speed(model, prompt, num_samples, max_new_tokens, *, use_cache, batched, repeats, dtype):
    """
    Tokens generated per second, one measurement per repeat: num_samples continuations of prompt (a list of ids)
    by max_new_tokens tokens each (no early stop), either in one batch or one sample after another. Sampled as
    sample.py samples: without gradients, under autocast to dtype (a no-op for float32).
    """
    device = next(model.parameters()).device
    # batched: one call of num_samples rows; else num_samples calls of one row
    batches = [num_samples] if batched else [1] * num_samples
    rates = []
    for repeat in range(repeats):
        # seeded per repeat: the timings are reproducible, and each repeat draws other tokens
        generator = torch.Generator(device).manual_seed(repeat)
        begin = time.perf_counter()
        with torch.no_grad(), autocast(device, dtype):
            for size in batches:
                idx = torch.tensor([prompt] * size, dtype=torch.long, device=device)
                generate(model, idx, max_new_tokens, generator=generator, use_cache=use_cache)
        # CUDA runs asynchronously: wait for the last kernel before reading the clock
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates.append(num_samples * max_new_tokens / (time.perf_counter() - begin))
    return rates


def sampling_device():
    """Where bench_sampling samples: the first GPU if there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bench_sampling(cfg, out_dir):
    """Rows (name, value) for sampling speed from out_dir's ckpt.pt: KV cache and batched vs neither."""
    # the latest checkpoint: the speed does not depend on how well the weights are trained
    ckpt = load_checkpoint(Path(out_dir) / "ckpt.pt")
    device = sampling_device()
    model = model_from_checkpoint(ckpt).to(device)
    dtype = resolve_dtype(cfg.dtype, device)  # the precision sample.py would sample in with the same --dtype
    prompt = [0]  # the speed does not depend on the prompt's content
    # the two ends of the scale: cached and batched, against recomputed and one sample at a time
    args = (model, prompt, cfg.samples, cfg.sample_tokens)
    cached, uncached = [], []
    for _ in range(cfg.repeats):  # in turns, so that the machine's drift in speed hits both ways alike
        cached += sampling_speed(*args, use_cache=True, batched=True, repeats=1, dtype=dtype)
        uncached += sampling_speed(*args, use_cache=False, batched=False, repeats=1, dtype=dtype)
    what = f"{cfg.samples} x {cfg.sample_tokens} tokens"
    speedups = [c / u for c, u in zip(cached, uncached)]
    return [
        (f"sampling tokens/s, KV cache, batched ({what})", summary(cached, "{:,.0f}")),
        (f"sampling tokens/s, no cache, one at a time ({what})", summary(uncached, "{:,.0f}")),
        ("sampling speedup (each cached run over the uncached run after it)", summary(speedups, "{:.1f}x")),
    ]


def bpe_throughput(text, num_threads, repeats):
    """
    GPT-2 BPE tokens per second over `text`, one measurement per repeat. The text is cut and batched exactly as
    prepare_data.prepare() does, so this is the tokenizer's share of preparing a corpus, without any file I/O.
    """
    # loaded (and cached) before the clock starts; only encoding is timed
    encoding = tiktoken_encoding("gpt2")
    batches = bpe_batches(text)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        # tokens produced over all batches, each batch encoded on num_threads threads
        count = sum(
            len(ids) for batch in batches for ids in encoding.encode_ordinary_batch(batch, num_threads=num_threads)
        )
        rates.append(count / (time.perf_counter() - start))
    return rates


def bench_bpe(cfg, work):
    """Rows (name, value) for GPT-2 BPE speed: encoding alone on 1 and all threads, then prepare_data.py's text."""
    try:
        path = Path(cfg.bpe_input).expanduser() if cfg.bpe_input else shakespeare_file(None, data_root())
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as e:  # a missing file, a failed download, a file that is not UTF-8
        raise SystemExit(f"bench.py: error: {e}") from None
    if not text:
        raise SystemExit(f"bench.py: error: {path} is empty; pass a non-empty --bpe_input")
    text *= max(1, round(cfg.bpe_size_mb * 1e6 / len(text)))  # repeated to a multi-megabyte corpus
    what = f"{len(text) / 1e6:.1f} MB of {path.name}"
    rows = []
    # a set: a one-core machine gets one row, not two alike
    for threads in sorted({1, os.cpu_count()}):
        label = f"BPE tokens/s, encode, {threads} thread{'s' if threads > 1 else ''} ({what})"
        rows.append((label, summary(bpe_throughput(text, threads, cfg.repeats), "{:,.0f}")))
    # the whole pipeline once more: read, cut, encode on all cores, write train.bin/val.bin
    # the repeated text as a file, for the text recipe's --input
    corpus = work / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    rates = []
    for _ in range(cfg.repeats):
        start = time.perf_counter()
        # force: every repeat rebuilds instead of finding the first one's output up to date
        folder = prepare("text", data_dir=work, force=True, input=str(corpus), name="bpe")
        # tokens written to train.bin and val.bin per second of the whole build
        rates.append(sum(load_meta(folder)["files"].values()) / (time.perf_counter() - start))
    rows.append(("BPE tokens/s, prepare_data.py text (scan + encode + write)", summary(rates, "{:,.0f}")))
    return rows


# -----------------------------------------------------------------------------
# The step harness: one process per case, the real training step timed on the device


def measure_case(cfg):
    """
    In a child process: set up train.py's run of the case cfg.child (a config and overrides), take warmup steps,
    then time up to cfg.steps steps of train.train_step (device events on a GPU), the optimizer's part of each on
    its own, and optionally profile 3 more. Prints one line, "result: " and JSON, for the parent to read.
    """
    words = shlex.split(cfg.child)
    with tempfile.TemporaryDirectory() as out_dir:
        args = [*words, f"--out_dir={out_dir}", "--tensorboard=false", "--overwrite=true"]
        tcfg = parse_config(train.TrainConfig, args)
        rt = make_runtime(tcfg)
        with contextlib.ExitStack() as stack:
            run = train.setup(tcfg, rt, stack)
            result = time_steps(run, cfg, train)
    print("result: " + json.dumps(result), flush=True)


def time_steps(run, cfg, train):
    """The measurements of measure_case on a set-up run: see step_rows for what each means."""
    device = run.rt.device
    clock = DeviceClock(device)
    optimizer_spans = []
    update_weights = train.update_weights

    def timed_update(*args, **kwargs):  # the optimizer's part of a step (clipping, every optimizer, zero_grad)
        with clock.span(optimizer_spans):
            return update_weights(*args, **kwargs)

    train.update_weights = timed_update
    step_ms = []  # each timed step's milliseconds
    step = train.train_step(run, 0)
    clock.synchronize()
    first_step = time.time()  # wall clock: the parent subtracts its own reading from before the launch
    for iteration in range(1, cfg.warmup + cfg.steps):  # the warm-up ends inside: steps is at least 1
        if iteration == cfg.warmup:
            clock.synchronize()
            optimizer_spans.clear()
            if clock.cuda:
                torch.cuda.reset_peak_memory_stats(device)
            graphs_after_warmup = compiled_graphs()
            begin = time.perf_counter()
        timed = iteration >= cfg.warmup
        with clock.step(step_ms if timed else []):
            step = train.train_step(run, iteration)
        # at least 3 timed steps; then no more than step_seconds of them (40 micro-batches take a second a step)
        if timed and len(step_ms) >= 3 and time.perf_counter() - begin > cfg.step_seconds:
            break
    clock.synchronize()
    result = {
        "ms": step_ms,
        "optimizer_ms": clock.milliseconds(optimizer_spans),
        "tokens": step.tokens,
        "flops": step.flops,
        "peak_flops": run.progress.peak_flops,
        # CUDA's allocated memory since the reset, else the process's resident set
        "peak_mib": (torch.cuda.max_memory_allocated(device) if clock.cuda else resident_peak()) / 2**20,
        "first_step": first_step,
        "loss": float(step.loss) * run.rt.world_size,  # the last step's
        "graphs": compiled_graphs(),
        "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
        "recompiled": compiled_graphs() - graphs_after_warmup,  # the loop always passes the warm-up
    }
    if cfg.profile:
        try:  # the timings stand without it
            result["profile"] = profile_steps(run, iteration + 1, train, device)
        except Exception as e:
            result["profile_error"] = one_line(e)
    train.update_weights = update_weights
    return result


class DeviceClock:
    """
    The step part's clock. A step: the host clock from its start to the end of one wait for the device after it,
    in milliseconds, which is how nanoGPT times its iterations at log_interval=1 (time.time() around each, whose
    loss.item() waits for the device once): both sides pay one synchronisation a step. A part of a step (the
    optimizer's): spans of device time, CUDA events on a GPU (read once at the end, no wait), the host clock elsewhere.
    """

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    @contextlib.contextmanager
    def step(self, milliseconds):
        start = time.perf_counter()
        yield
        self.synchronize()
        milliseconds.append(1000 * (time.perf_counter() - start))

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def span(self, spans):
        start = self.now()
        yield
        spans.append((start, self.now()))

    def synchronize(self):
        if self.cuda:
            torch.cuda.synchronize()

    def milliseconds(self, spans):
        if self.cuda:
            return [start.elapsed_time(end) for start, end in spans]
        return [1000 * (end - start) for start, end in spans]


def compiled_graphs():
    """The graphs torch.compile has made in this process so far (each recompilation is one more)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


# the kinds of work a profile's time is sorted into, by kernel (GPU) or operator (CPU) name; the first match wins
KERNEL_KINDS = (
    ("fused by Inductor", r"^triton_|cpp_fused"),
    ("attention", r"flash|fmha|attention|sdpa|efficient_attention"),
    ("matmul", r"gemm|xmma|nvjet|cutlass|sm90|sm80|\bmm\b|addmm|bmm|matmul|linear"),
    ("optimizer", r"adam|multi_tensor|foreach|lerp|muon"),
    ("communication", r"nccl|all_reduce|allreduce|reduce_scatter|all_gather"),
    ("copies and fills", r"memcpy|memset|copy|fill|cat\b|elementwise_kernel"),
)


def kernel_kind(name):
    """The KERNEL_KINDS kind of a kernel or operator name; "other" when none matches."""
    lowered = name.lower()
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, lowered)), "other")


def profile_steps(run, iteration, train, device, steps=3):
    """
    Profile `steps` training steps from iteration on: the wall time, the device's busy share of it (the kernels'
    summed time on a GPU) and milliseconds per step by kind of kernel (operator, on a CPU).
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        begin = time.perf_counter()
        for i in range(steps):
            train.train_step(run, iteration + i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - begin
    kinds, times = {}, {}  # ms per step by kind, and by kernel
    for event in prof.key_averages():
        if device.type == "cuda":
            # kernels: the events with device time of their own (CPU-side operators have none)
            microseconds = event.self_device_time_total if event.device_type.name == "CUDA" else 0
        else:  # leaves of the operator tree: their self time adds up to the busy time once
            microseconds = event.self_cpu_time_total if event.key.startswith("aten::") else 0
        if microseconds > 0:
            kind = kernel_kind(event.key)
            kinds[kind] = kinds.get(kind, 0.0) + microseconds / 1000 / steps
            times[event.key[:100]] = microseconds / 1000 / steps
    busy = sum(kinds.values()) * steps / 1000
    top = sorted(times.items(), key=lambda kv: -kv[1])[:25]  # the kernels that take the most time, for the log
    return {"wall_ms": 1000 * wall / steps, "busy": busy / wall, "kinds": kinds, "top": top}


def step_run(cfg, words, index, work):
    """
    One case (train.py's words) measured in a child process: returns measure_case's result with "launch", the
    seconds from before the launch to the end of the first step, and "cold": whether its compile cache was empty.
    Cases cfg.cold names get an empty cache of their own; the others share one, which the first of them fills.
    """
    command = [sys.executable, str(ROOT / "tools" / "bench.py"), f"--child={shlex.join(words)}"]
    command += [f"--steps={cfg.steps}", f"--warmup={cfg.warmup}", f"--step_seconds={cfg.step_seconds}"]
    command += ["--profile=true"] if cfg.profile else []
    # Inductor's and Triton's caches: a case's own or the one the others share
    cache = work / (f"cache-case{index + 1}" if str(index + 1) in cfg.cold.split(",") else "cache-shared")
    cold = not cache.exists()
    env = compile_env(cache)
    begin = time.time()
    try:  # a case that hangs (a deadlocked graph, say) must not take the whole benchmark's time
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=cfg.case_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within case_timeout={cfg.case_timeout:g} s"}
    found = re.search(r"^result: (.*)$", run.stdout, re.M)
    if run.returncode or not found:
        return {"error": f"exit status {run.returncode}: {last_line(run.stdout + run.stderr)}"}
    result = json.loads(found[1])
    result["launch"] = result.pop("first_step") - begin
    result["cold"] = cold
    return result


def last_line(output):
    """A failed process's last line: its one-line error, or the exception under its traceback."""
    lines = output.strip().splitlines()
    return lines[-1][:300] if lines else "no output"


def planned(words):
    """train.py --plan of a case on this machine: (predicted peak MiB, predicted ms a step), or None if it failed."""
    command = [sys.executable, str(ROOT / "train.py"), *words, "--plan"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    checkpointing = "True" if "--activation_checkpointing=true" in [w.lower() for w in words] else "False"
    peak = re.search(rf"peak, activation_checkpointing={checkpointing}\s+([\d,.]+) MiB", run.stdout)
    step = re.search(r"^step time\s+([\d,.]+) (ms|s)\b", run.stdout, re.M)
    if run.returncode or not peak or not step:
        return None
    seconds = float(step[1].replace(",", "")) * (1 if step[2] == "s" else 1e-3)
    return float(peak[1].replace(",", "")), 1000 * seconds


def nanogpt_step(cfg, work):
    """
    nanoGPT's train.py at cfg.nanogpt_step, timed as it times itself, which is how DeviceClock times ours: its
    iterations after cfg.warmup, and the launch to its first iteration, compiled cold.
    """
    steps = cfg.warmup + cfg.steps
    command = [sys.executable, "train.py", *shlex.split(cfg.nanogpt_step), f"--max_iters={steps}"]
    command += [f"--out_dir={work / 'nanogpt-step'}"]
    begin = time.time()
    first, times, tokens = None, [], None
    with launch(command, cfg.nanogpt, nanogpt_env(work / "cache-nanogpt")) as proc:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if m := re.match(r"tokens per iteration will be: ([\d,]+)", line):
                tokens = int(m[1].replace(",", ""))
            # nanoGPT's progress line: "iter 3: loss 9.1, time 110.20ms, mfu 38.1%"
            if m := re.match(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms", line):
                first = first or time.time() - begin
                if int(m[1]) >= cfg.warmup:
                    times.append(float(m[2]))
    if proc.returncode or not times:
        return {"error": f"exit status {proc.returncode}: {last_line(''.join(lines))}"}
    return {"ms": times, "launch": first, "cold": True, **({"tokens": tokens} if tokens else {})}


def step_rows(results, plans):
    """
    The step table's rows, one value per case (each row's name says what it is): the device time of a training
    step and what follows from it, the peak memory (CUDA's allocated; on a CPU the resident set), --plan's
    predictions, the launch, the compiled graphs, the last loss, and with --profile the time by kind of kernel.
    """
    ok = [r for r in results if "error" not in r]
    # nanoGPT computes the same model's FLOPs at the same shape: its MFU from the first case's FLOPs per token
    per_token = next((r["flops"] / r["tokens"] for r in ok if r.get("flops")), 0)

    def row(name, cell):
        return name, [r["error"][:80] if "error" in r else cell(r) for r in results]

    def profiled(cell):  # cell of a case's profile, or why it has none
        return lambda r: cell(r["profile"]) if "profile" in r else r.get("profile_error", "n/a")[:80]

    def tokens_per_second(r):
        return [r["tokens"] / (ms / 1000) for ms in r["ms"]]

    def mfu(r):
        peak = r.get("peak_flops") or next((x["peak_flops"] for x in ok if x.get("peak_flops")), None)
        flops = r.get("flops") or per_token * r.get("tokens", 0)
        return summary([100 * flops / (ms / 1000) / peak for ms in r["ms"]], "{:.1f}") if peak and flops else "n/a"

    rows = [
        row("ms per step", lambda r: summary(r["ms"], "{:.1f}")),
        row("tokens/s", lambda r: summary(tokens_per_second(r), "{:,.0f}") if "tokens" in r else "see ms"),
        row("MFU %", mfu),
        row("optimizer ms per step", lambda r: summary(r.get("optimizer_ms", []), "{:.2f}")),
        row("peak memory MiB", lambda r: f"{r['peak_mib']:,.0f}" if "peak_mib" in r else "n/a"),
    ]
    if plans:
        rows.append(("--plan: predicted peak MiB", [f"{p[0]:,.0f}" if p else "n/a" for p in plans]))
        rows.append(("--plan: predicted ms per step", [f"{p[1]:.1f}" if p else "n/a" for p in plans]))
    rows += [
        row("launch to first step done, s", lambda r: f"{summary(r['launch'], '{:.1f}')} ({_cache(r)})"),
        row(
            "graphs / breaks / recompiled in timing",
            lambda r: f"{r['graphs']} / {r['graph_breaks']} / {r['recompiled']}" if "graphs" in r else "n/a",
        ),
        row("train loss after the last step", lambda r: f"{r['loss']:.4f}" if "loss" in r else "n/a"),
    ]
    if any("profile" in r for r in ok):
        rows.append(row("profile: device busy % of wall", profiled(lambda p: f"{100 * p['busy']:.0f}")))
        for kind in [k for k, _ in KERNEL_KINDS] + ["other"]:
            cell = profiled(lambda p, kind=kind: f"{p['kinds'].get(kind, 0.0):.1f}")
            rows.append(row(f"profile: {kind} ms per step", cell))
    return rows


def _cache(r):
    """How a case compiled: from an empty cache (cold), from one filled before (warm), or not at all."""
    return "no compile" if r.get("graphs") == 0 else "cold" if r["cold"] else "warm"


def bench_steps(cfg, work):
    """
    (header, rows): each step case, and nanoGPT's with --nanogpt, measured in turns cfg.rounds times (1, 2, ...,
    nanoGPT, 1, 2, ...), so that the machine's drift hits them alike, each round in a folder (and compile caches) of
    its own; then planned.
    """
    cases = cfg.step_cases
    nanogpt = bool(cfg.nanogpt and cfg.nanogpt_step)
    measured = [[] for _ in range(len(cases) + nanogpt)]  # per column, a result per round
    for round_ in range(cfg.rounds):
        folder = work / f"round{round_ + 1}"
        for i, words in enumerate(cases):
            print(f"step case {i + 1} of {len(cases)}, round {round_ + 1}: {shlex.join(words)}", flush=True)
            measured[i].append(step_run(cfg, words, i, folder))
            print(f"  {json.dumps(measured[i][-1])}", flush=True)  # every number, the profile's top kernels too
        if nanogpt:
            measured[-1].append(nanogpt_step(cfg, folder))
    results = [merged(rounds) for rounds in measured]
    header = ["measure", *(f"{i + 1}: {shlex.join(words)}" for i, words in enumerate(cases))]
    header += [f"nanoGPT: {cfg.nanogpt_step}"] if nanogpt else []
    plans = []
    if cfg.plan:  # side by side, after the timings (which they would disturb): each plan is one process on one core
        with ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) // 2)) as pool:
            plans = list(pool.map(planned, cases)) + [None] * nanogpt
    return header, step_rows(results, plans)


def merged(rounds):
    """One column's result over its rounds: every round's step times and launches, the rest the first round's; a
    round that failed stands for the column."""
    failed = [r for r in rounds if "error" in r]
    if failed:
        return failed[0]
    lists = {key: [v for r in rounds for v in r.get(key, [])] for key in ("ms", "optimizer_ms")}
    return {**rounds[0], **lists, "launch": [r["launch"] for r in rounds]}


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


def training_table(cfg, work):
    """(header, rows) of cfg.runs training runs of each config, with nanoGPT's race beside where cfg says."""
    work.mkdir(parents=True, exist_ok=True)
    rows = bench_training(cfg, work)
    header = ["measure", *(f"{c} median (min-max)" for c in cfg.configs)]
    if cfg.nanogpt and cfg.nanogpt_race:  # nanoGPT's race to the same target, its own column
        header.append(f"nanoGPT: {cfg.nanogpt_race}")
    return header, rows


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

    # runs, checkpoints, compile caches and the bpe corpus live in a temporary folder, removed at the end
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
        if "bpe" in parts:  # the tokenizer's speed does not depend on a config
            show((["measure", "median (min-max)"], bench_bpe(cfg, work)))
        if "memory" in parts:
            show(bench_memory(cfg, work))
        if "serve" in parts:
            show(bench_serving(cfg, work / "serve"))
        if "llama" in parts:
            show(bench_llama(cfg, work / "llama"))


# -----------------------------------------------------------------------------
# serve.py under concurrent clients


def bench_serving(cfg, work):
    """
    (header, rows) for serve.py under concurrent clients, a column per model of serve_models, each served by a
    `python serve.py` process of its own. In each of cfg.repeats rounds every client count of serve_clients runs in
    turn (so that the machine's drift hits them alike): each client streams a sampled completion of serve_tokens
    tokens (never ending early). Rows: time to first token per request, tokens/s per client and all together, all
    together over one client's in the same round, and the server's peak resident memory beside its KV cache budget.
    """
    work.mkdir(parents=True, exist_ok=True)
    counts = [int(c) for c in cfg.serve_clients.split(",")]
    header, columns = ["measure"], []
    for name in cfg.serve_models.split(","):
        source, title, ban = served_checkpoint(name, work)
        header.append(f"{title}, {cfg.serve_tokens} tokens a request, median (min-max)")
        columns.append(serving_column(cfg, source, counts, work, ban))
    return header, [(label, [column[k][1] for column in columns]) for k, (label, _) in enumerate(columns[0])]


def served_checkpoint(name, work):
    """
    (checkpoint file, column title, ids to ban) of a serve_models entry: the quick start's (characters: no end id),
    GPT-2 124M's shape (untrained: its <|endoftext|> banned, so that every completion runs its length), or a file.
    """
    if name not in SERVED_SHAPES:
        return name, name, ()
    if name == "quick":
        return str(quick_checkpoint(work)), SERVED_SHAPES[name], ()
    config = ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, bias=True)
    return str(shaped_checkpoint(config, work, work / "gpt2-shape.pt")), SERVED_SHAPES[name], GPT2_END


def quick_checkpoint(work):
    """The quick start's checkpoint in work, trained once."""
    quick = work / "quick-start" / "ckpt.pt"
    return quick if quick.is_file() else Path(quick_start_checkpoint(work))


def shaped_checkpoint(config, work, path):
    """The quick start's checkpoint with ModelConfig config's shape, fresh weights and GPT-2's tokenizer, at path."""
    ckpt = torch.load(quick_checkpoint(work), weights_only=True)
    ckpt |= {"model_config": asdict(config), "weights": build_model(config).state_dict(), "meta": dict(GPT2_META)}
    ckpt.pop("average", None)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    return path


def serving_column(cfg, source, counts, work, ban):
    """A column of bench_serving's rows for one served checkpoint: [(label, value)]."""
    port, log = free_port(), work / "serve.log"
    command = [sys.executable, str(ROOT / "serve.py"), f"--init_from={source}", f"--port={port}", "--device=cpu"]
    command.append(f"--max_batch={max(counts)}")
    firsts, each, together = ({c: [] for c in counts} for _ in range(3))
    ratios = {c: [] for c in counts}
    with open(log, "w") as out, subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT) as proc:
        try:
            url = wait_for_server(f"http://127.0.0.1:{port}", proc, log)
            stream_completion(url, cfg.serve_tokens, 0, ban)  # untimed: the first request's one-off costs
            for repeat in range(cfg.repeats):
                for clients in counts:
                    runs, rate = client_round(url, clients, cfg.serve_tokens, repeat, ban)
                    firsts[clients] += [first for first, _ in runs]
                    each[clients] += [cfg.serve_tokens / total for _, total in runs]
                    together[clients].append(rate)
                for clients in counts:  # against one client in the same round
                    ratios[clients].append(together[clients][-1] / together[counts[0]][-1])
            peak = peak_memory_mib(proc.pid)
        finally:
            proc.terminate()
    rows = []
    for c in counts:
        rows += [
            (f"{c} client(s): time to first token, ms", summary([1000 * f for f in firsts[c]], "{:,.0f}")),
            (f"{c} client(s): tokens/s per client", summary(each[c], "{:,.0f}")),
            (f"{c} client(s): tokens/s all together", summary(together[c], "{:,.0f}")),
            (f"{c} client(s): all together / {counts[0]} client(s)", summary(ratios[c], "{:.2f}x")),
        ]
    config = ModelConfig.from_dict(torch.load(source, weights_only=True)["model_config"])
    budget = max(counts) * config.kv_cache_bytes(torch.float32) / 2**20
    rows.append(("server peak memory, MiB (KV cache budget)", f"{peak} ({budget:,.0f})"))
    return rows


def client_round(url, clients, tokens, repeat, ban=()):
    """
    `clients` clients at once, each streaming a completion of `tokens` tokens (seeds new in every repeat; the ids in
    ban never drawn): their (seconds to first text, seconds in all), and the tokens a second of all of them together.
    A completion that ends before its tokens would make the counts wrong: SystemExit.
    """
    seeds = range(repeat * clients, (repeat + 1) * clients)
    begin = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        runs = list(pool.map(lambda seed: stream_completion(url, tokens, seed, ban), seeds))
    rate = clients * tokens / (time.perf_counter() - begin)
    early = [finish for _, _, finish in runs if finish != "length"]
    if early:
        raise SystemExit(
            f"bench.py: error: {url} ended a completion before its {tokens} tokens (finish_reason {early[0]!r}): "
            "the rates count every token; serve a model that does not end early (or with an end id to ban)"
        )
    return [(first, total) for first, total, _ in runs], rate


# -----------------------------------------------------------------------------
# serve.py beside llama.cpp


def bench_llama(cfg, work):
    """
    (header, rows) for serve.py, llama.cpp's llama-server and (with llama_python) llama-cpp-python's server, a
    column each, serving one model of LLAMA_SHAPE: serve.py its checkpoint, the others the GGUF that llama.cpp's
    converter makes of export.py's folder. Each computes with the threads serve.py takes by default (the free cores
    less one), llama-server with a slot per client (its continuous batching). In each of cfg.repeats rounds the
    servers take turns, each at every client count of serve_clients, each client streaming serve_tokens tokens as
    in bench_serving. Rows: time to first token, tokens/s all together, over one client's in the same round, and
    serve.py's over this server's in the same round.
    """
    work.mkdir(parents=True, exist_ok=True)
    run = shaped_checkpoint(LLAMA_SHAPE, work, work / "run" / "ckpt.pt").parent
    gguf = work / "model.gguf"
    check_run([sys.executable, str(ROOT / "export.py"), f"--out_dir={run}", f"--dest={work / 'hf'}"])
    convert = Path(cfg.llama_cpp) / "convert_hf_to_gguf.py"
    check_run([sys.executable, str(convert), str(work / "hf"), "--outfile", str(gguf), "--outtype", "f32"])
    threads, counts = str(pick_threads(0, 1, spare=1)[0]), [int(c) for c in cfg.serve_clients.split(",")]
    most = str(max(counts))
    servers = {  # each with {port} to fill in
        "serve.py": [sys.executable, str(ROOT / "serve.py"), f"--init_from={run / 'ckpt.pt'}", "--device=cpu"]
        + [f"--threads={threads}", f"--max_batch={most}", "--port={port}"],
        "llama-server": [cfg.llama_server, "-m", str(gguf), "--threads", threads, "--threads-batch", threads]
        + ["--parallel", most, "--ctx-size", str(max(counts) * LLAMA_SHAPE.block_size), "--port", "{port}"],
    }
    if cfg.llama_python:
        servers["llama-cpp-python"] = [cfg.llama_python, "-m", "llama_cpp.server", "--model", str(gguf)]
        servers["llama-cpp-python"] += ["--n_threads", threads, "--n_threads_batch", threads, "--port", "{port}"]
        # one request at a time, as it serves them; by default a new request would cut the one running short
        servers["llama-cpp-python"] += ["--n_ctx", str(LLAMA_SHAPE.block_size), "--interrupt_requests", "false"]
    firsts, together, ratios, ours = ({(n, c): [] for n in servers for c in counts} for _ in range(4))
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, command in servers.items():
            port, log = free_port(), work / f"{name}.log"
            out = stack.enter_context(open(log, "w"))
            command = [arg.format(port=port) for arg in command]
            proc = stack.enter_context(subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT))
            stack.callback(proc.terminate)
            urls[name] = wait_for_server(f"http://127.0.0.1:{port}", proc, log, name)
            stream_completion(urls[name], cfg.serve_tokens, 0, GPT2_END)  # untimed: the first request's one-offs
        for repeat in range(cfg.repeats):
            for name, url in urls.items():
                for clients in counts:
                    runs, rate = client_round(url, clients, cfg.serve_tokens, repeat, GPT2_END)
                    firsts[name, clients] += [first for first, _ in runs]
                    together[name, clients].append(rate)
            for name in servers:  # against one client, and serve.py, in the same round
                for clients in counts:
                    ratios[name, clients].append(together[name, clients][-1] / together[name, counts[0]][-1])
                    ours[name, clients].append(together["serve.py", clients][-1] / together[name, clients][-1])
    rows = []
    for c in counts:
        rows += [
            (
                f"{c} client(s): time to first token, ms",
                [summary([1000 * f for f in firsts[n, c]], "{:,.0f}") for n in servers],
            ),
            (f"{c} client(s): tokens/s all together", [summary(together[n, c], "{:,.1f}") for n in servers]),
            (
                f"{c} client(s): all together / {counts[0]} client(s)",
                [summary(ratios[n, c], "{:.2f}x") for n in servers],
            ),
            (f"{c} client(s): serve.py's tokens/s / this one's", [summary(ours[n, c], "{:.2f}x") for n in servers]),
        ]
    shape = f"{LLAMA_SHAPE.n_layer} x {LLAMA_SHAPE.n_embd}, GPT-2 BPE, {threads} thread(s)"
    title = f"{shape}, {cfg.serve_tokens} tokens a request"
    return ["measure", *(f"{name}: {title}, median (min-max)" for name in servers)], rows


def check_run(command):
    """Run command from ROOT; SystemExit with its last words if it fails."""
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"bench.py: error: {' '.join(command)} failed: {one_line(done.stderr or done.stdout)}")


def peak_memory_mib(pid):
    """A process's peak resident memory in MiB, from Linux's /proc; n/a elsewhere."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "n/a"
    kib = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))
    return f"{kib / 1024:,.0f}"


def quick_start_checkpoint(work):
    """A checkpoint of configs/shakespeare.py's model after a few steps, in work."""
    out_dir = work / "quick-start"
    command = [sys.executable, str(ROOT / "train.py"), "configs/shakespeare.py", f"--out_dir={out_dir}"]
    command += ["--max_minutes=0", "--max_iters=10", "--eval_interval=10", "--eval_iters=1", "--tensorboard=false"]
    check_run(command)
    return str(out_dir / "ckpt.pt")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_server(url, proc, log, name="serve.py", timeout=120):
    """url once its /v1/models answers; SystemExit with the server's last line if it exits or never answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"{url}/v1/models", timeout=5).close()
            return url
        time.sleep(0.2)
    last = (log.read_text().strip().splitlines() or ["no output"])[-1]
    raise SystemExit(f"bench.py: error: {name} did not start: {last}")


def stream_completion(url, max_tokens, seed, ban=()):
    """
    One streamed completion of max_tokens tokens, the ids in ban never drawn (logit_bias -100): (seconds to its
    first text, seconds in all, finish_reason).
    """
    body = {"prompt": "\n", "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "stream": True}
    body |= {"logit_bias": {str(i): -100 for i in ban}} if ban else {}
    data = json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data, headers={"Content-Type": "application/json"})
    begin, first, finish = time.perf_counter(), None, None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:  # server-sent events: 'data: {chunk}' lines, then 'data: [DONE]'
            choices = json.loads(line[6:])["choices"] if line.startswith(b"data: {") else []
            if choices and first is None:
                first = time.perf_counter() - begin
            if choices and choices[0].get("finish_reason"):  # the last chunk of the choice says why it ended
                finish = choices[0]["finish_reason"]
    return first, time.perf_counter() - begin, finish


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
