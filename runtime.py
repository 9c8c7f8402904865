"""
Where a script runs: its device and precision, the CPU threads it takes, and the GPUs known by name. And how a
training run is spread over processes: this process's place (Runtime), the process group, the few collectives
train.py needs and the signals that stop it, parallelize() (activation checkpointing, then FSDP2 or DDP, then
torch.compile, in that order) and what a step does differently over the ranks (gradient_sync, clip_gradients).
"""

import contextlib
import copy
import ctypes
import inspect
import math
import os
import re
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import compiling
from config import ConfigError
from model import Block, build_model

# -----------------------------------------------------------------------------
# The device, the precision, the threads and the known GPUs

# what every script's dtype setting accepts; resolve_dtype turns auto into one of the others
DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_device(name, local_rank):
    """torch.device for 'auto' (cuda, mps, cpu in that order) or an explicit name; CUDA ranks get their own GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device={name!r} is not a device; use auto, cpu, cuda, cuda:N or mps") from None
    # torch.device('cuda') parses on any machine: whether it is there is a separate question
    available = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available.get(device.type, True):
        raise ConfigError(f"device={name!r} is not available on this machine; use --device=cpu")
    # a bare 'cuda' means this rank's own GPU, so that 8 ranks on one machine do not all use GPU 0
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def resolve_dtype(name, device, native_bf16=None, gpu="this GPU", fsdp=False):
    """
    The torch dtype for dtype setting `name` on device ('auto' resolved); ConfigError where it cannot run.
    native_bf16: whether the GPU (named gpu in messages) computes bfloat16 natively; None: ask this machine's.
    fsdp: for a model sharded over ranks, whose runs have no gradient scaler for float16.
    """
    # V100s and T4s run bfloat16 only by emulation (slowly): they count as having none, and get float16 + scaler
    if native_bf16 is None:
        native_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    if name == "auto":
        name = "float32" if device.type != "cuda" else "bfloat16" if native_bf16 else "float16"
    if name == "float16" and device.type != "cuda":
        raise ConfigError(f"dtype=float16 needs CUDA (its gradient scaler); on {device.type} use bfloat16 or float32")
    if name == "bfloat16" and device.type == "cuda" and not native_bf16:
        raise ConfigError(f"{gpu} has no native bfloat16; use --dtype=float16")
    if name == "float16" and fsdp:
        raise ConfigError(
            "fsdp=True computes in bfloat16 or float32, not float16 (whose gradient scaler FSDP runs lack); use "
            "--dtype=bfloat16, or DDP (fsdp=False) on GPUs without bfloat16"
        )
    return getattr(torch, name)


def autocast(device, dtype):
    """Mixed precision for forward passes when dtype is not float32; a no-op otherwise."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def pick_threads(requested, local_ranks, spare=0):
    """
    (intra-op threads for this process, why: a line to log or None). requested > 0 wins; then OMP_NUM_THREADS
    (torchrun sets 1 per rank); else the cores of this machine that other jobs are not using (busy_cores), less
    `spare` kept for this process's own other thread (serve.py's HTTP loop), shared among the local_ranks processes.
    On a busy machine, threads that wait for a taken core make every op wait for the slowest one
    (docs/training.md#devices-and-threads has the measurements).
    """
    if requested > 0:
        return requested, None
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"])), None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    busy = min(round(busy_cores()), cores - 1)
    threads = max(1, (cores - busy - spare) // local_ranks)
    if busy == 0:
        return threads, None
    return threads, (
        f"note: {threads} thread(s) per process: other jobs keep about {busy} of the {cores} cores busy; "
        "--threads=N overrides, and one job at a time is fastest"
    )


def use_device(cfg, rt):
    """
    Set this process up on its device, before anything uses it; returns pick_threads' note on a CPU, or None. On
    CUDA, this rank's GPU becomes the current one before anything uses CUDA (NCCL, allocations), or a context on GPU
    0 would take its memory on every rank; and TF32 matmuls (Ampere and newer): far faster, precise enough to train.
    """
    if rt.device.type == "cuda":
        torch.cuda.set_device(rt.device)
        torch.set_float32_matmul_precision("high")
    if rt.device.type != "cpu":
        return None
    threads, note = pick_threads(cfg.threads, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(threads)
    return note


def busy_cores(looks=20):
    """
    About how many cores other jobs use now: on Linux the median, over `looks` looks 5 ms apart, of the tasks
    running (the fourth field of /proc/loadavg, this process left out). Elsewhere the 1-minute load average, which
    lags behind: a job that just ended still counts for a minute or more.
    """
    try:
        counts = []
        for _ in range(looks):
            # "0.91 0.86 1.02 2/90 14010": 2 tasks running (this one among them) of 90
            counts.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1)
            time.sleep(0.005)
        return statistics.median(counts)
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


# glibc's mmap threshold as keep_freed_memory sets it (its maximum): a smaller block comes from the heap, which keeps it
MMAP_THRESHOLD = 32 << 20


def keep_freed_memory():
    """
    Have glibc keep freed memory for reuse instead of handing it back to the OS. A CPU training step frees and
    reallocates the same activation buffers every time; by default glibc maps the large ones afresh, and the page
    faults of touching them again cost 5-15% of a small model's step (docs/performance.md). No-op without glibc.
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # macOS, Windows, musl, or a C library without mallopt
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    mallopt(m_mmap_threshold, MMAP_THRESHOLD)  # blocks up to 32 MiB come from the reusable heap
    mallopt(m_trim_threshold, 1 << 30)  # and up to 1 GiB of freed heap is kept rather than returned


@dataclass(frozen=True)
class GPU:
    """A GPU that MFU is measured on and plans are made for (--plan_device)."""

    name: str  # as --plan_device names it
    pattern: str  # searched in the name torch.cuda.get_device_name returns
    memory_gib: int  # from the vendor's data sheet
    flops: float  # peak dense bf16 tensor-core FLOP/s with float32 accumulation (what training runs; no sparsity)
    bf16: bool = True  # False: bfloat16 only by emulation, so float16 with a gradient scaler (and fp16's peak)
    # streaming multiprocessors of the whole GPU, where MIG splits it into slices ("NVIDIA H100 80GB HBM3 MIG
    # 1g.10gb"), each computing with its own share of them. The "Ng" of a profile's name is only nominal: on an H100
    # a 1g.10gb slice has 16 of the 132, a 1g.20gb 26, a 7g.80gb all 132; on an A100 a 7g.40gb has 98 of the 108
    multiprocessors: int | None = None


# From the vendors' data sheets. Tried in order by a device's name: a variant comes before the family name it
# contains (a later entry of the same family, the 40 GB A100 say, is there for plans by name only)
GPUS = (
    GPU("H100 PCIe", r"\bH100 PCIe\b", 80, 756e12, multiprocessors=114),  # "NVIDIA H100 PCIe"
    GPU("H100 NVL", r"\bH100 NVL\b", 94, 835e12, multiprocessors=132),  # "NVIDIA H100 NVL"
    GPU("H200 NVL", r"\bH200 NVL\b", 141, 835e12, multiprocessors=132),
    GPU("H100", r"\bH100\b", 80, 989e12, multiprocessors=132),  # SXM: "NVIDIA H100 80GB HBM3"
    GPU("H200", r"\bH200\b", 141, 989e12, multiprocessors=132),  # "NVIDIA H200"
    GPU("GH200", r"\bGH200\b", 96, 989e12, multiprocessors=132),  # the Grace Hopper superchip's GPU, the H100 SXM's
    GPU("A100", r"\bA100\b", 80, 312e12, multiprocessors=108),  # "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB"
    GPU("A100 40GB", r"\bA100\b", 40, 312e12, multiprocessors=108),
    GPU("A10G", r"\bA10G\b", 24, 70e12),
    GPU("A10", r"\bA10\b", 24, 125e12),
    GPU("L40S", r"\bL40S\b", 48, 362e12),
    GPU("L40", r"\bL40\b", 48, 181e12),
    GPU("L4", r"\bL4\b", 24, 121e12),
    # fp16 for Volta and Turing, which have no bf16
    GPU("V100 PCIe", r"\bV100-PCIE\b", 32, 112e12, bf16=False),  # "Tesla V100-PCIE-32GB"
    GPU("V100S", r"\bV100S\b", 32, 130e12, bf16=False),  # "Tesla V100S-PCIE-32GB"
    GPU("V100", r"\bV100\b", 32, 125e12, bf16=False),  # "Tesla V100-SXM2-16GB"
    GPU("V100 16GB", r"\bV100\b", 16, 125e12, bf16=False),
    GPU("T4", r"\bT4\b", 16, 65e12, bf16=False),  # "Tesla T4"
    # GeForce, from NVIDIA's architecture whitepapers (Ada Lovelace, appendix table of the RTX 4090; Ampere GA102,
    # appendix A, RTX 3090): "Peak BF16 Tensor TFLOPS with FP32 Accumulate" 165.2 and 71 dense. The doubled figures
    # beside them (330.3, 142) accumulate in FP16; the halved ones (82.6, 35.6) are the TF32 and CUDA-core FP32 rates.
    GPU("RTX 4090", r"\bRTX 4090\b", 24, 165.2e12),  # "NVIDIA GeForce RTX 4090"
    GPU("RTX 3090", r"\bRTX 3090\b", 24, 71e12),
)


def peak_flops(device_name, multiprocessors=None):
    """
    Peak dense bf16 FLOP/s of a GPU from its torch.cuda.get_device_name(); None for one not in GPUS. A MIG slice gets
    the whole GPU's peak times its share of the multiprocessors (its own count; None without it).
    """
    gpu = next((gpu for gpu in GPUS if re.search(gpu.pattern, device_name)), None)
    if gpu is None or not re.search(r"\bMIG\b", device_name):
        return None if gpu is None else gpu.flops
    whole = gpu.multiprocessors
    return gpu.flops * multiprocessors / whole if whole and multiprocessors else None


def device_peak_flops(device):
    """peak_flops of device, this machine's GPU (a MIG slice's share of it); None on other devices."""
    if device.type != "cuda":
        return None
    return peak_flops(
        torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).multi_processor_count
    )


# the MFU a plan times GPU steps at, measured with tools/bench.py --parts=gpu (docs/performance.md#gpus) on
# configs/gpt2.py's model at 12 x 1024 x 4 micro-batches a step, bf16, compiled, fused AdamW; a GPU not measured yet
# gets the H100's
MEASURED_MFU = {"H100": 0.40}
# on a CPU: the model FLOP/s of training over the float32 matmul rate measured when planning (cpu_matmul_flops), the
# quick start's on 2 cores, the calibration of README.md's "Plan a run" table
CPU_MFU = 0.65
# a step that would take less than a minute even at this rate needs no prediction (none of a CPU goes faster)
CPU_FLOPS_CEILING = 5e12


def cpu_matmul_flops(threads, n=1024, repeats=5):
    """The best float32 FLOP/s of repeats n x n matmuls with `threads` threads: this CPU's dense rate."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(before)
    return 2 * n**3 / best


