"""
Checkpoints: what ckpt.pt and best.pt hold, written atomically and read with torch.load(weights_only=True).

    save_checkpoint(training_state(...), out_dir / "ckpt.pt")    # everything a resume needs
    model = model_from_checkpoint(load_checkpoint("out/best.pt"))  # any script: the model, in eval mode

A checkpoint is a dict: format_version, model (the plain model's state dict), model_config, train_config, meta
(the dataset's meta.json, so a tokenizer can be rebuilt from the checkpoint alone), iter_num, best_val_loss; ckpt.pt
adds optimizer (AdamW's state dict), scaler, rng (every rank's generators), sampler (the data stream), with a weight
average train_model (the optimizer's own weights) and, with optimizer='muon', muon (Muon's state dict).
"""

import contextlib
import json
import os
import random
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from config import ConfigError
from model import ModelConfig, build_model

FORMAT_VERSION = 2  # of checkpoints; a checkpoint with a larger number needs newer code. 2: train_model


def rng_state():
    """Every random generator's state, as types torch.load(weights_only=True) accepts."""
    # numpy's state holds its 624 Mersenne Twister keys as a uint32 array, which weights_only refuses: kept as a list
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
        # one state per visible GPU; none on a machine without CUDA
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state):
    """Restore every random generator from what rng_state() returned."""
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    # the keys back as the array numpy expects, in the dtype the list lost
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    # a GPU run resumed on a CPU restores the CPU generators only
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def finite_weights(model, iter_num):
    """model's state_dict; FloatingPointError if any weight is not finite, so that no checkpoint ever holds one."""
    state = model.state_dict()
    # only floating tensors can hold inf or nan (integer buffers cannot)
    floats = [v for v in state.values() if v.is_floating_point()]
    # one flag per tensor, stacked: the host waits for the GPU once, not once per tensor
    if not torch.stack([torch.isfinite(v).all() for v in floats]).all():
        raise FloatingPointError(
            f"the weights hold non-finite values at iteration {iter_num}; nothing saved, the "
            "last checkpoint is untouched. Lower learning_rate or raise warmup_iters"
        )
    return state


def weights_state(model, cfg, meta, iter_num, best_val_loss):
    """What best.pt holds: the weights to use (the average, with ema_decay), the model settings, the dataset's meta."""
    return {
        "format_version": FORMAT_VERSION,
        # tensors keyed by parameter name, from the unwrapped model: no `module.` (DDP) or `_orig_mod.` prefix
        "model": finite_weights(model, iter_num),
        # settings as plain dicts: enough to rebuild the architecture (model_from_checkpoint) and the run
        "model_config": asdict(model.config),
        "train_config": asdict(cfg),
        # the tokenizer's description: sample.py decodes with it, without the dataset
        "meta": meta,
        # where a resume goes on from, and the val loss a new best.pt must beat
        "iter_num": iter_num,
        "best_val_loss": best_val_loss,
    }


def training_state(
    model, *, ema_model, cfg, meta, iter_num, best_val_loss, optimizers, scaler, sampler_state, world_size
):
    """
    What ckpt.pt holds: weights_state plus all a resume needs, including the optimizer's own weights (model's) as
    "train_model" when "model" holds their average (ema_model). Call it on every rank: RNG states are gathered.
    """
    # each rank has its own generators (dropout differs per rank): all are gathered, in rank order, for rank 0 to save
    rng = [rng_state()]
    if world_size > 1:
        rng = [None] * world_size
        dist.all_gather_object(rng, rng_state())
    state = {
        # with a weight average, "model" holds the average: the weights best.pt and sample.py use
        **weights_state(model if ema_model is None else ema_model, cfg, meta, iter_num, best_val_loss),
        # AdamW's moments and step counts: without them a resume would restart its estimates from zero
        "optimizer": optimizers["adamw"].state_dict(),
        # float16's current loss scale; an empty dict when no scaler is in use
        "scaler": scaler.state_dict(),
        "rng": rng,
        # the data stream's generator as it was before the pending step's batches were drawn
        "sampler": {"generator": sampler_state},
    }
    if "muon" in optimizers:
        # Muon's momentum buffers, beside AdamW's state (which then covers the parameters outside the blocks only)
        state["muon"] = optimizers["muon"].state_dict()
    if ema_model is not None:
        # the weights training goes on from: resuming from the average instead would change the run
        state["train_model"] = finite_weights(model, iter_num)
    return state


def save_checkpoint(state, path):
    """
    Write state to path atomically: a temporary file beside it, flushed to disk, then renamed over path. A failed
    write (a full disk, a folder gone read-only) raises OSError naming the file, and path keeps its old contents.
    """
    path = Path(path)
    # a hidden file in the same folder: a rename is atomic only within one file system
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            # flush empties Python's buffer into the OS, fsync the OS's buffer onto the disk
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
        # a reader (or a crash) sees the old checkpoint or the new one, never half of one
        os.replace(tmp, path)
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


def write_json(obj, path):
    """Write obj to path as indented JSON, replacing it atomically (config.json beside the checkpoints)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def load_checkpoint(path, map_location="cpu"):
    """
    A checkpoint written by train.py, loaded with weights_only=True so that it cannot run code.
    A missing, corrupt or newer-format file raises ConfigError with a one-line message.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no checkpoint at {path}; train one first, or point --out_dir at the run's folder")
    fallback = ""  # what may still be usable beside a damaged file
    # ckpt.pt and best.pt are written at different times, so one damaged file often leaves the other usable
    if path.name == "ckpt.pt" and path.with_name("best.pt").is_file():
        fallback = "; best.pt beside it still holds the best weights (sample.py --checkpoint=best.pt)"
    elif path.name != "ckpt.pt" and path.with_name("ckpt.pt").is_file():
        fallback = "; ckpt.pt beside it may still be usable"
    # torch.load's own message for an empty file is cryptic, and this case has a likely cause worth naming
    if path.stat().st_size == 0:
        raise ConfigError(f"{path} is empty, not a checkpoint (a save cut short?){fallback}")
    try:
        # map_location "cpu": a checkpoint saved from a GPU loads on any machine; the caller moves the model
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated archive, refused unpickling, ...: all mean the file cannot be used
        if "Unsupported global" in str(e):  # objects that weights_only=True refuses to rebuild
            raise ConfigError(
                f"{path} is not a readable checkpoint: it holds Python objects other than tensors and "
                "plain data, and unpickling them could run code"
            ) from None
        raise ConfigError(f"{path} is not a readable checkpoint (truncated or corrupted){fallback}") from None
    # only nanoformer writes format_version: any other file (a Hugging Face state dict, say) lacks it
    version = ckpt.get("format_version") if isinstance(ckpt, dict) else None
    if not isinstance(version, int):
        raise ConfigError(f"{path} is not a nanoformer checkpoint (it has no format_version)")
    # older formats still load: keys added since (train_model, in 2) are read only where present; "muon" needs no
    # new format: an AdamW run's checkpoint is as before, and a Muon run's has its own key beside "optimizer"
    if version > FORMAT_VERSION:
        raise ConfigError(
            f"{path} has checkpoint format {version}, newer than this code's {FORMAT_VERSION}; update nanoformer"
        )
    return ckpt


def model_from_checkpoint(ckpt):
    """The model a loaded checkpoint describes, with its weights, in eval mode."""
    # the architecture from the saved settings, then its weights: load_state_dict is strict, so a mismatch raises
    model = build_model(ModelConfig.from_dict(ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    return model.eval()
