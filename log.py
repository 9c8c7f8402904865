"""
What the scripts say. Every script: log, a line printed on rank 0 alone, and one_line, an error shortened to the one
line an error report quotes; train.py's fail, that line reported once over the ranks. A training run: the lines
that open it (describe_run), while it trains a progress line every log_interval steps (loss, learning rate, gradient
norm, ms/iter, tokens/s, MFU on known GPUs, time left) and TensorBoard (and W&B) scalars, at the end each rank's
memory.
"""

import contextlib
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from config import ConfigError


def log(message):
    """Print on rank 0 only (torchrun sets RANK); flushed so piped logs stay current."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


def one_line(error):
    """The first line of an error's message (at most 300 characters), for one-line error reports."""
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else type(error).__name__


# Progress of a long job that is not a run (an evaluation): a bar redrawn in place on a terminal, and elsewhere (a log
# file, a pipe, a scheduler's output) a line at least this many seconds apart, so that it is never silent for minutes
PROGRESS_SECONDS = 30.0


class Lines:
    """stderr for one tqdm bar, each of its in-place redraws ('\\r' then the bar) written as a line of its own."""

    def __init__(self):
        self.last = ""  # tqdm draws its last count twice as it closes (the rate updated): written once

    def write(self, text):
        line = text.strip("\r\n")
        if line and line.split(" [")[0] != self.last:
            sys.stderr.write(line + "\n")
            self.last = line.split(" [")[0]

    def flush(self):
        sys.stderr.flush()


def progress_bar(iterable=None, *, total=None, unit, shown=True):
    """tqdm on stderr: a bar on a terminal, else a line every PROGRESS_SECONDS; shown=False: nothing at all."""
    if sys.stderr.isatty():
        return tqdm(iterable, total=total, unit=unit, file=sys.stderr, disable=not shown)
    return tqdm(iterable, total=total, unit=unit, file=Lines(), mininterval=PROGRESS_SECONDS, disable=not shown)


# seconds a rank other than 0 waits before printing its error (fail)
ERROR_GRACE = 5.0


def fail(message, status):
    """
    Report `train.py: error: message` once and return status. Under torchrun, the first rank to exit makes torchrun
    end the others: rank 0 reports at once, the other ranks only after ERROR_GRACE seconds, so that an error all
    ranks meet (a setting, or one that setup shares among them) is reported by rank 0 alone, while rank 0 is still
    there, and an error of one rank alone still shows. torchrun's summary of the failure, the last thing it prints,
    then carries the line (through the error file it reads from each failed rank) in place of a traceback.
    """
    if int(os.environ.get("RANK", "0")):
        time.sleep(ERROR_GRACE)
    line = f"train.py: error: {message}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        # the error file's format (torch.distributed.elastic's ErrorHandler): the summary shows py_callstack
        extra = {"py_callstack": line, "timestamp": str(int(time.time()))}
        Path(error_file).write_text(json.dumps({"message": {"message": line, "extraInfo": extra}}))
    else:
        print(line, file=sys.stderr, flush=True)
    return status


def describe_run(cfg, rt, dataset, model, per_rank, optimizer_summary, schedule_notes):
    """The lines that open a training run's log: what trains on what, the step's shape (per_rank micro-batches per
    rank), the learning rate's notes (optim.schedule_notes), the optimizers, and notes."""
    log(
        f"{cfg.arch} on {dataset}: {model.num_params():,} parameters, {rt.device} {str(rt.dtype)[6:]}, "
        f"{rt.world_size} rank(s); {cfg.batch_size * per_rank * rt.world_size} sequences per step "
        f"({cfg.batch_size} x {per_rank} micro-batches x {rt.world_size} rank(s))"
    )
    if per_rank * rt.world_size > cfg.gradient_accumulation_steps:
        log(
            f"note: gradient_accumulation_steps={cfg.gradient_accumulation_steps} is fewer than the "
            f"{rt.world_size} ranks: each rank runs one micro-batch, so a step sees {rt.world_size} x batch_size "
            "sequences"
        )
    if cfg.fsdp and not rt.fsdp:
        log("note: fsdp=True with one process: nothing to shard over, the model is trained whole")
    if cfg.max_minutes:
        log(
            f"a time budget: {cfg.max_minutes:g} minute(s) of training, at most {cfg.max_iters:,} steps; the "
            "learning rate follows whichever is further along (--max_minutes=0 for a run that repeats exactly)"
        )
    for line in (*schedule_notes, optimizer_summary):
        log(line)
    if cfg.optimizer == "muon" and rt.device.type == "cpu":
        # docs/performance.md, "The modern recipe on 2 CPU cores"
        log(
            "note: Muon orthogonalises in float32 on a CPU: about 1.3x an AdamW step here; optimizer='adamw' is "
            "the faster choice on CPUs"
        )


@dataclass
class Step:
    """One optimizer step's results: device tensors (loss, grad_norm, skipped) and host numbers."""

    # device tensors (torch, imported where used: the scripts that only log, prepare_data.py, never load it)
    loss: object  # this rank's share of the step's mean loss
    grad_norm: object
    skipped: object  # 1.0 if the gradient was not finite and the weights were left as they were
    lr: float
    tokens: int  # input tokens on all ranks
    flops: float  # of this rank's matmuls (counted only where MFU is reported)
    seconds: float  # the run's training time when the step began, agreed by the ranks (Clock)


class Clock:
    """A run's training time in seconds, evaluations included: what max_minutes budgets, carried over a resume."""

    def __init__(self, before):
        self.before, self.start = before, time.perf_counter()  # before: the seconds of the run this one resumes

    def seconds(self):
        return self.before + time.perf_counter() - self.start


@dataclass
class Window:
    """The training steps since the last progress line: their wall time (evaluations left out), tokens, FLOPs."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    tokens: int = 0
    flops: float = 0.0


class Progress:
    """
    The progress of a run: each step's results go in with add(), which prints the progress line every log_interval
    steps; `losses` collects {iteration: mean train loss over the ranks} of the steps read back so far. The latest
    steps' losses stay on the device until a progress line or an evaluation reads them (read): reading a number
    from a GPU waits for all the work queued before it, so a read every step would leave the GPU idle.
    """

    def __init__(self, cfg, rt, scalars, peak_flops):
        self.max_iters, self.log_interval, self.scalars = cfg.max_iters, cfg.log_interval, scalars
        self.budget = 60 * cfg.max_minutes or math.inf  # seconds; no budget: the steps alone say when it ends
        self.peak_flops = peak_flops  # of this GPU, for MFU; None on CPUs and unknown GPUs
        self.world_size, self.window, self.losses = rt.world_size, Window(), {}
        self.pending = []  # (iteration, this rank's share of the step's mean loss), not read back yet
        import torch

        self.skipped = torch.zeros((), device=rt.device)  # steps with a non-finite gradient since the last read
        self.unreported = 0  # skipped steps read back but not yet said

    def add(self, iter_num, step):
        """Step number iter_num (a Step) is done; on a log_interval, read the losses back and print the line."""
        self.pending.append((iter_num, step.loss))
        self.skipped += step.skipped
        window = self.window
        window.steps += 1
        window.tokens += step.tokens
        window.flops += step.flops
        if iter_num % self.log_interval == 0:
            self.read()  # waits for the device: the window's time is real
            self.log_line(iter_num, step)
            self.window = Window()

    def read(self):
        """
        Read the pending steps' losses back into `losses`, averaged over the ranks; FloatingPointError at the first
        non-finite one. The count of skipped steps waits in `unreported` until a line says it.
        """
        if not self.pending:
            return
        import torch
        import torch.distributed as dist

        # one stacked tensor: one all-reduce and one device-to-host copy for all the pending steps
        losses = torch.stack([loss for _, loss in self.pending])
        if self.world_size > 1:
            dist.all_reduce(losses)
        # the skipped count rides in the same copy, so reading it costs no second wait
        *losses, skipped = torch.cat([losses.float(), self.skipped[None]]).tolist()
        iterations = [iteration for iteration, _ in self.pending]
        self.pending, self.skipped = [], torch.zeros_like(self.skipped)
        self.unreported += int(skipped)
        for iteration, loss in zip(iterations, losses):
            if not math.isfinite(loss):
                raise FloatingPointError(
                    f"loss is {loss} at iteration {iteration}; stopped at iteration "
                    f"{iterations[-1]} with nothing saved since, so the last checkpoint is "
                    "untouched. Lower learning_rate or raise warmup_iters"
                )
        self.losses.update(zip(iterations, losses))

    @contextlib.contextmanager
    def paused(self):
        """Leave what runs inside (an evaluation, a save) out of the training time of the progress line."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.window.start += time.perf_counter() - began

    def finish(self):
        """At the end of a run: the last losses read back, and steps skipped since the last line said."""
        self.read()
        if self.unreported:
            log(f"{self.unreported} step(s) skipped since the last progress line: gradient not finite")

    def log_line(self, iter_num, step):
        """The progress line of iteration iter_num and its TensorBoard scalars; the losses have just been read."""
        window, loss, skipped = self.window, self.losses[iter_num], self.unreported
        self.unreported = 0
        seconds = time.perf_counter() - window.start
        # tokens per second of training time: evaluations are left out of window.start
        norm, speed = step.grad_norm.item(), window.tokens / seconds
        values = {"train/loss": loss, "train/lr": step.lr, "train/grad_norm": norm, "perf/tokens_per_sec": speed}
        line = (
            f"iter {iter_num}/{self.max_iters} | loss {loss:.4f} | lr {step.lr:.2e} | grad norm {norm:.3f} | "
            f"{1000 * seconds / window.steps:.1f} ms/iter | {speed:,.0f} tok/s"
        )
        if self.peak_flops:
            # MFU: the fraction of this GPU's peak FLOP/s that the model's matmuls used
            values["perf/mfu"] = window.flops / seconds / self.peak_flops
            line += f" | mfu {values['perf/mfu']:.1%}"
        if skipped:
            line += f" | {skipped} step(s) skipped: gradient not finite, weights left as they were"
        # whichever ends the run first: the steps left at this pace, or the time budget
        left = min((self.max_iters - iter_num) * seconds / window.steps, self.budget - step.seconds)
        log(f"{line} | eta {format_eta(max(left, 0.0))}")
        self.scalars.add(iter_num, values)


def format_eta(seconds):
    """seconds as '1h05m' or '4m09s': the time left, on the progress line."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class Scalars:
    """TensorBoard (and W&B) scalars; inert on ranks other than 0 and when both are off."""

    def __init__(self, cfg, active):
        self.tensorboard = self.wandb = None
        if active and cfg.tensorboard:
            try:
                # imported only when asked for: TensorBoard and W&B are optional dependencies
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("tensorboard=True needs: pip install tensorboard (or --tensorboard=false)") from None
            self.tensorboard = SummaryWriter(cfg.out_dir)
        if active and cfg.wandb_log:
            try:
                import wandb
            except ImportError:
                raise ConfigError("wandb_log=True needs: pip install wandb (or --wandb_log=false)") from None
            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=asdict(cfg))

    def add(self, step, values):
        if self.tensorboard:
            for name, value in values.items():
                self.tensorboard.add_scalar(name, value, step)
        if self.wandb:
            self.wandb.log(values, step=step)

    def close(self):
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()


def local_bytes(tensors):
    """The bytes of tensors that this rank holds: of a DTensor, its local part."""
    from torch.distributed.tensor import DTensor

    return sum(t.numel() * t.element_size() for t in (x.to_local() if isinstance(x, DTensor) else x for x in tensors))


def state_bytes(model, optimizers):
    """
    This rank's bytes of model's weights, gradients (one per trained weight) and the optimizers' state ({name:
    optimizer}): {"weights", "gradients", "optimizer"}. Under FSDP, the rank's shards only.
    """
    params = list(model.parameters())
    states = [v for opt in optimizers.values() for state in opt.state.values() for v in state.values()]
    return {
        "weights": local_bytes(params),
        "gradients": local_bytes(p for p in params if p.requires_grad),
        "optimizer": local_bytes(v for v in states if hasattr(v, "element_size")),  # tensors, not step counts
    }


def resident_peak():
    """
    This process's peak resident set in bytes: Linux's VmHWM, which starts afresh with the program, unlike ru_maxrss,
    which a child started from a large process (a test runner) inherits; elsewhere ru_maxrss.
    """
    try:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)[1]) * 1024
    except (OSError, TypeError):
        import resource  # Unix only: imported where needed. ru_maxrss counts KiB on Linux, bytes on macOS

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def log_memory(model, optimizers, rt):
    """
    One line per rank (rank 0 prints them all), in MiB: state_bytes of model (the plain model) and optimizers ({name:
    optimizer}), and the peak: the most CUDA memory allocated, or on a CPU the process's peak resident set (the
    interpreter and the libraries included). Call it on every rank.
    """
    import torch

    peak = torch.cuda.max_memory_allocated(rt.device) if rt.device.type == "cuda" else resident_peak()
    uses = [{name: n / 2**20 for name, n in {**state_bytes(model, optimizers), "peak": peak}.items()}]
    if rt.world_size > 1:
        import torch.distributed as dist

        mine, uses = uses[0], [None] * rt.world_size
        dist.all_gather_object(uses, mine)
    where = "CUDA allocated" if rt.device.type == "cuda" else "process resident set"
    for rank, use in enumerate(uses):
        log(
            f"memory rank {rank}: weights {use['weights']:.1f} MiB, gradients {use['gradients']:.1f} MiB, "
            f"optimizer state {use['optimizer']:.1f} MiB, peak {use['peak']:.1f} MiB ({where})"
        )