def step_seconds(flops, rt):
    """
    Seconds a training step of `flops` model FLOPs takes on rt's device at the rates plans use (MEASURED_MFU of the
    GPU's peak, CPU_MFU of the CPU's measured matmul rate); None where no rate is known (MPS, an unknown GPU) and on
    a CPU whose step would be short even at CPU_FLOPS_CEILING (its matmuls are then not timed).
    """
    if rt.device.type == "cuda":
        peak = device_peak_flops(rt.device)
        return None if peak is None else flops / (peak * MEASURED_MFU["H100"])
    if rt.device.type != "cpu" or flops / CPU_FLOPS_CEILING < 60:
        return None
    return flops / (cpu_matmul_flops(torch.get_num_threads()) * CPU_MFU)


# -----------------------------------------------------------------------------
# Processes


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: its rank among world_size processes (torchrun sets them), its device and dtype."""

    rank: int = 0
    local_rank: int = 0  # rank within this machine: which GPU is ours
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32  # what forward passes compute in; float32 means no mixed precision
    fsdp: bool = False  # the model is sharded over the ranks with FSDP (else whole on each rank, under DDP)

    def autocast(self):
        """Mixed precision for a forward pass: autocast to dtype, except under FSDP, whose own policy casts."""
        return autocast(self.device, torch.float32 if self.fsdp else self.dtype)


def make_runtime(cfg):
    """The Runtime of this process: ranks from torchrun's variables, device and dtype from cfg."""
    # torchrun sets RANK, LOCAL_RANK and WORLD_SIZE in each process; a plain `python train.py` is rank 0 of 1
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(cfg.device, local_rank)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_cuda_graphs(cfg, world_size)
    if cfg.cuda_graphs and device.type != "cuda":
        raise ConfigError(f"cuda_graphs=True needs a CUDA GPU, not device {device}; drop --cuda_graphs")
    dtype = resolve_dtype(cfg.dtype, device, fsdp=cfg.fsdp)
    # one process has nothing to shard over: it trains the whole model, as without fsdp (setup says so)
    return Runtime(rank, local_rank, world_size, device, dtype, fsdp=cfg.fsdp and world_size > 1)


