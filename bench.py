"""
Performance numbers in one table: training throughput (and MFU on a GPU), time to a target validation loss,
the best validation loss within a time budget, sampling speed with and without the KV cache, GPT-2 BPE
tokenization speed, and each rank's memory with DDP and with FSDP.

    python bench.py                                  # the quick start, configs/shakespeare.py
    python bench.py --config=configs/shakespeare.py,old.py --parts=train   # two configs side by side, in turns
    python bench.py --config=configs/shakespeare_gpu.py --target_loss=1.47 --budget=600
    python bench.py --parts=sample --out_dir=out-shakespeare
    python bench.py --parts=bpe                      # BPE tokens/s: 1 thread, all cores, prepare_data.py text
    python bench.py --parts=memory --train_args="--n_layer=8 --n_embd=512"  # per-rank memory, DDP vs FSDP

Each training run is a real `python train.py CONFIG` process, timed from its launch, so compilation, data
preparation and evaluation all count. Numbers vary from run to run: each is the median of several, with the spread.
Several configs are run in turns (run 1 of each, then run 2 of each, ...), so that the machine's drift in speed
over minutes hits them alike, and each gets a column of the table.
"""

import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint import load_checkpoint, model_from_checkpoint
from config import parse_config
from devices import DTYPES, autocast, resolve_dtype
from generate import generate
from prepare_data import bpe_batches, prepare, shakespeare_file
from tokens import data_root, load_meta, tiktoken_encoding

# train.py runs with cwd=ROOT, so relative config paths work from any directory
ROOT = Path(__file__).resolve().parent


@dataclass
class BenchConfig:
    config: str = "configs/shakespeare.py"  # the training config to measure; several, comma-separated: in turns
    runs: int = 3  # full training runs, for time-to-target and best loss (median and spread over them)
    target_loss: float = 1.88  # time-to-quality: seconds until the first evaluation at or below this val loss
    budget: float = 120.0  # best val loss among evaluations within this many seconds of the launch
    train_args: str = ""  # extra train.py overrides for every run, e.g. "--device=cpu --compile=true"
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

    def __post_init__(self):
        # checked before any run: a typo in parts would otherwise surface after minutes of training
        unknown = set(self.parts.split(",")) - {"train", "sample", "bpe", "memory"}
        if unknown:
            raise ValueError(f"parts: unknown {', '.join(sorted(unknown))}; choose from train, sample, bpe, memory")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        resolve_dtype(self.dtype, sampling_device())  # one this machine cannot sample in (float16 on a CPU) fails now
        if min(self.repeats, self.runs, self.memory_iters) < 1 or self.ranks < 2:
            raise ValueError("runs, repeats and memory_iters must be at least 1, and ranks at least 2")
        missing = [c for c in self.configs if not (ROOT / c).is_file()]
        if missing:
            raise ValueError(f"config {missing[0]} not found; pass --config=PATH[,PATH...] of train.py configs")

    @property
    def configs(self):
        """The training configs, in the order of the table's columns."""
        return [c.strip() for c in self.config.split(",") if c.strip()]


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


def timed_run(cfg, config, out_dir):
    """
    One `python train.py config` process. Returns (evals: [(seconds since launch, iter, val loss)],
    tokens/s of every progress line, MFU of every progress line, total seconds).
    """
    # every run writes its own out_dir; train_args come last, so they override the config
    command = [sys.executable, str(ROOT / "train.py"), config, f"--out_dir={out_dir}", "--tensorboard=false"]
    command += cfg.train_args.split()
    # from before the launch: start-up, data preparation and compilation all count
    begin = time.perf_counter()
    evals, speeds, mfus = [], [], []
    # one merged stream, read line by line as the run goes, so each eval gets the time it was printed
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            # train.py's lines: 'eval N: ... val loss X', and progress lines holding '| N tok/s' and '| mfu X%'
            if m := re.match(r"eval (\d+): .*val loss ([\d.]+)", line):
                evals.append((time.perf_counter() - begin, int(m[1]), float(m[2])))
            if m := re.search(r"\| ([\d,]+) tok/s", line):
                speeds.append(float(m[1].replace(",", "")))
            if m := re.search(r"\| mfu ([\d.]+)%", line):
                mfus.append(float(m[1]))
    if proc.returncode:
        raise SystemExit(f"error: {' '.join(command)} failed with exit status {proc.returncode}")
    return evals, speeds, mfus, time.perf_counter() - begin


def bench_training(cfg, work):
    """
    Table rows for cfg.runs training runs of each config, in folders under work: speed, MFU, time to target,
    losses. Each row holds one value per config.
    """
    # per config: one entry per run (reached, best, finals, walls) or per progress line (speeds, mfus)
    stats = [{"reached": [], "best": [], "finals": [], "walls": [], "speeds": [], "mfus": []} for _ in cfg.configs]
    for run in range(cfg.runs):
        for i, config in enumerate(cfg.configs):  # in turns: run 1 of each config, then run 2 of each, ...
            evals, speeds, mfus, wall = timed_run(cfg, config, work / f"config{i}-run{run}")
            s = stats[i]
            s["speeds"] += speeds[1:]  # the first progress line includes warm-up (and compilation)
            s["mfus"] += mfus[1:]
            # inf for a run that never got there (or had no eval within the budget): it shows in the spread
            hits = [seconds for seconds, _, loss in evals if loss <= cfg.target_loss]
            s["reached"].append(hits[0] if hits else float("inf"))
            s["best"].append(min((loss for seconds, _, loss in evals if seconds <= cfg.budget), default=float("inf")))
            s["finals"] += [evals[-1][2]] if evals else []  # the last evaluation's val loss
            s["walls"].append(wall)

    def row(name, key, fmt):
        return name, [summary(s[key], fmt) for s in stats]

    rows = [row("training tokens/s (per progress line)", "speeds", "{:,.0f}")]
    if any(s["mfus"] for s in stats):
        rows.append(row("MFU %", "mfus", "{:.1f}"))
    rows.append(row(f"seconds to val loss <= {cfg.target_loss}", "reached", "{:.1f}"))
    rows.append(row(f"best val loss within {cfg.budget:.0f} s", "best", "{:.4f}"))
    rows.append(row("final val loss", "finals", "{:.4f}"))
    rows.append(row("wall seconds per run", "walls", "{:.1f}"))
    return rows


