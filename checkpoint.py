"""
Checkpoints: what ckpt.pt and best.pt hold, written atomically (a file, or a sharded folder) and read with
torch.load(weights_only=True); nanoGPT's checkpoints read as ours (nanogpt_checkpoint). start.py makes models of them.

    save_training(out_dir / "ckpt.pt", model, rt, ...)           # everything a resume needs
    ckpt = load_checkpoint("out/best.pt")                        # start.model_from_checkpoint(ckpt): the model

A checkpoint is a dict: format_version, model_config, train_config, meta (the dataset's meta.json, so a tokenizer
can be rebuilt from the checkpoint alone), iter_num, best_val_loss, and the weights (state dicts of the plain
model) named by their role: "weights", the trained weights, and with ema_decay "average", their moving average,
which is what best.pt keeps, evaluations measure and sample.py uses (kept_weights picks it). ckpt.pt adds
optimizers (each optimizer's state dict under its name: "adamw", and with optimizer='muon' "muon"), scaler, rng
(every rank's generators) and sampler (the data stream).

A converted run's checkpoints (converters/: LoRA, with lora_rank) hold "converter": the converter's name and its
record, and as "weights" what the converter keeps (LoRA: the adapters alone; its record names their base, which
start.model_from_checkpoint loads again), in one file also under FSDP.

With fsdp, ckpt.pt is a folder instead, a sharded checkpoint (torch.distributed.checkpoint) that every rank writes
its part of: weights, optimizers and average keyed by parameter name, and beside them state.pt, the rest of the
dict above. load_checkpoint reads either kind; a folder's weights load whole into one process, or resharded into
any number of ranks with load_sharded. torch.distributed.checkpoint is imported by the functions that use it: half a
second of every script's start that only sharded checkpoints need.
"""

import contextlib
import difflib
import math
import os
import pickle
import random
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from config import ConfigError
from log import one_line
from model import ModelConfig, build_model
from tokens import GPT2_META

# of checkpoints; a checkpoint with a larger number needs newer code. 3: weights and average by role; 4: LoRA
# adapters and their base under "lora" (read, no longer written); 5: the optimizers' states by name (ckpt.pt only);
# 6: a converter's name and record under "converter". Each file is written with the lowest number that has what it
# holds, so that older code reads the others
FORMAT_VERSION = 6
PLAIN_FORMAT, OPTIMIZERS_FORMAT, CONVERTED_FORMAT = 3, 5, 6
# formats 1 and 2, of the repo's first days ("model" and "train_model", cross-attention's q and kv stacked), are
# refused in one line: OLD_FORMATS_COMMIT is the last commit that reads them
OLDEST_FORMAT = 3
OLD_FORMATS_COMMIT = "c78f975ac3b32fa5adf6932ebeae1d7ad92e24fb"
STATE_FILE = "state.pt"  # in a sharded checkpoint's folder: all but the weights and the optimizers' states
# What a sharded checkpoint's index (.metadata, which torch.distributed.checkpoint reads with plain pickle) is made
# of: its own dataclasses, torch.Size, dtypes and layouts by name, the folder's path. An index naming anything else is
# refused before PyTorch reads it, so a downloaded folder cannot run code
INDEX_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
}


def rng_state(device):
    """
    The state of every random generator this process draws from, as types torch.load(weights_only=True) accepts:
    Python's, NumPy's, torch's CPU generator and, on a CUDA device, that device's generator (only its own: another
    machine may see fewer GPUs).
    """
    # numpy's state holds its 624 Mersenne Twister keys as a uint32 array, which weights_only refuses: kept as a list
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def set_rng_state(state, device):
    """Restore every random generator from what rng_state(device) returned (on a CUDA device: that device's)."""
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    # the keys back as the array numpy expects, in the dtype the list lost
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if isinstance(cuda, list):  # format 3 as first written: one state per GPU the saving rank could see; ours is ours
        cuda = cuda[device.index] if device.type == "cuda" and device.index < len(cuda) else None
    # a GPU run resumed on a CPU restores the CPU generators only
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)