def split_accumulation(steps, world_size):
    """
    Micro-batches per rank: the global gradient_accumulation_steps shared out over the ranks. Fewer steps than
    ranks (e.g. the quick start's 1 on 2 ranks) give each rank one micro-batch, as nanoGPT users expect.
    """
    if steps < world_size:
        return 1
    if steps % world_size:
        raise ConfigError(
            f"gradient_accumulation_steps={steps} does not divide among {world_size} ranks; "
            f"make it a multiple of {world_size}"
        )
    return steps // world_size


def check_cuda_graphs(cfg, world_size):
    """
    cuda_graphs' one-line refusals, before anything runs (train.py and --plan alike), of what its replays cannot
    train yet. More than one micro-batch per rank: gradients cleared to None are made by the first backward inside
    the CUDA-graph pool, and the next micro-batch's forward starts a new generation of graphs that overwrites them
    (PyTorch's cudagraph_trees errors with "reduce-overhead and gradient accumulation"); DDP's no_sync path is that
    case too. FSDP over ranks: its gathers and reduce-scatters run outside the graphs, untested under replay.
    """
    if not cfg.cuda_graphs:
        return
    per_rank = split_accumulation(cfg.gradient_accumulation_steps, world_size)
    if per_rank > 1:
        raise ConfigError(
            f"cuda_graphs=True replays one micro-batch per rank a step, not {per_rank} (gradient_accumulation_steps="
            f"{cfg.gradient_accumulation_steps} on {world_size} rank(s)): for the same step use --batch_size="
            f"{cfg.batch_size * per_rank} --gradient_accumulation_steps={world_size}, or drop --cuda_graphs"
        )
    if cfg.fsdp and world_size > 1:
        raise ConfigError("cuda_graphs=True does not replay FSDP's sharded steps: use DDP (--fsdp=false) or drop it")


