"""
Where a script runs and in which precision: the `device` and `dtype` settings of train.py and sample.py resolved
for this machine, autocast for mixed precision, and the GPUs known by name: memory, peak FLOP/s (for MFU), bf16.
"""

import ctypes
import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from config import ConfigError

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


def resolve_dtype(name, device, native_bf16=None, gpu="this GPU"):
    """
    The torch dtype for dtype setting `name` on device ('auto' resolved); ConfigError where it cannot run.
    native_bf16: whether the GPU (named gpu in messages) computes bfloat16 natively; None: ask this machine's.
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
    return getattr(torch, name)


def autocast(device, dtype):
    """Mixed precision for forward passes when dtype is not float32; a no-op otherwise."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def pick_threads(requested, local_ranks):
    """
    (intra-op threads for this process, why: a line to log or None). requested > 0 wins; then OMP_NUM_THREADS
    (torchrun sets 1 per rank); else the cores of this machine that other jobs are not using (busy_cores), shared
    among the local_ranks processes. On a busy machine, threads that wait for a taken core make every op wait for
    the slowest one (docs/training.md#devices-and-threads has the measurements).
    """
    if requested > 0:
        return requested, None
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"])), None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    busy = min(round(busy_cores()), cores - 1)
    threads = max(1, (cores - busy) // local_ranks)
    if busy == 0:
        return threads, None
    return threads, (
        f"note: {threads} thread(s) per process: other jobs keep about {busy} of the {cores} cores busy; "
        "--threads=N overrides, and one job at a time is fastest"
    )


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
    mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum: blocks up to 32 MiB come from the reusable heap
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
    Peak dense bf16 FLOP/s of a GPU from its torch.cuda.get_device_name(); None for one not in GPUS.
    A MIG slice gets the whole GPU's peak times its share of the streaming multiprocessors: multiprocessors is the
    slice's own count (torch.cuda.get_device_properties(device).multi_processor_count); None without it.
    """
    gpu = next((gpu for gpu in GPUS if re.search(gpu.pattern, device_name)), None)
    if gpu is None or not re.search(r"\bMIG\b", device_name):
        return None if gpu is None else gpu.flops
    whole = gpu.multiprocessors
    return gpu.flops * multiprocessors / whole if whole and multiprocessors else None