def all_finite(tensors):
    """A 0-d bool tensor: whether every floating tensor of the list is finite (integers always are)."""
    # one flag per tensor, stacked: the host waits for the GPU once, not once per tensor
    return torch.stack([v.isfinite().all() for v in tensors if v.is_floating_point()] or [torch.tensor(True)]).all()


def nonfinite_weights(iter_num):
    """The error that stops a save of weights holding inf or nan, so that no checkpoint ever holds one."""
    return FloatingPointError(
        f"the weights hold non-finite values at iteration {iter_num}; nothing saved, the "
        "last checkpoint is untouched. Lower learning_rate or raise warmup_iters"
    )


def finite_weights(state, iter_num):
    """state (a state dict), unchanged; nonfinite_weights's error if any weight is not finite."""
    if not all_finite(list(state.values())):
        raise nonfinite_weights(iter_num)
    return state


def weights_state(
    weights, model_config, cfg, meta, iter_num, best_val_loss, role="weights", converter=None, best_accuracy=None
):
    """
    What best.pt holds: weights (a state dict) under its role, "weights" or, with ema_decay, "average"; the
    model's settings (a ModelConfig), the run's, the dataset's meta. weights None: all but the weights (a sharded
    checkpoint's state.pt; its weights are saved apart). converter: a converted run's (converters/), whose name and
    record are kept and whose state (LoRA: the adapters) weights then holds.
    """
    state = {
        "format_version": PLAIN_FORMAT if converter is None else CONVERTED_FORMAT,
        # settings as plain dicts: enough to rebuild the architecture (model_from_checkpoint) and the run
        "model_config": asdict(model_config),
        "train_config": asdict(cfg),
        # the tokenizer's description: sample.py decodes with it, without the dataset
        "meta": meta,
        # where a resume goes on from, and the val loss a new best.pt must beat
        "iter_num": iter_num,
        "best_val_loss": best_val_loss,
        # its exact match, which a new best.pt must beat where the data has exact answers (else None)
        "best_accuracy": best_accuracy,
    }
    if weights is not None:
        # tensors keyed by parameter name, from the unwrapped model: no `module.` (DDP) or `_orig_mod.` prefix
        state[role] = finite_weights(weights, iter_num)
    if converter is not None:
        state["converter"] = {"name": converter.name, "record": converter.record}
    return state


def save_training(
    path, model, rt, *, ema_model, optimizers, scaler, sampler_state, train_seconds, schedule_from, converter, **saved
):
    """
    Save ckpt.pt at path: weights_state (saved: its other arguments) plus all a resume needs, with ema_model's
    weights as "average" where there is one. Call it on every rank (rt: this process's runtime.Runtime): their RNG
    states are gathered, and under FSDP it is a sharded checkpoint (a folder) that every rank writes its part of, so
    that no rank ever holds the whole model or optimizer; a converted run's is one file, also under FSDP.
    """
    sharded, iter_num = rt.fsdp and converter is None, saved["iter_num"]
    # each rank has its own generators (dropout differs per rank): all are gathered, in rank order, for rank 0 to save
    rng = [rng_state(rt.device)]
    if rt.world_size > 1:
        mine, rng = rng[0], [None] * rt.world_size
        dist.all_gather_object(rng, mine)
    weights = None if sharded else model.state_dict() if converter is None else converter.state(model)
    state = {
        **weights_state(weights, model.config, converter=converter, **saved),
        # the optimizers' states by name, whichever weights_state gives best.pt
        "format_version": OPTIMIZERS_FORMAT if converter is None else CONVERTED_FORMAT,
        # float16's current loss scale; an empty dict when no scaler is in use
        "scaler": scaler.state_dict(),
        "rng": rng,
        # the training time so far, for a time budget (max_minutes) to go on from, and where the learning-rate
        # schedule of a run resumed with another length went on from (optim.Schedule's resumed_at)
        "train_seconds": train_seconds,
        "schedule_from": schedule_from,
        # the data stream's generator as it was before the pending step's batches were drawn
        "sampler": {"generator": sampler_state},
    }
    if sharded:  # the weights and the optimizers' states apart, each rank its part, keyed by parameter name
        check_shards_finite([m for m in (model, ema_model) if m is not None], iter_num)
        save_sharded(sharded_state(model, ema_model=ema_model, optimizers=optimizers), state, path, rt.rank)
        return
    # AdamW's moments and step counts, Muon's momentum: without them a resume would restart its estimates from zero
    state["optimizers"] = {name: whole_optimizer_state(model, optimizer) for name, optimizer in optimizers.items()}
    if ema_model is not None:
        # what best.pt and sample.py use; training goes on from "weights", or the run would change
        state["average"] = finite_weights(ema_model.state_dict(), iter_num)
    if rt.rank == 0:  # every rank built the state (gathering the RNG states is a collective); one writes it
        save_checkpoint(state, path)