def init_distributed(cfg, rt, stack):
    """Join the torchrun job (a no-op in one process); returns the host-side gloo group, or None."""
    if rt.world_size == 1:
        return None
    backend = cfg.backend if cfg.backend != "auto" else "nccl" if rt.device.type == "cuda" else "gloo"
    # the timeout turns a dead or stuck rank into an error on the others instead of a hang, in both groups
    timeout = timedelta(seconds=cfg.dist_timeout)
    # device_id: NCCL binds the group to this rank's GPU at once, instead of guessing it at the first collective
    dist.init_process_group(backend, timeout=timeout, device_id=rt.device if rt.device.type == "cuda" else None)
    stack.callback(dist.destroy_process_group)
    # target counts and stop votes are host numbers: summing them over gloo never waits for the GPU
    return dist.new_group(backend="gloo", timeout=timeout)


def all_reduce(values, rt):
    """Sum numbers and 0-d tensors over the ranks in one collective; returns a tensor on rt.device."""
    dtype = torch.float32 if rt.device.type == "mps" else torch.float64  # float64 keeps token counts exact
    tensor = torch.stack([torch.as_tensor(v, device=rt.device).to(dtype) for v in values])
    if rt.world_size > 1:
        dist.all_reduce(tensor)
    return tensor


def agreed_minimum(value, world_size, group=None):
    """The smallest of the ranks' integers value, on every rank: so that each rank decides alike. group: over which."""
    if world_size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)  # on the CPU: the group must be gloo (train.py's host group)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor.item())