def memory_run(cfg, config, fsdp, out_dir):
    """
    One `torchrun --nproc_per_node=ranks train.py config` of memory_iters steps, with fsdp on or off. Returns
    {rank: (weights + gradients + optimizer state, peak)} in MiB, from train.py's closing memory lines.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.ranks}"]
    command += [str(ROOT / "train.py"), config, f"--out_dir={out_dir}", "--tensorboard=false", f"--fsdp={fsdp}"]
    steps = cfg.memory_iters
    command += [f"--max_iters={steps}", f"--eval_interval={steps}", "--eval_iters=1", f"--log_interval={steps}"]
    run = subprocess.run(command + cfg.train_args.split(), cwd=ROOT, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"error: {' '.join(command)} failed with exit status {run.returncode}:\n{run.stderr[-2000:]}")
    return memory_lines(run.stdout)


def memory_lines(log):
    """{rank: (weights + gradients + optimizer state, peak)} in MiB from train.py's closing memory lines in log."""
    number = r"([\d.]+) MiB"
    pattern = rf"memory rank (\d+): weights {number}, gradients {number}, optimizer state {number}, peak {number}"
    return {int(m[1]): (float(m[2]) + float(m[3]) + float(m[4]), float(m[5])) for m in re.finditer(pattern, log)}


def bench_memory(cfg, work):
    """
    (header, rows): each rank's weights + gradients + optimizer state, and its peak memory, with DDP and with FSDP
    for each config, runs times in turns.
    """
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
    header = ["measure (peak: " + peak + ")"]
    header += [f"{config} {'FSDP' if fsdp else 'DDP'} median (min-max)" for config, fsdp in columns]
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
    return [
        (f"sampling tokens/s, KV cache, batched ({what})", summary(cached, "{:,.0f}")),
        (f"sampling tokens/s, no cache, one at a time ({what})", summary(uncached, "{:,.0f}")),
        (
            "sampling speedup (each cached run over the uncached run after it)",
            summary([c / u for c, u in zip(cached, uncached)], "{:.1f}x"),
        ),
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
        raise SystemExit(f"error: {e}") from None
    if not text:
        raise SystemExit(f"error: {path} is empty; pass a non-empty --bpe_input")
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


def print_table(header, rows):
    """A Markdown table, ready to paste into the README or an issue; rows: (name, [one value per column])."""
    width = max(len(name) for name, _ in [(header[0], None), *rows])
    print("| " + " | ".join([f"{header[0]:<{width}}", *header[1:]]) + " |")
    print("|" + "|".join(["-" * (width + 2), *("-" * (len(h) + 2) for h in header[1:])]) + "|")
    for name, values in rows:
        print("| " + " | ".join([f"{name:<{width}}", *values]) + " |")


def main(cfg):
    """Measure what cfg.parts names and print tables: each value a median with its spread, a column per config."""
    parts = set(cfg.parts.split(","))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {device}, torch {torch.__version__}")
    # (header, rows) of each table; rows: (name, [one value per column]), or (name, value) for a single column
    tables = []
    columns = [f"{c} median (min-max)" for c in cfg.configs]
    # runs, checkpoints and the bpe corpus live in a temporary folder, removed at the end
    with tempfile.TemporaryDirectory() as work:
        rows = bench_training(cfg, Path(work)) if "train" in parts else []
        if "sample" in parts and cfg.out_dir:  # one given checkpoint: a table of its own
            tables.append((["measure", f"{cfg.out_dir} median (min-max)"], bench_sampling(cfg, cfg.out_dir)))
        elif "sample" in parts:  # each config's last training run's checkpoint, still in the temporary folder
            by_config = [bench_sampling(cfg, Path(work) / f"config{i}-run{cfg.runs - 1}") for i in range(len(columns))]
            rows += [(name, [rs[j][1] for rs in by_config]) for j, (name, _) in enumerate(by_config[0])]
        if rows:
            tables.insert(0, (["measure", *columns], rows))
        if "bpe" in parts:  # the tokenizer's speed does not depend on a config
            tables.append((["measure", "median (min-max)"], bench_bpe(cfg, Path(work))))
        if "memory" in parts:
            tables.append(bench_memory(cfg, Path(work)))
    for header, rows in tables:
        print_table(header, [(name, values if isinstance(values, list) else [values]) for name, values in rows])


def cli(argv):
    """The command line; returns the exit status: 2 with a one-line message for bad settings."""
    try:
        cfg = parse_config(BenchConfig, argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    main(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