def save_weights(path, model, rt, *, converter=None, **saved):
    """
    Save best.pt at path: weights_state of model's weights, or of a converted model's state (saved: its other
    arguments). Call it on every rank: under FSDP the shards are checked on every rank, then gathered onto rank 0's
    CPU one tensor at a time, and rank 0 writes the file.
    """
    if rt.fsdp:
        check_shards_finite([model], saved["iter_num"])
    weights = whole_weights(model, rt) if converter is None else converter.state(model)
    if rt.rank == 0:
        save_checkpoint(weights_state(weights, model.config, converter=converter, **saved), path)


def check_shards_finite(models, iter_num):
    """Under FSDP, before a save: nonfinite_weights's error on every rank if any rank's shards hold inf or nan."""
    failed = (~all_finite([p.to_local() for model in models for p in model.parameters()])).float()
    dist.all_reduce(failed)
    if failed.item():
        raise nonfinite_weights(iter_num)


def whole_weights(model, rt):
    """model's state dict, whole; under FSDP gathered onto rank 0's CPU (the others get {}): call it on every rank."""
    if not rt.fsdp:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def whole_model(model, rt, converter=None):
    """
    On rank 0, a copy of FSDP-sharded model whole on rt.device, its weights gathered (whole_weights), converted as
    model was (converter); None on the other ranks. Call it on every rank.
    """
    weights = whole_weights(model, rt)
    if rt.rank != 0:
        return None
    with torch.random.fork_rng(devices=[]):  # its initial values are overwritten: they must not move rank 0's RNG
        whole = build_model(model.config)
    if converter is not None:
        converter.convert(whole, torch.Generator())
    whole.load_state_dict(weights)
    return whole.to(rt.device)


def whole_optimizer_state(model, optimizer):
    """
    optimizer.state_dict() as one process holding the whole model would have it, also under FSDP (a converted run's
    one-file ckpt.pt), where every rank gathers its shards onto rank 0's CPU (the others get {}).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return optimizer.state_dict()
    whole = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not whole:
        return {}
    # keyed by parameter name there, by the optimizer's own numbering here (start.load_whole_optimizer_state's inverse)
    number = {name: i for i, name in enumerate(name for group in whole["param_groups"] for name in group["params"])}
    return {
        "state": {number[name]: value for name, value in whole["state"].items()},
        "param_groups": [{**group, "params": [number[n] for n in group["params"]]} for group in whole["param_groups"]],
    }


def sharded_state(model, *, ema_model, optimizers):
    """
    The tensors of a sharded checkpoint, each rank's own part (DTensors under FSDP): {"weights", "optimizers": {name:
    state}[, "average"]} as in ckpt.pt, keyed by parameter name, for save_sharded to save or load_sharded to fill.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    # the optimizer's state keyed by parameter names, not by its own numbering: it then fits any sharding
    tensors = {
        "weights": get_model_state_dict(model),
        "optimizers": {name: get_optimizer_state_dict(model, o) for name, o in optimizers.items()},
    }
    if ema_model is not None:
        tensors["average"] = get_model_state_dict(ema_model)
    return tensors