def raise_if_any_failed(error, world_size, group=None):
    """
    Every rank passes its one-line error (or None); if any rank failed, all raise the first rank's error at once,
    instead of the others waiting in their next collective until dist_timeout (group: over which).
    """
    errors = [error]
    if world_size > 1:
        errors = [None] * world_size
        # every rank receives every rank's message (a string or None)
        dist.all_gather_object(errors, error, group=group)
    # the lowest failing rank's message: every rank raises the same one
    failed = next((e for e in errors if e), None)
    if failed:
        raise ConfigError(failed)


class StopRequest:
    """
    SIGINT and SIGTERM set a flag: the loop finishes its step, saves and exits. A second SIGINT acts as usual (Ctrl-C
    twice interrupts a save that hangs); SIGTERM stays caught: launchers send it more than once (SLURM to every
    process of a job step, and torchrun forwards it to its workers again), and they SIGKILL after their grace time.
    """

    def __enter__(self):
        self.signal = None
        # the handlers replaced are kept, to be put back after the first signal and at exit
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def handle(self, signum, frame):
        # the name ('SIGTERM') for the log; the loop checks it before each step
        self.signal = signal.Signals(signum).name
        # so that a second Ctrl-C interrupts at once, should the save hang
        if signum == signal.SIGINT:
            signal.signal(signum, self.previous[signum])

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


# -----------------------------------------------------------------------------
# The model over the ranks


@dataclass
class Models:
    """
    The model under the name of each use. All but the average share raw's parameters.

        raw      the plain model: what the optimizers update, what is saved, counted and measured (under FSDP
                 its weights are sharded in place, each rank holding its shards)
        step     what a training step calls: raw, under DDP and/or compiled
        ddp      the DDP module inside step (gradient_sync turns its all-reduce off until the last micro-batch);
                 None without DDP
        average  with ema_decay: the moving average of raw's weights (sharded alike), never trained; else None
        eval     what evaluation calls: the average if there is one, else raw compiled as step is; never DDP,
                 since ranks may evaluate different numbers of batches
    """

    raw: nn.Module
    step: nn.Module
    ddp: DDP | None = None
    average: nn.Module | None = None
    eval: nn.Module | None = None

    @property
    def kept(self):
        """What is saved as best.pt, decoded for accuracy and sampled: the average if there is one, else raw."""
        return self.raw if self.average is None else self.average

    @property
    def compiled(self):
        """Whether a step runs compiled graphs: step is compiled and has not fallen back to the eager model."""
        return isinstance(self.step, compiling.CompiledModel) and not self.step.failed


