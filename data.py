"""
The data a run reads: its dataset (prepared first if missing, by one rank while the others wait) and the stream of
training micro-batches (TrainBatches), moved to the device. What a batch is belongs to the task (tasks/).
"""

import difflib
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

import recipes
import tokens
from config import ConfigError
from log import log
from model import IGNORE_INDEX
from runtime import raise_if_any_failed

# how long the other ranks of a torchrun job wait while one prepares the dataset
PREPARE_TIMEOUT = timedelta(days=2)


# -----------------------------------------------------------------------------
# The dataset of a run, and its stream of training batches


def prepared_dataset(name, data_dir, options):
    """The folder of dataset `name`, prepared first if missing or out of date; ConfigError says why it cannot be."""
    try:
        folder = tokens.dataset_dir(name, data_dir)
        # prepare() keeps outputs that are up to date for these options: with none, an intact folder is enough
        if not options and tokens.is_prepared(folder):
            return folder
        if name not in recipes.RECIPES:  # a folder of the user's own: say what is wrong with it, if anything
            if options:
                raise ValueError(f"data_options need one of the datasets {', '.join(recipes.RECIPES)}")
            if not folder.is_dir():
                # a typo (shakespear_char) is answered with the dataset or prepared folder it most resembles
                there = [p.name for p in folder.parent.iterdir() if p.is_dir()] if folder.parent.is_dir() else []
                close = difflib.get_close_matches(name, [*recipes.RECIPES, *there], n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ValueError(f"not one of {', '.join(recipes.RECIPES)}, nor a folder in {folder.parent}{hint}")
            tokens.check_prepared(folder)
        else:
            log(f"dataset {name}: preparing it in {folder.parent} unless up to date")
            folder = recipes.prepare(name, data_dir, **options)
    # bad options, a missing input, a failed download, a full disk: all reported as one line
    except (ValueError, OSError) as e:
        raise ConfigError(f"dataset {name}: {e}") from None
    return folder


def find_dataset(cfg, rt):
    """The dataset's folder, prepared first if missing: by rank 0, then by each node's first rank, then by the rest."""
    # the others wait over a gloo group of its own, whose timeout outlasts a preparation of hours (OpenWebText):
    # waiting in the default group would end at dist_timeout, and on GPUs in NCCL's watchdog
    group = dist.new_group(backend="gloo", timeout=PREPARE_TIMEOUT) if rt.world_size > 1 else None
    folder = None
    # three turns, so that one process downloads and tokenizes while the others wait: rank 0 first, then the first
    # rank of every other machine (its data_dir may be a local disk), then everyone else, who find it done
    for my_turn in (rt.rank == 0, rt.rank != 0 and rt.local_rank == 0, rt.local_rank != 0):
        error = None
        if my_turn:
            try:
                folder = prepared_dataset(cfg.dataset, cfg.data_dir, cfg.data_options)
            except ConfigError as e:
                error = str(e)
        raise_if_any_failed(error, rt.world_size, group)  # also makes the others wait until the files exist
    if group is not None:
        dist.destroy_process_group(group)
    return folder


def micro_seeds(generator, n):
    """Seeds for the next n micro-batches: a micro-batch depends only on its seed, whichever rank draws it."""
    return torch.randint(2**62, (n,), generator=generator).tolist()


def count_targets(targets):
    """How many positions of targets hold a real target: what a step's mean loss divides by."""
    return int((targets != IGNORE_INDEX).sum())


def gpt_window(inputs, targets):
    """
    The (B, T + 1) window a GPT batch's inputs (B, T) and targets (B, T) are two views of, as CausalLM.batch and
    pinned make them (inputs its first T columns, targets its last T); None for any other batch.
    """
    window = inputs[0]._base if len(inputs) == 1 else None  # _base: the tensor a view looks into
    if window is None or targets._base is not window or not window.is_contiguous():
        return None
    one_column_on = window.data_ptr() + window.element_size()
    fits = window.shape == (targets.size(0), targets.size(1) + 1) and inputs[0].data_ptr() == window.data_ptr()
    return window if fits and targets.data_ptr() == one_column_on else None


def pinned(inputs, targets):
    """
    A batch in page-locked host memory, whose copy to the GPU can then run while the GPU works. A GPT's window is
    pinned whole, dense, and sliced again: its views would be copied through a pageable temporary, and it is half the
    bytes of inputs and targets apart.
    """
    window = gpt_window(inputs, targets)
    if window is not None:
        window = window.pin_memory()
        return (window[:, :-1],), window[:, 1:]
    return tuple(x.pin_memory() for x in inputs), targets.pin_memory()


def model_inputs(inputs, targets, device, varying=False):
    """
    A batch on device: (inputs tuple, targets), a GPT's window copied once and sliced on the device. varying
    (Task.varying: pairs, conversations): dimension 1, the length, varies from batch to batch and is marked dynamic,
    so that torch.compile builds one graph for all of them instead of recompiling for each new length.
    """
    window = None if varying else gpt_window(inputs, targets)
    if window is not None:
        window = window.to(device, non_blocking=window.is_pinned())
        return (window[:, :-1],), window[:, 1:]
    moved = [x.to(device, non_blocking=x.is_pinned()) for x in (*inputs, targets)]
    if varying:
        for x in moved:
            torch._dynamo.maybe_mark_dynamic(x, 1)
    return tuple(moved[:-1]), moved[-1]


class TrainBatches:
    """
    The training micro-batches of this rank, one step ahead: while the device runs a step, a background thread
    builds the next step's batches (pinned in memory on CUDA) and counts their targets and tokens, so a small
    model's step does not wait for Python. Each micro-batch depends only on its seed, drawn in order from
    `generator` for the micro-batches of all ranks: the stream is the same on any number of ranks.
    """

    def __init__(self, data, task, cfg, generator, rt, per_rank):
        self.data, self.task, self.cfg, self.pin = data, task, cfg, rt.device.type == "cuda"
        self.generator, self.rank, self.per_rank, self.world_size = generator, rt.rank, per_rank, rt.world_size
        # one worker: the next step's batches are built in order while this step runs, never further ahead
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.advance()

    def advance(self):
        """Start building the next step's batches."""
        self.resume_state = self.generator.get_state()  # what a checkpoint stores: the pending step is not taken
        # every rank draws all ranks' seeds, so the generator moves alike everywhere; each keeps its own slice
        seeds = micro_seeds(self.generator, self.per_rank * self.world_size)
        mine = seeds[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]
        self.pending = self.pool.submit(self.build, mine)

    def build(self, seeds):
        """(micro-batches, real targets, input tokens) for these seeds; runs on the background thread."""
        cfg, task = self.cfg, self.task
        batches = [
            # a fresh generator per micro-batch: its contents depend on its seed alone
            task.batch(self.data, cfg.batch_size, cfg.block_size, torch.Generator().manual_seed(s))
            for s in seeds
        ]
        if self.pin:
            batches = [pinned(inputs, targets) for inputs, targets in batches]
        # counted here on the CPU, so the training loop never waits for a count on the GPU
        n_targets = sum(count_targets(targets) for _, targets in batches)
        return batches, n_targets, sum(task.count_tokens(inputs, targets) for inputs, targets in batches)

    def peek(self):
        """(micro-batches, real targets, input tokens) of the next step, without taking it."""
        return self.pending.result()

    def close(self):
        self.pool.shutdown(cancel_futures=True)