def save_sharded(tensors, state, path, rank):
    """
    Write a sharded checkpoint to folder path: every rank its part of tensors (sharded_state), in parallel, and
    rank 0 the rest (state: the dict of save_training without its tensors) as state.pt, atomically (move_into_place).
    Call it on every rank; a failed write raises OSError as save_checkpoint, on every rank at once.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    new = path.with_name(f".{path.name}.new")
    # rank 0's steps and the ranks' parallel write, each failing on every rank or on none
    reason = on_rank_0(rank, remove, new)  # what a save cut short left
    if reason is None:
        try:
            # each rank writes its own files, synced to disk; rank 0 then the index of all of them (.metadata)
            dcp.save(tensors, checkpoint_id=new)
        except dcp.CheckpointException as e:  # a BaseException, raised on every rank, holding each rank's error
            reason = describe(next(iter(e.failures.values()))[0])
    if reason is None:
        # which tensors the folder holds: resuming reads an average only where there is one
        reason = on_rank_0(rank, write_file, {**state, "sharded_keys": sorted(tensors)}, new / STATE_FILE)
    if reason is None:
        reason = on_rank_0(rank, move_into_place, new, path)
    if reason is not None:
        # the part written is of no use, and may fill the disk; every rank is past the writes by now
        on_rank_0(rank, remove, new)
        free = shutil.disk_usage(path.parent).free / 2**30 if path.parent.is_dir() else 0.0
        raise OSError(
            f"could not write {path} ({reason}; {free:.1f} GiB free there); the previous {path.name}, if any, is "
            "intact: free space or fix the folder, then go on with --init_from=resume"
        )


def on_rank_0(rank, step, *args):
    """
    step(*args) on rank 0, then what went wrong (None if nothing did) on every rank: all stop together instead of
    the others waiting in the next collective until dist_timeout.
    """
    reason = [None]
    if rank == 0:
        try:
            step(*args)
        except Exception as e:  # any failure: the other ranks must hear of it, whatever it is
            reason = [describe(e)]
    dist.broadcast_object_list(reason, src=0)
    return reason[0]


def describe(error):
    """An error in a few words: the OS's message for an OSError ('No space left on device'), else type and text."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return f"{type(error).__name__}: {one_line(error)}" if str(error).strip() else type(error).__name__


class KeptError:
    """
    A binary file that keeps the OSError of a failed write. Written into directly, torch.save reports a full disk
    as a RuntimeError about stream positions; through this object the OSError itself comes out.
    """

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data):
        try:
            return self.file.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        self.file.flush()


def write_file(state, path):
    """torch.save(state) into the file path, flushed onto the disk before this returns; a full disk is an OSError."""
    with open(path, "wb") as f:
        writer = KeptError(f)
        try:
            torch.save(state, writer)
        except RuntimeError:
            if writer.error is None:
                raise
            raise writer.error from None
        # flush empties Python's buffer into the OS, fsync the OS's buffer onto the disk
        f.flush()
        os.fsync(f.fileno())


def move_into_place(new, path):
    """
    Rename new (a file or a folder) to path, replacing what is there. A file over a file is one atomic rename; where
    either is a folder (a sharded checkpoint), the previous one first steps aside as .NAME.old, which
    load_checkpoint reads if a kill comes between the two renames, and is deleted after.
    """
    old = path.with_name(f".{path.name}.old")
    if path.exists() and (path.is_dir() or new.is_dir()):
        remove(old)
        os.replace(path, old)
    os.replace(new, path)
    remove(old)  # the previous checkpoint, or one that a save killed between its renames left


def remove(path):
    """Delete a file or a folder, if there is one."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def load_sharded(ckpt, model, *, optimizers, ema_model, role="weights"):
    """
    Fill model (with the weights of `role`: "weights", or "average" to evaluate the average), optimizers ({name:
    optimizer} the run trains with: their state is created, then filled) and ema_model (or None: with the checkpoint's
    average, else the weights just loaded) from the sharded checkpoint ckpt (load_checkpoint's dict). Each rank
    reads the parts its own shards need, however many ranks wrote it (torch.distributed.checkpoint reshards), or
    all of them in a process without FSDP.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    keys = ckpt["sharded_keys"]  # the names of the folder's tensors: weights, optimizers, average
    # what a save of this run would write, to fill in; ema_model's own part only where the folder has an average
    # that the model does not read itself
    reads_average = "average" in keys and role != "average"
    tensors = sharded_state(model, ema_model=ema_model if reads_average else None, optimizers=optimizers)
    weights, states = tensors["weights"], tensors["optimizers"]
    if role == "average":  # the model, and ema_model with it, read the folder's average
        tensors["average"] = tensors.pop("weights")
    # without an average in the folder, ema_model starts from the weights just loaded
    average = tensors.get("average", weights)
    if "optimizers" not in keys:
        # format 3 held AdamW's state alone, as "optimizer", its groups without the peak (start.restore sets it)
        for group in states["adamw"]["param_groups"]:
            del group["initial_lr"]
        tensors["optimizer"] = tensors.pop("optimizers")["adamw"]
    # a single process (a resume without torchrun) reads every part itself
    read_shards(tensors, ckpt["sharded"], alone=not dist.is_initialized())
    set_model_state_dict(model, weights)
    for name, optimizer in optimizers.items():
        set_optimizer_state_dict(model, optimizer, states[name])
    if ema_model is not None:
        set_model_state_dict(ema_model, average)


def merged_checkpoint(ckpt, model):
    """A converted run's checkpoint as a plain one: model, its plain (merged) model, under "weights"; no converter."""
    kept = {key: ckpt[key] for key in ("train_config", "meta", "iter_num", "best_val_loss")}
    return {"format_version": PLAIN_FORMAT, "model_config": asdict(model.config), **kept, "weights": model.state_dict()}


def save_checkpoint(state, path):
    """
    Write state to path atomically: a temporary file beside it, flushed to disk, then renamed over path. A failed
    write (a full disk, a folder gone read-only) raises OSError naming the file, and path keeps its old contents.
    """
    path = Path(path)
    # a hidden file in the same folder: a rename is atomic only within one file system
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write_file(state, tmp)  # on disk before the rename makes it the checkpoint
        # a reader (or a crash) sees the old checkpoint or the new one, never half of one
        move_into_place(tmp, path)
    except OSError as e:
        # strerror is the OS's short message ('No space left on device'), without the errno and the temporary path
        raise OSError(
            f"could not write {path} ({e.strerror or e}); the previous {path.name}, if any, "
            "is intact: free space or fix the folder, then go on with --init_from=resume"
        ) from None
    finally:
        # a write that failed halfway leaves its temporary file; failing to remove it is not the error to report
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def load_checkpoint(path, map_location="cpu", weights=True, mmap=False):
    """
    A checkpoint written by train.py, loaded with weights_only=True so that it cannot run code. A sharded one (a
    folder) gives the same dict with the kept weights read whole into this process, or, with weights=False, no
    tensors at all; "sharded" then names the folder (and "sharded_keys" its tensors), for load_sharded.
    mmap: a file's tensors mapped from it, read only where used (a caller after its settings alone: 1 s against 0.004
    for a GPT-2 124M ckpt.pt). A checkpoint this code cannot read raises ConfigError with a one-line message.
    """
    path = Path(path)
    # a sharded save killed between its two renames left the previous checkpoint under this name
    old = path.with_name(f".{path.name}.old")
    if not path.exists() and old.exists():
        path = old
    if path.is_dir():
        if not (path / STATE_FILE).is_file():
            raise ConfigError(f"{path} is a folder but not a sharded checkpoint: it has no {STATE_FILE}")
        ckpt = read_checkpoint(path / STATE_FILE, map_location, fallback="", mmap=mmap)
        # the folder, where load_sharded reads the rest
        ckpt["sharded"] = path
        if weights:
            # built without drawing any initial values (the meta device), then given memory for the folder to fill
            with torch.device("meta"):
                model = build_model(ModelConfig.from_dict(ckpt["model_config"]))
            role = "average" if "average" in ckpt["sharded_keys"] else "weights"
            ckpt[role] = model.to_empty(device="cpu").state_dict()
            # this process reads every rank's part itself, whether or not it is one of several
            read_shards({role: ckpt[role]}, path, alone=True)
        return ckpt
    if not path.is_file():
        raise ConfigError(f"no checkpoint at {path}; {missing_checkpoint_hint(path.parent)}")
    fallback = ""  # what may still be usable beside a damaged file
    # ckpt.pt and best.pt are written at different times, so one damaged file often leaves the other usable
    if path.name == "ckpt.pt" and path.with_name("best.pt").is_file():
        fallback = "; best.pt beside it still holds the best weights (sample.py --checkpoint=best.pt)"
    elif path.name != "ckpt.pt" and path.with_name("ckpt.pt").exists():
        fallback = "; ckpt.pt beside it may still be usable"
    return read_checkpoint(path, map_location, fallback, mmap)


def run_checkpoint(out_dir, name=""):
    """The checkpoint of the run in out_dir that name picks: "" the best weights (best.pt, else ckpt.pt), or a file."""
    folder = Path(out_dir).expanduser()
    if name:
        return folder / name
    # best.pt is written at the evaluations that improve, ckpt.pt at the end: mid-run only best.pt may exist
    return folder / "best.pt" if (folder / "best.pt").is_file() else folder / "ckpt.pt"


def missing_checkpoint_hint(folder):
    """What to do when a checkpoint is not in folder: name the checkpoints that are there, else how to get one."""
    there = sorted(p.name for p in folder.glob("*.pt")) if folder.is_dir() else []
    if there:
        return f"{folder} holds {', '.join(there)}: pick one with --checkpoint={there[0]}"
    # a mistyped out_dir (out-shakespear): the run folder beside it that it most resembles
    beside = folder.parent.iterdir() if folder.parent.is_dir() else []
    runs = [p.name for p in beside if (p / "ckpt.pt").exists() or (p / "best.pt").exists()]
    close = difflib.get_close_matches(folder.name, runs, n=1)
    if close:
        return f"did you mean --out_dir={folder.parent / close[0]}?"
    return "train one first (python train.py configs/shakespeare.py), or point --out_dir at the run's folder"


def out_dir_problem(cfg):
    """
    Why a training run could not write cfg.out_dir (None if it can), found before any work is done, creating
    nothing: a folder that cannot be, or one holding another run that a new run would overwrite.
    """
    out_dir = cfg.out_dir
    if cfg.init_from != "resume" and not cfg.overwrite and (files := run_files(out_dir)):
        names = [p.name for p in files if not p.name.startswith("events.")]
        shown = ", ".join(names + (["TensorBoard logs"] if len(names) < len(files) else []))
        return (
            f"out_dir={out_dir} already holds a run ({shown}): go on with it with --init_from=resume, write this "
            f"run elsewhere with --out_dir=..., or replace it with --overwrite=True"
        )
    path = Path(out_dir).absolute()
    # the deepest part of the path that exists: the folder in which the rest would be created
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"out_dir={out_dir} cannot be a folder: {existing} is a file; choose another --out_dir"
    # write to create entries in it, execute to enter it
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"out_dir={out_dir} cannot be written: {existing} is not writable by this user; choose another --out_dir"
    return None


def run_files(out_dir):
    """
    The files of a run in out_dir, sorted: its checkpoints (a sharded one is a folder), the base a LoRA run keeps
    (start.keep_base) and TensorBoard logs.
    """
    folder = Path(out_dir)
    if not folder.is_dir():
        return []
    names = ("ckpt.pt", "best.pt", ".ckpt.pt.old", "base.pt", "base")
    return sorted(p for p in folder.iterdir() if p.name in names or p.name.startswith("events.out.tfevents."))


def read_checkpoint(path, map_location, fallback, mmap=False):
    """The checks and the load of load_checkpoint for one file; fallback: what to suggest if it is damaged."""
    # torch.load's own message for an empty file is cryptic, and this case has a likely cause worth naming
    if path.stat().st_size == 0:
        raise ConfigError(f"{path} is empty, not a checkpoint (a save cut short?){fallback}")
    try:
        # map_location "cpu": a checkpoint saved from a GPU loads on any machine; the caller moves the model
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # truncated archive, refused unpickling, ...: all mean the file cannot be used
        if "Unsupported global" in str(e):  # objects that weights_only=True refuses to rebuild
            raise ConfigError(
                f"{path} is not a readable checkpoint: it holds Python objects other than tensors and "
                "plain data, and unpickling them could run code"
            ) from None
        raise ConfigError(f"{path} is not a readable checkpoint (truncated or corrupted){fallback}") from None
    if isinstance(ckpt, dict) and "model_args" in ckpt and "format_version" not in ckpt:
        return nanogpt_checkpoint(ckpt, path)
    # only nanoformer writes format_version: any other file (a Hugging Face state dict, say) lacks it
    version = ckpt.get("format_version") if isinstance(ckpt, dict) else None
    if not isinstance(version, int):
        raise ConfigError(f"{path} is not a nanoformer checkpoint (it has no format_version)")
    if version > FORMAT_VERSION:
        raise ConfigError(
            f"{path} has checkpoint format {version}, newer than this code's {FORMAT_VERSION}; update nanoformer"
        )
    if version < OLDEST_FORMAT:
        raise ConfigError(
            f"{path} was written by an early nanoformer (checkpoint format {version}), a format this code no longer "
            f"reads: read it with the code of git checkout {OLD_FORMATS_COMMIT}, or start a new run"
        )
    if "lora" in ckpt:  # format 4 kept LoRA's record under a key of its own
        ckpt["converter"] = {"name": "lora", "record": ckpt.pop("lora")}
    if "optimizer" in ckpt:  # formats 3 and 4 held AdamW's state and Muon's under keys of their own
        ckpt["optimizers"] = {"adamw": ckpt.pop("optimizer"), **({"muon": ckpt.pop("muon")} if "muon" in ckpt else {})}
    return ckpt


def read_shards(tensors, path, alone):
    """
    Fill tensors (a nested dict, as sharded_state's) from the sharded checkpoint folder path; alone: this process
    reads them without the other ranks (else every rank calls it and each reads its part).
    """
    import torch.distributed.checkpoint as dcp

    # checked here: PyTorch would log two tracebacks looking for it before failing
    if not (Path(path) / ".metadata").is_file():
        raise ConfigError(f"{path} is not a readable sharded checkpoint: it has no .metadata (a save cut short?)")
    check_index(path)
    try:
        with warnings.catch_warnings():  # that it assumes a single process, which it is told
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, checkpoint_id=path, no_dist=alone)
    except dcp.CheckpointException as e:  # a BaseException: each failing rank's error, with its traceback
        error = next(iter(e.failures.values()))[0]
        raise ConfigError(f"{path} is not a readable sharded checkpoint: {type(error).__name__}: {error}") from None
    except (OSError, RuntimeError, ValueError) as e:  # no .metadata, a part cut short, tensors of other shapes
        raise ConfigError(f"{path} is not a readable sharded checkpoint: {one_line(e)}") from None