def parallelize(model, cfg, rt, task):
    """
    Models for training `model` (on the CPU, or on the meta device under FSDP) on this process's ranks, made in
    this order, as torchtitan's parallelize does:
      1. activation checkpointing, if cfg says so: each block recomputed in the backward;
      2. FSDP2 (fsdp under torchrun): each block, then the root, sharded over the ranks; or DDP (torchrun without
         fsdp), which also gives every rank rank 0's initial weights; or neither, in one process;
      3. torch.compile (cfg.compile; None: on CUDA only), tried on the task's example batch. DDP is compiled, not
         wrapped around a compiled model: its graph is then split at the gradient buckets, so each bucket's
         all-reduce starts while the backward of the layers before it still runs;
      4. with ema_decay, the weight average: a copy, sharded alike.
    Call it before the optimizers are built: FSDP replaces the parameters with sharded ones.
    """
    model.set_activation_checkpointing(cfg.activation_checkpointing)
    ddp = None
    if rt.fsdp:
        shard_model(model, rt, cfg.seed)
    else:
        model.to(rt.device)
        if rt.world_size > 1:
            # no buffer needs syncing before each forward (the position tables are computed alike everywhere), and
            # gradients that are views into DDP's buckets save a copy of them. PyTorch 2.13 renamed the first
            # option (forward_sync_buffers) and warns on every rank about the old name, which older versions need
            device_ids = [rt.device.index] if rt.device.type == "cuda" else None
            renamed = "forward_sync_buffers" in inspect.signature(DDP).parameters
            no_sync = {"forward_sync_buffers" if renamed else "broadcast_buffers": False}
            ddp = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True, **no_sync)
    average = average_model(model, rt, cfg.seed) if cfg.ema_decay else None
    step, evaluated = ddp or model, model if average is None else average
    if cfg.compile or cfg.compile is None and rt.device.type == "cuda":
        # fixed shapes (windows): graphs specialised to them; pairs and conversations vary in length: one dynamic graph
        how = dict(dynamic=None if task.varying else False, regions=cfg.compile_regions)
        how["mode"] = "reduce-overhead" if cfg.cuda_graphs else None
        step = compiling.compile_model(step, task, cfg.batch_size, cfg.block_size, rt, **how)
        if isinstance(step, compiling.CompiledModel):
            # evaluation stays outside DDP and measures the average if there is one: compiled apart, unless it is
            # exactly what a step calls
            evaluated = step if step.module is evaluated else compiling.CompiledModel(evaluated, **how)
    return Models(model, step, ddp, average, evaluated)


def shard_model(model, rt, seed, mesh=None):
    """
    FSDP2 over the ranks: each Block sharded as a unit, then the root (embeddings, head, final norm), so that a
    block's weights are gathered just before its forward and backward and freed after. A model built on the meta
    device gets memory for its shards only and is initialised with seed on every rank: the same weights as an
    unsharded model built after torch.manual_seed(seed). With rt.dtype other than float32 (bfloat16 on CUDA), a
    mixed-precision policy replaces autocast: weights gathered in rt.dtype for the forward and backward, gradients
    reduced in float32, the sharded weights and AdamW's state kept in float32. mesh: the ranks' DeviceMesh; None: a
    new one over all of them.
    """
    # imported here: only FSDP runs shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh is None:
        mesh = init_device_mesh(rt.device.type, (rt.world_size,))
    policy = MixedPrecisionPolicy()  # float32: no casts
    if rt.dtype != torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=rt.dtype, reduce_dtype=torch.float32)
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if next(model.parameters()).is_meta:
        model.to_empty(device=rt.device)
        # every rank draws the same values on the CPU (each keeps its part); the per-rank generators of dropout
        # are left as they were (torch.manual_seed would also reset every GPU's)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            model.init_weights()
    return model


def average_model(model, rt, seed):
    """A copy of model for the weight average (sharded alike under FSDP): never trained, always in eval mode."""
    if not rt.fsdp:
        return copy.deepcopy(model).eval().requires_grad_(False)
    with torch.device("meta"):
        average = build_model(model.config)
    average = shard_model(average, rt, seed)
    # each rank copies its own shards: sharded state dicts load into a model sharded alike
    average.load_state_dict(model.state_dict())
    return average.eval().requires_grad_(False)


def gradient_sync(models, enabled):
    """
    A context for one micro-batch's backward; enabled: it is the last of its step. DDP exchanges nothing until then
    (no_sync: its gradients add up on this rank), then all-reduces the sums. FSDP reduce-scatters every
    micro-batch's gradients as they come (nothing to do here), so that each rank only ever holds its shards.
    """
    return models.ddp.no_sync() if models.ddp is not None and not enabled else contextlib.nullcontext()


def clip_gradients(parameters, max_norm):
    """
    Scale the gradients of parameters (a list) so that their global norm is at most max_norm; returns the norm from
    before. Under FSDP each rank holds a shard of each gradient: the norm is taken over all the shards of all ranks.
    """
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    # a DTensor exists only once FSDP has imported its module, which a script that never shards need not import
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(norm, dtensor.DTensor):
        norm = norm.full_tensor()  # every rank's part of the sum of squares, added up
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm
