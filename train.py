"""
Train a GPT, a masked-LM encoder or an encoder-decoder: one loop, from a laptop CPU to many GPUs.

    python train.py configs/shakespeare.py                          # device and dtype picked automatically
    python train.py configs/shakespeare.py --max_iters=500 --device=cpu
    torchrun --standalone --nproc_per_node=8 train.py configs/gpt2.py
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 train.py configs/gpt2.py
    python train.py --help                                          # every setting with its default and meaning

One optimizer step sees batch_size * gradient_accumulation_steps sequences; the accumulation steps are
shared out over the ranks, so a config means the same optimisation on one device or on eight.

The file reads top to bottom in the order a run goes: TrainConfig (every setting), main (the loop), setup (the
stages before the first step), train_step (one optimizer step, then the helpers it calls, in that order),
evaluation and saving, the command line. What it calls is in tasks/, data.py, start.py, runtime.py, optim.py,
log.py, checkpoint.py and model.py: README.md's table of files says what each holds.
"""

import contextlib
import difflib
import functools
import math
import os
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

import converters
import tokens
from checkpoint import out_dir_problem, remove, run_files, save_training, save_weights, whole_model
from compiling import sized_loss_chunk, trial_step
from config import ConfigError, given_values, make_config
from data import TrainBatches, count_targets, find_dataset, micro_seeds, pinned
from elastic import (
    JOB_KEY,
    CheckpointClock,
    auto_resumed,
    has_checkpoint,
    launcher_job,
    record_progress,
    restart_note,
    torchrun_note,
)
from log import Clock, Progress, Scalars, Step, describe_run, fail, format_eta, log, log_memory, one_line
from model import MODEL_KEYS, ModelConfig, ModelSettings, loss_chunk_cap
from optim import Schedule, make_optimizers, make_schedule, schedule_notes
from runtime import (
    DTYPES,
    Models,
    Runtime,
    StopRequest,
    agreed_minimum,
    all_reduce,
    clip_gradients,
    device_peak_flops,
    gradient_sync,
    init_distributed,
    keep_freed_memory,
    make_runtime,
    parallelize,
    raise_if_any_failed,
    split_accumulation,
    step_seconds,
    use_device,
)
from start import keep_base, restore, resumed_settings, start_run
from tasks import TASKS, Task

# a step predicted to take longer than this is said before the run starts (slow_step_note)
SLOW_STEP_SECONDS = 60.0
# TrainConfig's settings with a fixed set of values; the model's own (arch, norm, ...) are ModelConfig's to check
CHOICES = {
    "dtype": DTYPES,
    "lr_schedule": ("cosine", "noam"),
    "backend": ("auto", "nccl", "gloo"),
    "optimizer": ("adamw", "muon"),
}
# TrainConfig's settings that take a range of values, by their names: (whether a value is in it, what the error says).
# At least 1 where 0 would divide by zero (the intervals are taken modulo) or make empty batches; not negative where 0
# means something (no steps, no warmup, no clipping)
AT_LEAST_1 = (lambda v: v >= 1, "must be at least 1")
NOT_NEGATIVE = (lambda v: v >= 0, "must not be negative")
RANGES = {
    "eval_interval log_interval eval_iters gradient_accumulation_steps batch_size dist_timeout plan_ranks": AT_LEAST_1,
    "max_iters max_minutes threads warmup_iters lr_decay_iters eval_accuracy_examples grad_clip min_lr": NOT_NEGATIVE,
    "loss_chunk_mb lora_rank checkpoint_minutes": NOT_NEGATIVE,
    "plan_mfu": (lambda v: 0 <= v <= 1, "must be in [0, 1] (0: the default)"),
    "learning_rate muon_lr": (lambda v: v > 0, "must be positive"),
    "ema_decay": (lambda v: 0 <= v < 1, "must be in [0, 1) (0: off)"),
}


