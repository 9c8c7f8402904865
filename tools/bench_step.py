"""
tools/bench.py --parts=step, the core of its GPU harness: each case (a train.py config and overrides) in a child
process of its own that sets up train.py's run and times its real training step on the device, nanoGPT's train.py
timed beside as it times itself, and the table of both.
"""

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import train
from bench_common import ROOT, compile_env, launch, nanogpt_env, summary
from config import parse_config
from log import one_line, resident_peak
from runtime import make_runtime

# nanoGPT's train.py beside ours (--nanogpt): GPT-2 124M's shape on its BPE tiny Shakespeare, 12 x 1024 x 4 per step,
# as configs/gpt2.py --gradient_accumulation_steps=4 (its compile, bfloat16 and fused AdamW are its defaults on a GPU)
NANOGPT_STEP = (
    "config/train_gpt2.py --dataset=shakespeare --gradient_accumulation_steps=4 --eval_interval=1000000 "
    "--eval_iters=1 --log_interval=1 --wandb_log=False"
)


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