class IndexUnpickler(pickle.Unpickler):
    """Unpickles an index of the sharded checkpoint folder with INDEX_GLOBALS and torch's dtypes alone."""

    def __init__(self, file, folder):
        super().__init__(file)
        self.folder = folder

    def find_class(self, module, name):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in INDEX_GLOBALS and not dtype:
            raise ConfigError(
                f"{self.folder} is not a readable sharded checkpoint: its index names {module}.{name}, which no "
                "checkpoint's index holds, and unpickling it could run code"
            )
        return super().find_class(module, name)


def check_index(path):
    """
    ConfigError unless every index of the sharded checkpoint folder path unpickles with IndexUnpickler, .metadata
    into an index. Unpickling runs only the calls the pickle names, so once every name is one of a checkpoint
    index's, PyTorch's own reading of the same file can run nothing else. PyTorch falls back to a rank's own index
    (__0.metadata) where .metadata does not read as one: those are checked too.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    for index in sorted(Path(path).glob("*.metadata")):
        try:
            with open(index, "rb") as f:
                read = IndexUnpickler(f, path).load()
        except ConfigError:  # a name no index holds: IndexUnpickler's own line
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:  # cut short, garbage
            read = one_line(e)
        if not isinstance(read, Metadata):
            raise ConfigError(f"{path} is not a readable sharded checkpoint: its {index.name} is damaged ({read})")


def nanogpt_checkpoint(ckpt, path):
    """
    A checkpoint written by nanoGPT's train.py, as ours: its weights under our names, its settings, iter_num and
    best_val_loss; "nanogpt" marks it (its optimizer state is not carried over). meta: GPT-2 BPE for its GPT-2
    vocabulary (50257, or 50304 padded); None for any other, whose characters the caller takes (nanogpt_meta).
    """
    # the foreign-weights wing, loaded only for a nanoGPT checkpoint: its names are GPT-2's, which hf.py maps
    from hf import load_nanogpt

    try:
        model = load_nanogpt(ckpt, path)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path} looks like a nanoGPT checkpoint but does not load: {e}") from None
    gpt2 = model.config.vocab_size in (GPT2_META["vocab_size"], 50304)
    return {
        "format_version": FORMAT_VERSION,
        "weights": model.state_dict(),
        "model_config": asdict(model.config),
        "train_config": {},
        "meta": GPT2_META if gpt2 else None,
        "iter_num": int(ckpt.get("iter_num", 0)),
        "best_val_loss": float(ckpt.get("best_val_loss", math.inf)),
        "nanogpt": True,
    }


def nanogpt_meta(ckpt, path, meta, fix):
    """
    The meta of a nanoGPT character-level checkpoint (ckpt["meta"] None): its characters are in nanoGPT's meta.pkl,
    a pickle that is not read (unpickling can run code), so they come from a prepared dataset's meta, which must
    be character-level with as many ids; meta None: none was named. fix: how to name one, for the error.
    """
    vocab_size = ckpt["model_config"]["vocab_size"]
    if meta is None or meta["tokenizer"]["type"] != "char" or meta["vocab_size"] != vocab_size:
        given = "" if meta is None else f"; {meta.get('name', 'the dataset')} has {meta['vocab_size']} ids"
        raise ConfigError(
            f"{path} is a nanoGPT model of {vocab_size} characters, kept in its meta.pkl, which is not read "
            f"(unpickling can run code): {fix} of the same characters in the same order, e.g. "
            f"--dataset=shakespeare_char (65){given}"
        )
    return meta


def is_checkpoint(path):
    """Whether path names a checkpoint: a file (ours or nanoGPT's) or a sharded checkpoint's folder."""
    path = Path(path).expanduser()
    return path.is_file() or (path / STATE_FILE).is_file()


def check_local_path(init_from):
    """
    ConfigError if init_from is spelt as a local path (a .pt file, or starting with /, . or ~, or inside a folder
    that is here) that does not exist, naming the nearest path that does (out-shakespear/best.pt: did you mean
    out-shakespeare/best.pt?). A hub id (gpt2, org/name) passes.
    """
    path = Path(init_from).expanduser()
    inside_here = len(path.parts) > 1 and path.parent.is_dir()
    if path.exists() or not (path.suffix in (".pt", ".pth") or init_from.startswith(("/", ".", "~")) or inside_here):
        return
    # from the deepest folder that exists, each missing part replaced by the closest name there
    found, parts = Path(path.anchor or "."), path.parts[1 if path.is_absolute() else 0 :]
    for part in parts:
        if not (found / part).exists():
            names = [p.name for p in found.iterdir()] if found.is_dir() else []
            close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
            if not close:
                break
            part = close[0]
        found = found / part
    else:  # every missing part had a close name: that path exists
        raise ConfigError(f"init_from={init_from}: no such file or folder; did you mean {found}?")
    raise ConfigError(
        f"init_from={init_from}: no such file or folder (train a run first, e.g. python train.py "
        "configs/shakespeare.py, or give its checkpoint's path)"
    )


def kept_weights(ckpt):
    """The weights to evaluate, sample or start a new run from: the average if the checkpoint has one."""
    return ckpt["average"] if "average" in ckpt else ckpt["weights"]