@dataclass
class TrainConfig(ModelSettings):
    """
    Every setting of a run: the model's (ModelSettings in model.py: arch, n_layer, n_embd, block_size, dropout, ...,
    with their defaults and comments there) and the run's, below. --help lists them all.
    """

    # input and output
    out_dir: str = "out"  # checkpoints (ckpt.pt latest, best.pt best val), config.json and TensorBoard logs
    eval_interval: int = 2000  # evaluate every this many iterations, and after the last one
    log_interval: int = 1  # print a progress line every this many iterations
    eval_iters: int = 200  # batches per split at each evaluation, shared out over the ranks
    eval_only: bool = False  # evaluate once (e.g. init_from='resume' or 'gpt2') and exit
    always_save_checkpoint: bool = True  # ckpt.pt at every eval; False: only at the end (best.pt tracks the best)
    checkpoint_minutes: float = 0.0  # > 0: ckpt.pt also every this many minutes: what a failure costs at most
    init_from: str = "scratch"  # 'scratch', 'resume', 'gpt2'..., a HF folder, or a checkpoint file (ours or nanoGPT's)
    overwrite: bool = False  # a new run may replace the run already in out_dir (its checkpoints and TensorBoard logs)
    auto_resume: bool = False  # resume out_dir's run if it has a ckpt.pt, else start as init_from says (elastic.py)
    tensorboard: bool = True  # write TensorBoard scalars into out_dir (tensorboard --logdir OUT_DIR)
    wandb_log: bool = False  # also log to Weights & Biases (pip install wandb)
    wandb_project: str = "nanoformer"  # W&B project
    wandb_run_name: str = "run"  # W&B run name
    # data
    dataset: str = "openwebtext"  # a prepare_data.py dataset (prepared when missing) or a prepared folder's name
    data_dir: str | None = None  # root of the datasets; None: $NANOFORMER_DATA_DIR, else data/ beside prepare_data.py
    data_options: dict = field(default_factory=dict)  # prepare_data.py options, e.g. {'input': 'x.tsv'}; CLI's merge in
    gradient_accumulation_steps: int = 40  # micro-batches per step over all ranks together: a multiple of the ranks
    batch_size: int = 12  # sequences per micro-batch per rank
    # task (tasks/)
    task: str = "auto"  # a task's name (tasks/); 'auto': the architecture's for the data (lm, masked_lm, seq2seq, chat)
    mask_prob: float = 0.15  # encoder: fraction of tokens to predict; 80% shown as [MASK], 10% random, 10% unchanged
    label_smoothing: float = 0.0  # 0.1 in the 2017 paper; evaluation losses are always plain cross-entropy
    eval_accuracy_examples: int = 200  # val pairs (or chat replies with exact answers) greedily decoded: exact match
    # optimizer
    optimizer: str = "adamw"  # 'adamw', or 'muon': Muon for the blocks' matrices, AdamW for the rest
    learning_rate: float = 6e-4  # peak learning rate (of AdamW)
    muon_lr: float = 0.02  # optimizer='muon': Muon's peak learning rate; the schedule scales it as learning_rate
    max_iters: int = 600000  # optimizer steps in total
    max_minutes: float = 0.0  # > 0: also stop after this much training time, the schedule following the time used
    weight_decay: float = 1e-1  # on matrices and embeddings only (both optimizers)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    grad_clip: float = 1.0  # clip the gradient norm to this; 0: no clipping (the norm is logged either way)
    ema_decay: float = 0.0  # evaluate, save and sample a moving average of the weights (e.g. 0.99); 0: off
    # converters (converters/): rewrites of the model before training, LoRA's adapters on frozen weights among them
    converter: str = ""  # a converter's name; "": none, or "lora" where lora_rank > 0 (converters/lora.py)
    converter_options: dict = field(default_factory=dict)  # the settings of a converter that has no fields here
    # LoRA: fine-tune decoder-only weights (init_from) that stay frozen, through small adapters (converters/lora.py)
    lora_rank: int = 0  # > 0: train rank-r adapters beside the weights, which stay frozen; 0: off, train every weight
    lora_alpha: float = 16.0  # the adapters' update is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0  # dropout on the adapters' input (e.g. 0.05 on little data)
    lora_targets: str = "attention,mlp"  # the Linears adapted in every block: attention (qkv, proj), mlp (fc, up, proj)
    # learning-rate schedule
    decay_lr: bool = True  # False: constant learning_rate
    lr_schedule: str = "cosine"  # 'cosine': warmup, cosine to min_lr at lr_decay_iters; 'noam': warmup, 1/sqrt(step)
    warmup_iters: int = 2000  # linear warmup steps
    lr_decay_iters: int = 0  # cosine reaches min_lr here; 0: at the end of the run (max_iters, or max_minutes)
    min_lr: float = 6e-5  # cosine floor, usually learning_rate / 10
    # system
    backend: str = "auto"  # DDP backend: 'auto' (nccl on CUDA, gloo otherwise), 'nccl' or 'gloo'
    fsdp: bool = False  # torchrun: shard weights, gradients and optimizer state over the ranks (FSDP2), not DDP
    device: str = "auto"  # 'auto' (cuda, else mps, else cpu), 'cpu', 'cuda', 'cuda:1', 'mps'
    dtype: str = "auto"  # 'float32', 'bfloat16', 'float16'; 'auto': bf16 (else fp16) on CUDA, float32 elsewhere
    compile: bool | None = None  # torch.compile the model; None: on for CUDA only
    compile_regions: bool = False  # compile each block (once for all) and the loss, not the whole model: a faster start
    cuda_graphs: bool = False  # compile with CUDA graphs ('reduce-overhead'): fixed shapes, 1 micro-batch per rank
    loss_chunk_mb: float = 0.0  # float32 logits the loss computes at once, in MiB; 0: 16 on CPUs, sized on GPUs
    activation_checkpointing: bool = False  # recompute each block's activations in backward: less memory, ~25% slower
    seed: int = 1337  # seeds data sampling, initialisation and dropout (dropout differs per rank)
    threads: int = 0  # CPU threads per process; 0: $OMP_NUM_THREADS, else the cores other jobs leave free
    dist_timeout: int = 900  # seconds a rank waits for the others before the job fails instead of hanging
    # planning (plan.py): predict instead of train
    plan: bool = False  # print each rank's predicted memory and the step time of this run, then exit: nothing trains
    plan_ranks: int = 1  # plan: the ranks (GPUs) the run would use; each gets gradient_accumulation_steps / plan_ranks
    plan_device: str = "auto"  # plan: 'cpu', a GPU (H100, A100, L4, ...: runtime.GPUS), 'auto': this machine's
    plan_mfu: float = 0.0  # plan: the model FLOPs utilisation to time steps at; 0: CPU_MFU on a CPU, else 40%

    def __post_init__(self):
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        for names, (fits, needs) in RANGES.items():
            for name in names.split():
                if not fits(getattr(self, name)):
                    raise ConfigError(f"{name} {needs}, got {getattr(self, name)}")
        check_init_from(self.init_from)
        if self.fsdp and self.optimizer == "muon":
            raise ConfigError(
                "fsdp=True cannot train with optimizer='muon': Muon orthogonalises each whole matrix, which FSDP "
                "splits over the ranks; use optimizer='adamw' with fsdp, or Muon without fsdp (DDP)"
            )
        if self.cuda_graphs and self.compile is False:
            raise ConfigError(
                "cuda_graphs=True replays compiled graphs: it needs compile (not --compile=false); drop --cuda_graphs"
            )
        if self.task not in ("auto", *TASKS):
            raise ConfigError(f"task={self.task!r} is not one of auto, {', '.join(TASKS)}")
        if not 0 < self.mask_prob < 1 or not 0 <= self.label_smoothing < 1:
            raise ConfigError("mask_prob must be in (0, 1) and label_smoothing in [0, 1)")
        if self.lr_schedule == "noam" and self.warmup_iters < 1:
            raise ConfigError("lr_schedule='noam' needs warmup_iters >= 1 (4000 in the paper)")
        converters.check(self)
        try:  # the model settings, checked now rather than after the data is prepared
            self.model_config(vocab_size=1)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def model_config(self, vocab_size, pad_token_id=None):
        """The ModelConfig these settings describe, for a vocabulary of vocab_size ids."""
        settings = {k: getattr(self, k) for k in MODEL_KEYS}
        return ModelConfig(**settings, vocab_size=vocab_size, pad_token_id=pad_token_id)


def check_init_from(init_from):
    """
    ConfigError for an init_from that is a mistyped word (--init_from=resum), naming the word it resembles: it would
    otherwise be taken for the name of Hugging Face weights. A path that exists, or a hub id (org/name), passes.
    """
    words = ("scratch", "resume")
    if init_from in words or "/" in init_from or Path(init_from).expanduser().exists():
        return
    close = difflib.get_close_matches(init_from, words, n=1, cutoff=0.75)
    if close:
        raise ConfigError(
            f"init_from={init_from!r} is no file, folder or setting here; did you mean --init_from={close[0]}?"
        )


# -----------------------------------------------------------------------------
# The run: main's loop, and the record setup builds for it


@dataclass
class Run:
    """What setup() builds for the training loop."""

    cfg: TrainConfig  # with the model settings of the checkpoint or pretrained weights it starts from
    rt: Runtime
    models: Models  # the model under the name of each use: see runtime.Models
    ema_pairs: tuple  # with a weight average: (its parameters, the trained ones), for update_ema; else ()
    optimizers: dict  # {name: optimizer}: {"adamw": AdamW}, with optimizer='muon' also "muon": Muon
    scaler: torch.amp.GradScaler
    task: Task  # what is trained: its batches, loss and evaluation extras (tasks/)
    batches: TrainBatches  # the training stream
    splits: dict  # "train" and "val" data, as the task's batch() reads them
    meta: dict  # the tokenizer's meta, as checkpoints store it
    progress: Progress
    stop: StopRequest  # a SIGINT or SIGTERM received (runtime.py)
    host_group: object  # a gloo group for numbers the host already has; None in one process
    clock: Clock  # the run's training time, which max_minutes budgets
    schedule: Schedule  # the learning rate of each step (optim.py)
    checkpoint_clock: CheckpointClock  # when ckpt.pt is due by the clock (checkpoint_minutes)
    converter: object = None  # what the model was converted into (a converters.Converter), or None
    start_iter: int = 0
    best_val_loss: float = math.inf  # the val loss of best.pt's evaluation
    best_accuracy: float | None = None  # its exact match, where the data has exact answers (which then choose best.pt)
    resumed: bool = False


def main(cfg):
    """
    Train (or, with eval_only, evaluate) as cfg says, in one process or under torchrun. Returns a summary:
    {"losses": {iteration: train loss}, "evals": [{"iter", "train", "val"[, "val_bpb"][, "accuracy"]}], "iter_num",
    "best_val_loss"}. Raises ConfigError for bad settings or data, FloatingPointError for a non-finite loss and
    OSError for a failed save.
    """
    cfg = auto_resumed(cfg)  # with auto_resume: a resume where out_dir holds a checkpoint
    rt = make_runtime(cfg)
    with contextlib.ExitStack() as stack:
        run = setup(cfg, rt, stack)
        cfg, progress, evals = run.cfg, run.progress, []
        iter_num, stopping = run.start_iter, False
        # a restarted job (auto_resume) may find its time budget spent: the time saved is the same on every rank
        out_of_time = cfg.max_minutes > 0 and run.clock.before >= 60 * cfg.max_minutes
        # each pass: evaluate if due, stop if this is the last iteration, else take one step
        while True:
            last = iter_num >= cfg.max_iters or stopping or out_of_time
            if should_evaluate(run, iter_num, last, stopping):
                with progress.paused():  # progress lines time the training steps only
                    progress.read()  # a non-finite loss stops the run before any save
                    evals.append(evaluate_and_save(run, iter_num, last))
                if cfg.eval_only:
                    break
            if last:
                # the final ckpt.pt, for --init_from=resume to go on from; a run that took no step has nothing new
                if iter_num > run.start_iter:
                    progress.finish()
                    save_training_state(run, iter_num)
                    log_memory(run.models.raw, run.optimizers, rt)
                    how = f"stopped by {run.stop.signal or 'a signal to another rank'}" if stopping else "done"
                    # with auto_resume the command that started the run goes on with it (a requeued job's)
                    again = "the same command" if cfg.auto_resume else resume_command(cfg.out_dir, rt)
                    log(
                        f"{how} at iteration {iter_num}: saved {Path(cfg.out_dir) / 'ckpt.pt'}"
                        + (f"; resume with {again}" if stopping else "")
                    )
                break
            step = train_step(run, iter_num)
            if step is None:  # a signal reached some rank: every rank stops here, before this step
                stopping = True
                continue
            # iterations are numbered by the steps done: the step just taken ends iteration iter_num + 1
            iter_num += 1
            progress.add(iter_num, step)
            if rt.rank == 0:
                record_progress(cfg.out_dir, iter_num, step.seconds)  # for a restart to say what a failure cost
            # the ranks agreed on the time the step began: they all stop, or save by the clock, after the same step
            out_of_time = cfg.max_minutes > 0 and step.seconds >= 60 * cfg.max_minutes
            if run.checkpoint_clock.due(step.seconds) and not saves_anyway(cfg, iter_num, out_of_time):
                save_by_the_clock(run, iter_num)
        if rt.world_size > 1:
            # gloo's worker threads release each collective's Python tensors after it returns, which needs the GIL;
            # a process group torn down (by DDP's reducer as main returns, with the GIL held) before they have waits
            # for them forever. So every rank's collectives end (the barrier), then this thread lets go of the GIL
            # while the workers release them, the barrier's own included (seen: a hang in about 1 DDP run of 30)
            dist.barrier()
            time.sleep(0.1)
        return {"losses": progress.losses, "evals": evals, "iter_num": iter_num, "best_val_loss": run.best_val_loss}


def slow_step_note(cfg, rt, task, model, per_rank):
    """
    A note for a run whose steps take minutes at the rates plans use (runtime.step_seconds), said before the first
    one starts: it names the settings that make a step long, since nothing else is printed until it ends.
    """
    inputs, _ = task.example_batch(cfg.batch_size, cfg.block_size)
    flops = model.training_flops(*inputs) * per_rank
    seconds = step_seconds(flops, rt)
    if seconds is None or seconds < SLOW_STEP_SECONDS:
        return None
    return (
        f"note: a step is {flops:.2g} FLOPs, about {format_eta(seconds)} on this {rt.device.type} at the "
        f"rate --plan uses, and nothing is printed before it ends: block_size={cfg.block_size:,}, batch_size="
        f"{cfg.batch_size} and gradient_accumulation_steps={cfg.gradient_accumulation_steps} make it that long "
        "(lower them for shorter steps); a second Ctrl-C stops a step at once"
    )


def resume_command(out_dir, rt):
    """The shortest command that goes on with the run in out_dir: its checkpoint holds every setting."""
    launcher = "python"
    if rt.world_size > 1:
        one_node = int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size)) == rt.world_size
        launcher = f"torchrun --standalone --nproc_per_node={rt.world_size}" if one_node else "torchrun (as launched)"
    return f"{launcher} train.py --init_from=resume --out_dir={shlex.quote(str(out_dir))}"


# -----------------------------------------------------------------------------
# Setup: everything before the first step, in stages


def setup(cfg, rt, stack):
    """
    Everything before the first step, in stages: the processes, the data, where the model starts (start.py), the
    model spread over the ranks (runtime.py) with its optimizers and a resume's state, the outputs. Returns a Run.
    """
    per_rank, host_group, is_writer, threads_note = join_processes(cfg, rt, stack)

    folder = find_dataset(cfg, rt)
    data_meta = tokens.load_meta(folder)
    begin = start_run(cfg, data_meta, lazy=rt.fsdp)
    cfg, task = begin.cfg, begin.task  # a checkpoint or pretrained weights decide the model settings
    if cfg.cuda_graphs and task.varying:
        raise ConfigError(f"cuda_graphs=True needs batches of one length, which {folder.name}'s vary; drop it")
    splits = {split: task.load_split(folder, split, cfg.block_size) for split in ("train", "val")}
    begin.model.loss_chunk_bytes = loss_chunk_bytes(cfg, rt, host_group)

    models = parallelize(begin.model, cfg, rt, task)
    if rt.device.type == "cpu":
        keep_freed_memory()  # for the training steps' buffers, now that the data is prepared and the model built
    optimizers, summary = make_optimizers(models.raw, cfg, rt)
    # float16 only: its small gradients would underflow to 0 without a loss scale; bfloat16 has float32's range
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    generator = torch.Generator().manual_seed(cfg.seed)  # the training data stream: the same on every rank
    if begin.ckpt is not None:
        restore(begin.ckpt, models, optimizers=optimizers, scaler=scaler, generator=generator, cfg=cfg, rt=rt)
    if rt.device.type == "cuda" and not cfg.loss_chunk_mb and not cfg.eval_only:  # evaluation alone needs no trial
        trial = functools.partial(trial_step, models.step, task, cfg.batch_size, cfg.block_size, rt, models.ddp)
        chunk = sized_loss_chunk(models.raw, trial, optimizers, models.compiled)
        chunk = agreed_minimum(chunk, rt.world_size, host_group)  # every rank cuts the loss alike: the smallest
        for model in (models.raw, models.average):  # the average evaluates with the same chunk
            if model is not None:
                model.loss_chunk_bytes = chunk

    batches = TrainBatches(splits["train"], task, cfg, generator, rt, per_rank)
    stack.callback(batches.close)
    describe_run(cfg, rt, folder.name, models.raw, per_rank, summary, schedule_notes(cfg))
    trained = 0.0 if begin.ckpt is None else begin.ckpt.get("train_seconds", 0.0)  # the run's time so far
    # a resume after a failure says so, and what it cost
    restarted = None if begin.ckpt is None or cfg.eval_only else restart_note(cfg.out_dir, begin.ckpt)
    slow = None if cfg.eval_only else slow_step_note(cfg, rt, task, models.raw, per_rank)
    described = task.describe(splits["train"], cfg.batch_size)
    long_block = task.length_note(splits["train"], cfg.block_size)
    for note in (restarted, torchrun_note(), threads_note, described, long_block, slow):
        if note:
            log(note)
    return Run(
        cfg=cfg,
        rt=rt,
        models=models,
        # the average's parameters and the weights', listed once rather than at every step
        ema_pairs=() if models.average is None else (list(models.average.parameters()), list(models.raw.parameters())),
        optimizers=optimizers,
        scaler=scaler,
        task=task,
        batches=batches,
        splits=splits,
        meta=begin.meta,
        progress=open_outputs(cfg, rt, is_writer, models.raw.config, begin.meta, begin.converter, stack),
        stop=stack.enter_context(StopRequest()),
        host_group=host_group,
        # started last, so that the time budget counts the loop's time: a resume goes on from the time saved
        clock=Clock(trained),
        schedule=make_schedule(cfg, begin.ckpt),
        checkpoint_clock=CheckpointClock(cfg.checkpoint_minutes, trained),
        converter=begin.converter,
        start_iter=0 if begin.ckpt is None else begin.ckpt["iter_num"],
        best_val_loss=math.inf if begin.ckpt is None else begin.ckpt["best_val_loss"],
        best_accuracy=None if begin.ckpt is None else begin.ckpt.get("best_accuracy"),
        resumed=begin.ckpt is not None,
    )


def join_processes(cfg, rt, stack):
    """
    The first stage: join the torchrun job, seed, set up the device and check out_dir, before any data or model.
    Returns (micro-batches per rank, the host-side gloo group or None, whether this rank writes, use_device's note).
    """
    # checked before any process group or data: a bad setting fails at once
    per_rank = split_accumulation(cfg.gradient_accumulation_steps, rt.world_size)
    # the note on the CPU threads is said with the run's description, after every check that could refuse the run
    note = use_device(cfg, rt)
    host_group = init_distributed(cfg, rt, stack)
    torch.manual_seed(cfg.seed + rt.rank)  # dropout differs per rank; DDP copies rank 0's initial weights
    # an unwritable out_dir is found now, not at the first save hours later; rank 0 alone writes, eval_only never
    is_writer = rt.rank == 0 and not cfg.eval_only
    raise_if_any_failed(out_dir_problem(cfg) if is_writer else None, rt.world_size)
    return per_rank, host_group, is_writer, note


def loss_chunk_bytes(cfg, rt, group):
    """
    The bytes of float32 logits the loss computes at a time (TransformerModel.loss_chunk_bytes) as the model is
    compiled: loss_chunk_mb if given, for good; on a GPU the largest chunk (model.loss_chunk_cap, the smallest over
    the ranks), until compiling.sized_loss_chunk sizes it; None elsewhere (the model's CPU budget).
    """
    if cfg.loss_chunk_mb:
        return int(cfg.loss_chunk_mb * 2**20)
    if rt.device.type == "cuda":
        return agreed_minimum(loss_chunk_cap(torch.cuda.mem_get_info(rt.device)[1]), rt.world_size, group)
    return None


def open_outputs(cfg, rt, is_writer, model_config, meta, converter, stack):
    """
    The last stage: config.json beside the checkpoints (and a partial converter's base: start.keep_base) and
    TensorBoard (on the writing rank), and the Progress that reports to them, closed with the run.
    """
    if is_writer and cfg.init_from != "resume":
        # out_dir_problem let a new run in only where there was no run, or with overwrite=True: its files go, so that
        # neither a best.pt nor the TensorBoard curves of the run it replaces outlive it
        for path in run_files(cfg.out_dir):
            remove(path)
    scalars = Scalars(cfg, is_writer)
    stack.callback(scalars.close)
    if is_writer:
        out_dir = Path(cfg.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        # the run's settings in readable JSON beside the checkpoints, for people and tools without torch
        run_config = {"train_config": asdict(cfg), "model_config": asdict(model_config), "meta": meta}
        # the launcher's job too: auto_resume starts a run again where the same job stopped before any checkpoint
        tokens.write_json({**run_config, "world_size": rt.world_size, JOB_KEY: launcher_job()}, out_dir / "config.json")
        if cfg.init_from != "resume":
            keep_base(converter, out_dir)
    # this GPU's peak bf16 FLOP/s, for MFU; None where unknown
    return Progress(cfg, rt, scalars, device_peak_flops(rt.device))


# -----------------------------------------------------------------------------
# One training step, then the helpers it calls, in the order it calls them


def train_step(run, iter_num):
    """
    Optimizer step number iter_num + 1 on this rank's share of the step's micro-batches, then the weight average.
    Returns a Step of device tensors and host numbers, without waiting for the device; None when a stop signal
    reached any rank (then no rank takes the step). A step whose gradient is not finite (a bf16 overflow in
    backward, say) is skipped: the weights and every optimizer's state stay as they were.
    """
    cfg, rt, models = run.cfg, run.rt, run.models

    # The micro-batches, built while the last step ran, and their real targets and tokens on all ranks: the loss is
    # a mean over every target of the step, so their number is needed before the first backward. Stop votes ride
    # along: every rank must decide alike, or some would wait forever in the next collective.
    # The training time (max_minutes) rides along too, as the ranks' mean in milliseconds: one number for all.
    micro_batches, n_targets, n_tokens = run.batches.peek()
    counts = torch.tensor([n_targets, n_tokens, run.stop.signal is not None, round(1000 * run.clock.seconds())])
    if rt.world_size > 1:
        dist.all_reduce(counts, group=run.host_group)  # host numbers, over gloo: no wait for the GPU
    n_targets, n_tokens, stop_votes, milliseconds = counts.tolist()
    if stop_votes:
        return None
    run.batches.advance()  # the next step's batches are built while this one runs
    seconds = milliseconds / 1000 / rt.world_size

    # The learning rate: the schedule's multiplier scales each optimizer's peak alike, on each of its groups. With
    # a time budget, the schedule follows whichever of the steps and the time is further along.
    lr = run.schedule.lr(iter_num, seconds) if cfg.decay_lr else cfg.learning_rate
    for optimizer in run.optimizers.values():
        for group in optimizer.param_groups:
            group["lr"] = lr * (group["initial_lr"] / cfg.learning_rate)  # each group's peak (Muon's is muon_lr)

    # Forward and backward: the gradient of the mean loss over the step's targets (at least 1: a step whose
    # batches hold no real target must not divide by zero)
    n_targets = max(n_targets, 1)
    loss = accumulate_gradients(models, run.task, micro_batches, n_targets, run.scaler, rt)

    # The update: clipped, and skipped where the gradient is not finite; then the average follows the weights
    grad_norm, skipped = update_weights(models.raw, run.optimizers, run.scaler, cfg.grad_clip)
    if models.average is not None:
        update_ema(*run.ema_pairs, cfg.ema_decay, iter_num + 1)

    # FLOPs for MFU, counted only where a GPU's peak is known
    flops = sum(models.raw.training_flops(*inputs) for inputs, _ in micro_batches) if run.progress.peak_flops else 0.0
    # this rank's share of the step's mean loss: summed over the ranks, it is the mean
    return Step(loss / n_targets, grad_norm, skipped, lr, n_tokens, flops, seconds)


def accumulate_gradients(models, task, batches, n_targets, scaler, rt):
    """
    Forward and backward over this rank's micro-batches with models.step (micro_step, one at a time); returns their
    summed loss. The ranks exchange gradients after the last micro-batch only.
    """
    total = torch.zeros((), device=rt.device)
    for i, batch in enumerate(batches):
        # a device tensor: adding to it never waits for the GPU
        total += micro_step(models, task, batch, i == len(batches) - 1, n_targets, scaler, rt)
    return total


def micro_step(models, task, batch, last, n_targets, scaler, rt):
    """
    Forward and backward of one micro-batch ((inputs, targets) on the CPU); last: the step's last, after which the
    ranks exchange gradients. Returns its summed loss, detached. The summed loss is divided by n_targets, the real
    targets of the whole step on all ranks, and multiplied by world_size to undo the ranks' average: the gradient is
    that of the mean over every target of the step, not a mean of per-micro-batch means.
    """
    with gradient_sync(models, enabled=last):
        inputs, targets = task.to_device(*batch, rt.device)
        with rt.autocast():
            # the model sums the loss itself, in chunks of positions: the (B, T, V) logits never exist whole
            loss = task.loss(models.step, inputs, targets)
        # / n_targets: this micro-batch's part of the step's mean loss; * world_size: undoes the ranks' average
        backward(scaler.scale(loss * (rt.world_size / n_targets)), models)
    return loss.detach()


def backward(loss, models):
    """
    loss.backward(). A compiled graph's backward is compiled at its first use, in here: a failure to compile it
    (after a recompilation) leaves the step half done, and ends the run with one line. Any other error (a device-side
    assert, a DDP reducer's, CUDA graphs' overwritten outputs, running out of memory) keeps its own message and cause.
    """
    try:
        loss.backward()
    # what a failed compilation raises: Inductor's InductorError, any backend's BackendCompilerFailed
    except torch._dynamo.exc.TorchDynamoException as e:
        if not models.compiled:
            raise
        raise ConfigError(f"the compiled backward failed ({one_line(e)}); run with --compile=false") from e


def update_weights(model, optimizers, scaler, grad_clip):
    """
    Clip the gradients of model (the plain model; grad_clip 0: no clipping) and step every optimizer ({name:
    optimizer}), unless the gradient is not finite; then clear the gradients. Returns device tensors, without
    waiting for the device: (the gradient norm before clipping, 1.0 if the step was skipped else 0.0).
    """
    # float16 gradients were scaled up: unscaled (a no-op otherwise) before clipping, so grad_clip is in true units
    for optimizer in optimizers.values():
        scaler.unscale_(optimizer)
    # with no clipping (math.inf) the norm is still computed, for the log and the finiteness check
    grad_norm = clip_gradients(list(model.parameters()), grad_clip if grad_clip > 0 else math.inf)
    skipped = (~torch.isfinite(grad_norm)).float()  # of the gradients averaged over the ranks: the same everywhere
    for optimizer in optimizers.values():
        if scaler.is_enabled():
            scaler.step(optimizer)  # float16: the gradient scaler skips such steps itself
        elif getattr(optimizer, "_step_supports_amp_scaling", False):
            # fused AdamW takes the flag a gradient scaler would pass and skips the update on the device: no host sync
            optimizer.found_inf = skipped
            optimizer.step()
            del optimizer.found_inf
        # any other optimizer (unfused AdamW): the host must read the flag to decide, one wait per step
        elif not skipped.item():
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    scaler.update()  # after every optimizer's step; a no-op without float16
    return grad_norm, skipped


def update_ema(averages, weights, decay, step):
    """
    After optimizer step number `step`: average = d * average + (1 - d) * weight for each pair of tensors of the
    lists, with d = min(decay, (1 + step) / (10 + step)), so the average soon forgets the first weights and then
    spans about 1 / (1 - decay) steps. Evaluated mid-run, the average is about as good as the weights would be
    after a learning-rate decay, without the decay.
    """
    d = min(decay, (1 + step) / (10 + step))
    with torch.no_grad():  # one fused lerp over all tensors (what torch.optim.swa_utils uses), faster than a loop
        torch._foreach_lerp_(averages, weights, 1 - d)


# -----------------------------------------------------------------------------
# Evaluation and saving


def should_evaluate(run, iter_num, last, stopping):
    """At every eval_interval and after the last step; not when a signal stops the run, nor right after a resume."""
    if run.cfg.eval_only:
        return True
    just_resumed = run.resumed and iter_num == run.start_iter  # nothing new to evaluate or save
    return not stopping and not just_resumed and (iter_num % run.cfg.eval_interval == 0 or last)


def evaluate_and_save(run, iter_num, last):
    """
    Evaluate the kept model, log it and save: best.pt when the val loss improves, ckpt.pt at each evaluation
    (unless always_save_checkpoint is off; the end of the run saves it anyway). Returns the evaluation's record.
    """
    cfg, rt = run.cfg, run.rt
    result = evaluate(run.models.eval, run.splits, run.task, cfg, rt)
    if not all(map(math.isfinite, result.values())):
        raise FloatingPointError(
            f"the evaluation at iteration {iter_num} gave {result}; nothing saved, "
            "the last checkpoint is untouched. Lower learning_rate"
        )
    if cfg.eval_accuracy_examples and run.task.exact_answers:
        result["accuracy"] = val_accuracy(run)
    # evaluation switched the model to eval mode; training needs its dropout back
    run.models.raw.train()
    run.progress.scalars.add(iter_num, {f"eval/{k}": v for k, v in result.items()})
    saved = []
    # the weights a new run starts from (a checkpoint or pretrained weights, not random ones) may be the best it
    # has: a fine-tune can make them worse. After a resume, its first evaluation just measures
    trained = iter_num > run.start_iter
    starting = iter_num == 0 and cfg.init_from != "scratch" and not run.resumed and not cfg.eval_only
    if (trained or starting) and improves(result, run.best_val_loss, run.best_accuracy):
        metric = "exact match" if by_exact_match(result, run.best_val_loss, run.best_accuracy) else "val loss"
        run.best_val_loss, run.best_accuracy = result["val"], result.get("accuracy")
        save_weights(
            Path(cfg.out_dir) / "best.pt",
            run.models.kept,
            rt,
            role="weights" if run.models.average is None else "average",
            converter=run.converter,
            cfg=cfg,
            meta=run.meta,
            iter_num=iter_num,
            best_val_loss=run.best_val_loss,
            best_accuracy=run.best_accuracy,
        )
        saved.append(f"best.pt, by {metric}")
    # after the last step main saves ckpt.pt anyway, with the final state
    if iter_num > run.start_iter and cfg.always_save_checkpoint and not last:
        save_training_state(run, iter_num)
        saved.append("ckpt.pt")
    extra = f" ({result['val_bpb']:.4f} bits/byte)" if "val_bpb" in result else ""
    extra += f", exact match {result['accuracy']:.1%}" if "accuracy" in result else ""
    log(
        f"eval {iter_num}: train loss {result['train']:.4f}, val loss {result['val']:.4f}{extra}"
        + (f" (saved {', '.join(saved)})" if saved else "")
    )
    return {"iter": iter_num, **result}


def improves(result, best_val_loss, best_accuracy):
    """
    Whether an evaluation's result beats best.pt's: by exact match where the data has exact answers (the model a
    chat demo or a translation is shown at its best; the val loss breaks ties), else by the val loss.
    """
    if not by_exact_match(result, best_val_loss, best_accuracy):
        return result["val"] < best_val_loss
    best = -1.0 if best_accuracy is None else best_accuracy  # no best.pt yet: any exact match is better
    return result["accuracy"] > best or result["accuracy"] == best and result["val"] < best_val_loss


def by_exact_match(result, best_val_loss, best_accuracy):
    """
    Whether exact match compares an evaluation with best.pt: where the evaluation has one and best.pt's is known, or
    there is no best.pt yet. A best.pt saved without it (by a run with eval_accuracy_examples=0, then resumed with
    it) has only its val loss to beat: counting its exact match as none would let the resume's first evaluation
    replace it whatever its quality. Once an evaluation wins on val loss, its exact match is known from then on.
    """
    return "accuracy" in result and (best_accuracy is not None or best_val_loss == math.inf)


def eval_batch(data, task, cfg, pin, seed):
    """
    (inputs, targets, real targets, UTF-8 bytes they stand for) of the evaluation batch of this seed; pinned for the
    GPU if pin. Counted here, on the CPU, so that no batch waits for the GPU.
    """
    inputs, targets = task.batch(data, cfg.batch_size, cfg.block_size, torch.Generator().manual_seed(seed))
    n_bytes, n_targets = task.text_bytes(targets), count_targets(targets)
    return (*pinned(inputs, targets), n_targets, n_bytes) if pin else (inputs, targets, n_targets, n_bytes)


@torch.no_grad()
def evaluate(model, splits, task, cfg, rt):
    """
    Mean cross-entropy per real target over eval_iters batches of each split, the batches shared out over the ranks
    and the sums added over all of them. Fixed seeds: every evaluation sees the same batches. A task whose targets
    spell text (Task.bits_per_byte): also "val_bpb", the val loss in bits per byte of the text its targets cover,
    which compares across tokenizers.
    """
    model.eval()
    losses = {}
    for i, (split, data) in enumerate(splits.items()):
        # fixed seeds apart from training's stream: the same batches at every evaluation; rank r takes every
        # world_size-th of them
        seeds = micro_seeds(torch.Generator().manual_seed(cfg.seed + 1 + i), cfg.eval_iters)
        mine = seeds[rt.rank :: rt.world_size]
        # under FSDP every forward pass is a collective (it gathers the weights): all ranks run as many, a rank
        # with one batch fewer (eval_iters not a multiple of the ranks) runs one more that is not counted
        rounds = -(-len(seeds) // rt.world_size) if rt.fsdp else len(mine)
        counted = [r < len(mine) for r in range(rounds)]
        build = functools.partial(eval_batch, data, task, cfg, rt.device.type == "cuda")
        total, count, n_bytes = torch.zeros((), device=rt.device), 0, 0
        # the batches are built (and pinned, on CUDA) on a background thread while the device computes
        with ThreadPoolExecutor(max_workers=1) as pool:
            batches = pool.map(build, [mine[r] if counted[r] else seeds[0] for r in range(rounds)])
            for (inputs, targets, batch_targets, batch_bytes), counts in zip(batches, counted):
                count, n_bytes = count + batch_targets * counts, n_bytes + batch_bytes * counts
                inputs, targets = task.to_device(inputs, targets, rt.device)
                with rt.autocast():
                    loss = task.loss(model, inputs, targets, smoothed=False)
                total += loss.float() * counts
        # sums over the ranks, then one division: the mean over every target, however they were shared out
        total, count, n_bytes = all_reduce([total, count, n_bytes], rt).tolist()
        losses[split] = total / max(count, 1)
        if task.bits_per_byte and split == "val":
            # nats summed over the targets, in bits, per byte of the text they spell
            losses["val_bpb"] = total / (math.log(2) * max(n_bytes, 1))
    if rt.fsdp:
        # FSDP keeps the root's weights gathered after a forward pass, for the backward that follows in training
        next(m for m in model.modules() if isinstance(m, FSDPModule)).reshard()
    return losses


def val_accuracy(run):
    """
    Exact match of greedy decoding on the first eval_accuracy_examples val examples the task decodes, with the kept
    model. Under FSDP rank 0 decodes them all with the weights gathered: decoding stops at different steps on
    different ranks, and a sharded model's every forward pass is a collective.
    """
    cfg, rt, split = run.cfg, run.rt, run.splits["val"]
    rows = run.task.answer_rows(split)[: cfg.eval_accuracy_examples]
    if not rt.fsdp:
        return exact_match(run.models.kept, run.task, split, rows, cfg, rt)
    model, correct = whole_model(run.models.kept, rt, run.converter), 0.0
    if model is not None:
        # a Runtime of one process: exact_match then decodes every pair, in autocast where FSDP would cast
        correct = exact_match(model, run.task, split, rows, cfg, Runtime(device=rt.device, dtype=rt.dtype))
    return all_reduce([correct], rt).item()


@torch.no_grad()
def exact_match(model, task, split, rows, cfg, rt):
    """Fraction of the examples `rows` of a split whose greedy decoding (task.decoded) equals the reference exactly,
    over all ranks."""
    model.eval()
    mine = rows[rt.rank :: rt.world_size]  # rank r decodes every world_size-th example
    with rt.autocast():
        decoded = task.decoded(model, split, mine, cfg.batch_size, cfg.block_size)
        correct = sum(output == reference for output, reference in decoded)
    correct, total = all_reduce([correct, len(mine)], rt).tolist()
    return correct / max(total, 1)


def saves_anyway(cfg, iter_num, out_of_time):
    """Whether ckpt.pt is saved after step iter_num without the clock: the last step's save, or an evaluation's."""
    last = iter_num >= cfg.max_iters or out_of_time
    return last or cfg.always_save_checkpoint and iter_num % cfg.eval_interval == 0


def save_by_the_clock(run, iter_num):
    """ckpt.pt after step iter_num, as checkpoint_minutes asks, on every rank: the rest of the run goes on from it."""
    with run.progress.paused():  # progress lines time the training steps only
        run.progress.read()  # a non-finite loss stops the run before any save
        save_training_state(run, iter_num)
    path = Path(run.cfg.out_dir) / "ckpt.pt"
    log(f"saved {path} at iteration {iter_num}, by the clock (every {run.cfg.checkpoint_minutes:g} minutes)")


def save_training_state(run, iter_num):
    """ckpt.pt: everything a resume needs (checkpoint.save_training). Every rank takes part."""
    save_training(
        Path(run.cfg.out_dir) / "ckpt.pt",
        run.models.raw,
        run.rt,
        ema_model=run.models.average,
        cfg=run.cfg,
        meta=run.meta,
        iter_num=iter_num,
        best_val_loss=run.best_val_loss,
        best_accuracy=run.best_accuracy,
        train_seconds=run.clock.seconds(),
        schedule_from=run.schedule.resumed_at,
        optimizers=run.optimizers,
        scaler=run.scaler,
        sampler_state=run.batches.resume_state,
        converter=run.converter,
    )


# -----------------------------------------------------------------------------
# Command line


def cli(argv):
    """
    The command line; returns the exit status. Errors print one line: 2 bad settings or data; 1 a run that cannot
    go on (non-finite loss, out of memory, a checkpoint that cannot be written).
    """
    try:
        given = given_values(TrainConfig, argv)
        if given.get("auto_resume") and has_checkpoint(given.get("out_dir", TrainConfig.out_dir)):
            given["init_from"] = "resume"  # elastic.auto_resumed's choice, made before the run's settings are read
        if given.get("init_from") == "resume":  # the run in out_dir says every setting not given: checked merged
            given = resumed_settings(TrainConfig, given, given.get("out_dir", TrainConfig.out_dir))
        cfg = make_config(TrainConfig, given)
        # Without a config or --dataset the defaults train GPT-2 124M on OpenWebText (configs/gpt2.py's model, as
        # nanoGPT's defaults do): when its data is prepared, never by starting a download of hours
        default_run = cfg.init_from != "resume" and not any(a.endswith(".py") for a in argv) and "dataset" not in given
        if default_run and not cfg.plan and not tokens.is_prepared(tokens.dataset_dir(cfg.dataset, cfg.data_dir)):
            raise ConfigError(
                f"no config given, and the default run's data ({cfg.dataset}, GPT-2 124M's) is not prepared in "
                f"{tokens.data_root(cfg.data_dir)}: prepare it with python prepare_data.py {cfg.dataset} (a download "
                "of hours), or name a config, e.g. python train.py configs/shakespeare.py (two minutes on a laptop)"
            )
        if cfg.plan:
            # imported here only: the planner's tracing tools (torch.distributed._tools, ...) take seconds to
            # import, which a run's launch would otherwise wait for. It traces this file's own step functions
            from plan import TrainStep, make_plan, print_plan

            print_plan(make_plan(cfg, TrainStep(make_optimizers, micro_step, update_weights)))
        else:
            main(cfg)
    except ConfigError as e:
        return fail(str(e), 2)
    except (FloatingPointError, OSError) as e:
        return fail(one_line(e), 1)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
        # a CPU's allocation failure is a RuntimeError of its allocator's (or numpy's MemoryError): other
        # RuntimeErrors are bugs, with their traceback
        where = "GPU" if isinstance(e, torch.OutOfMemoryError) else "CPU"
        if where == "CPU" and not isinstance(e, MemoryError) and "can't allocate memory" not in str(e):
            raise
        return fail(
            f"out of {where} memory with batch_size={cfg.batch_size}, block_size={cfg.block_size}: lower batch_size "
            "(raising gradient_accumulation_steps keeps the step's size), block_size or the model's size; "
            "--plan predicts a run's peak and the largest micro-batch that fits, before it starts",
            1,
        )
    except KeyboardInterrupt:  # before training started; during training a signal stops the run cleanly
        print("train.py: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
