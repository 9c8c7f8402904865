"""
Where a model comes from: how a training run starts, how a resumed run gets its state back, and a model from any
source for sampling, evaluation and export (load_model). Four ways to start, each a function of (settings, the
dataset's meta) returning a Start; start_run() picks one by init_from:

    from_scratch      init_from='scratch': new weights, the model settings from the config
    resume            init_from='resume': out_dir/ckpt.pt, to go on exactly where the run stopped
    from_checkpoint   init_from=FILE (or a sharded FOLDER): another run's weights, ours or nanoGPT's, start a new run
    from_pretrained   init_from=a Hugging Face folder or hub id (GPT-2, Llama, Mistral), to fine-tune

Weights from a checkpoint or Hugging Face decide the model's settings (the Start's settings carry them), and a new
run from them is fitted to its data (fit_to_data). Once the model is on its devices and the optimizers exist,
restore() puts a resume's state back, in one place.
"""

import contextlib
import hashlib
import os
import shutil
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn as nn

import converters
import tokens
from checkpoint import (
    check_local_path,
    is_checkpoint,
    kept_weights,
    load_checkpoint,
    load_sharded,
    merged_checkpoint,
    move_into_place,
    nanogpt_meta,
    remove,
    run_checkpoint,
    save_checkpoint,
    set_rng_state,
)
from config import ConfigError, read_config_file
from log import log, one_line
from model import MODEL_KEYS, ModelConfig, Stack, build_model
from tasks import Task, make_task

CONFIGS = Path(__file__).resolve().parent / "configs"  # the shipped configs, to name one that fits a checkpoint


@dataclass
class Start:
    """Where a run starts: what each way of starting returns."""

    cfg: object  # the run's TrainConfig, with the model settings of the weights it starts from
    model: nn.Module  # in training mode, on the CPU, or on the meta device (lazy) for FSDP to fill
    task: Task
    meta: dict  # the tokenizer's meta that the run's checkpoints store (an encoder's includes its [MASK] id)
    ckpt: dict | None = None  # resume: the checkpoint it goes on from (a sharded one without its tensors)
    converter: object = None  # what fit_to_data or the checkpoint applied to the model (a converters.Converter)


def start_run(cfg, meta, lazy=False):
    """
    The Start of cfg.init_from, to train on a dataset with this meta. lazy: a model whose weights come later (from
    scratch, or from a sharded checkpoint) is built on the meta device, without memory or values: FSDP then
    allocates and fills each rank's shards.
    """
    if cfg.init_from == "scratch":
        return from_scratch(cfg, meta, lazy)
    if cfg.init_from == "resume":
        return resume(cfg, meta, lazy)
    check_local_path(cfg.init_from)
    begin = from_checkpoint(cfg, meta) if is_checkpoint(cfg.init_from) else from_pretrained(cfg, meta)
    return fit_to_data(begin, meta)


def from_scratch(cfg, meta, lazy):
    """New weights, drawn from the generator torch.manual_seed set."""
    # the task's meta may gain a [MASK] id (an encoder's), which the checkpoints then store
    task = task_of(cfg, meta)
    with torch.device("meta") if lazy else contextlib.nullcontext():
        model = build_model(cfg.model_config(task.model_vocab, task.pad_id))
    return Start(cfg, model, task, task.meta)


def task_of(cfg, meta):
    """The Task cfg names (task; "auto": its architecture's) on a dataset with this meta, with cfg's settings for it."""
    return make_task(cfg.task, cfg.arch, meta, cfg.mask_prob, cfg.label_smoothing)


def resume(cfg, meta, lazy):
    """
    out_dir/ckpt.pt: its settings and trained weights (eval_only: the weights it evaluates, the average if it has
    one); a sharded checkpoint's weights are read by restore(), each rank its shards.
    """
    path = Path(cfg.out_dir) / "ckpt.pt"
    ckpt = load_checkpoint(path, weights=False)
    if ckpt.get("nanogpt"):
        raise ConfigError(
            f"{path} was written by nanoGPT: start a new run from it with --init_from={path} and another "
            "--out_dir (its optimizer state is not carried over)"
        )
    # the weights were trained on another tokenizer's ids: on this data they would read nonsense
    if ckpt["meta"]["tokenizer"] != meta["tokenizer"]:
        raise other_ids(path, ckpt["meta"], meta, cfg)
    # the same tokenizer with tokens beyond the model's ids (chat data's markers after a character model's): the
    # embedding has no rows for them, and a resume goes on with the model as it was
    if meta["vocab_size"] > ckpt["model_config"]["vocab_size"]:
        raise ConfigError(
            f"{path}'s model reads {ckpt['model_config']['vocab_size']:,} ids and dataset={cfg.dataset} holds "
            f"{meta['vocab_size']:,}: a resume cannot grow the vocabulary. Start a new run from it, which grows it: "
            f"--init_from={path} --out_dir=NEW_DIR"
        )
    # resuming a finished run would train nothing and only save it again: an error, but for a job restarted after
    # its run was done (auto_resume), which says so and ends as the run did
    spent, done = ckpt.get("train_seconds", 0.0), None
    if ckpt["iter_num"] >= cfg.max_iters:
        done = (
            f"{path} is at iteration {ckpt['iter_num']}, which max_iters={cfg.max_iters} has reached: nothing to "
            "train. To train further, pass a larger --max_iters (the schedule follows it unless lr_decay_iters is set)"
        )
    elif cfg.max_minutes and spent >= 60 * cfg.max_minutes:
        done = (
            f"{path} has trained for {spent / 60:.2f} minutes, which max_minutes={cfg.max_minutes:g} has reached: "
            "nothing to train. To train further, pass a larger --max_minutes (or --max_minutes=0 to count steps only)"
        )
    if done and not cfg.eval_only:
        if not cfg.auto_resume:
            raise ConfigError(done)
        log(f"note: {done}")
    # the optimizers' states must fit the optimizers; checkpoints from before optimizer existed are AdamW's
    saved_optimizer = ckpt["train_config"].get("optimizer", "adamw")
    if saved_optimizer != cfg.optimizer:
        raise ConfigError(
            f"{path} was trained with optimizer={saved_optimizer!r}: resume it with --optimizer={saved_optimizer}"
        )
    # the checkpoint's settings completed with today's defaults: a checkpoint older than a setting lacks it
    config = ModelConfig.from_dict(ckpt["model_config"])
    # the checkpoint's settings win: its weights fit only the architecture they were trained in, a converter's
    # state only its own settings (Converter.run_settings). A restarted job (auto_resume) goes on only with the run
    # that was asked for: a setting given that the checkpoint's overrides is an error
    cfg = with_model_settings(cfg, config, "resuming with the checkpoint's model settings", strict=cfg.auto_resume)
    converter = converters.saved(ckpt, cfg)
    fine_tuning = converter.run_settings() if converter else {"converter": "", "lora_rank": 0}
    said = "resuming with the checkpoint's fine-tuning settings"
    cfg = with_saved_settings(cfg, fine_tuning, asdict(cfg), said, strict=cfg.auto_resume)
    averaged = "average" in (ckpt["sharded_keys"] if "sharded" in ckpt else ckpt)
    if averaged and not cfg.ema_decay and not cfg.eval_only:
        log("note: training goes on from the un-averaged weights; their average is dropped (ema_decay=0)")
    # said first thing, so that a run that goes on from a checkpoint never reads as a new one
    trained = f", {spent / 60:.1f} minutes trained" if spent else ""
    log(
        f"{'evaluating' if cfg.eval_only else 'resuming'} {path} at iteration {ckpt['iter_num']:,} (best val loss "
        f"{ckpt['best_val_loss']:.4f}{trained})"
    )
    # a resumed run keeps the checkpoint's meta, which already has an encoder's [MASK] id
    task = task_of(cfg, meta)
    if converter is not None:  # its base (checked against its fingerprint where it is partial), converted again
        return Start(cfg, converted_model(converter, ckpt, path.parent).train(), task, ckpt["meta"], ckpt, converter)
    with torch.device("meta") if lazy and "sharded" in ckpt else contextlib.nullcontext():
        model = build_model(config)
    if "sharded" not in ckpt:
        model.load_state_dict(ckpt["average" if averaged and cfg.eval_only else "weights"])
    return Start(cfg, model.train(), task, ckpt["meta"], ckpt)


def resumed_settings(cls, given, out_dir):
    """
    The settings ({name: value}) of dataclass cls with which the run in out_dir goes on: those its ckpt.pt was trained
    with, each one given (from the command line and config files) overriding its saved value, said in one note.
    """
    # its settings alone: the tensors stay on disk until resume() reads the checkpoint
    ckpt = load_checkpoint(Path(out_dir) / "ckpt.pt", weights=False, mmap=True)
    # settings added since the checkpoint was written keep their defaults; those since removed are dropped
    names = {f.name for f in fields(cls)}
    saved = {k: v for k, v in ckpt["train_config"].items() if k in names}
    # how to go on (init_from) and what to do this time (evaluate, plan) are not the run's settings
    changed = [
        f"{k}={v!r} (was {saved[k]!r})"
        for k, v in given.items()
        if k in saved and v != saved[k] and k not in ("init_from", "eval_only", "plan")
    ]
    if changed:
        log(f"note: going on with the settings of {out_dir}'s run, except those given: {', '.join(changed)}")
    return {**saved, **given}


def with_saved_settings(cfg, saved, given, said, strict=False):
    """
    cfg with the settings of the weights a run starts from (saved: {name: value}), and a note (starting with `said`)
    naming those the user gave (given, not left at their defaults) that these override, rather than silently.
    strict: those are a ConfigError instead, naming each and what to do (a resume by auto_resume).
    """
    defaults = {f.name: f.default for f in fields(cfg)}
    changed = [f"{k}={v!r}" for k, v in saved.items() if getattr(cfg, k) != defaults[k] and given[k] != v]
    if changed and strict:
        raise ConfigError(
            f"auto_resume found a run in {cfg.out_dir} trained with {', '.join(changed)}, not as asked: give the "
            "run's own settings to go on with it, or start this run in another --out_dir"
        )
    if changed:
        log(f"note: {said}: {', '.join(changed)}")
    return replace(cfg, **saved)


def with_model_settings(cfg, config, said, strict=False):
    """cfg with the model settings of config (a ModelConfig), noted as with_saved_settings does; None resolved."""
    saved = {k: getattr(config, k) for k in MODEL_KEYS}
    return with_saved_settings(cfg, saved, asdict(cfg.model_config(1)), said, strict)


def other_ids(path, saved, meta, cfg):
    """
    The error for a checkpoint trained on other token ids than cfg's dataset (meta) holds: what each is, and the
    dataset (and a shipped config of it) that fits the checkpoint.
    """
    fix = "a dataset prepared with its tokenizer"
    if "name" in saved:
        fix = f"--dataset={saved['name']}"
        keys = [f.name for f in fields(cfg)]
        # the (key, value) assignments of each shipped config
        items = {p: [(k, v) for k, v, _ in read_config_file(str(p), keys)] for p in sorted(CONFIGS.glob("*.py"))}
        fits = [p for p, assigned in items.items() if ("dataset", saved["name"]) in assigned]
        fix += f", as configs/{fits[0].name} has it" if fits else ""
    return ConfigError(
        f"{path} was trained on {describe_ids(saved)}, but dataset={cfg.dataset} holds {describe_ids(meta)}: "
        f"the ids would mean other text; use {fix}"
    )


def describe_ids(meta):
    """What a meta's token ids are, for a message: 'shakespeare_char (65 characters)'."""
    spec = meta["tokenizer"]
    kinds = {"char": "characters", "tiktoken": f"{spec.get('encoding')} BPE ids", "huggingface": "tokenizer.json ids"}
    return f"{meta.get('name', 'unnamed data')} ({meta['vocab_size']:,} {kinds.get(spec['type'], 'ids')})"


def from_checkpoint(cfg, meta):
    """
    A new run from a checkpoint file (another run's best.pt or ckpt.pt: its weights, the average if it kept one)
    or nanoGPT's (its characters the dataset's: nanogpt_meta), trained on the same tokenizer.
    """
    path = Path(cfg.init_from).expanduser()
    ckpt = load_checkpoint(path)
    saved_meta = ckpt["meta"] or nanogpt_meta(ckpt, path, meta, "train it on a character-level dataset")
    if saved_meta["tokenizer"] != meta["tokenizer"]:
        raise other_ids(path, saved_meta, meta, cfg)
    # its architecture and weights; dropout is the new run's (0 to evaluate, 0.1 to fine-tune on little data)
    model = model_from_checkpoint(ckpt, path.parent, dropout=cfg.dropout).train()
    cfg = with_model_settings(cfg, model.config, f"init_from={cfg.init_from} decides the model settings")
    # the task from the dataset, the meta to save from the checkpoint (an encoder's holds its [MASK] id), or from
    # the data where the task says so (chat: its tokens and template, which sample.py --chat needs)
    task = task_of(cfg, meta)
    return Start(cfg, model, task, meta if task.saves_data_meta else saved_meta)


def from_pretrained(cfg, meta):
    """
    Hugging Face weights (a hub id or a local folder) to fine-tune, on data in the ids they were trained on: GPT-2
    BPE for GPT-2, else the folder's tokenizer.json (an export's: the tokenizer its meta names).
    """
    # the Hugging Face wing, loaded only by a run that starts from Hugging Face weights
    import hf

    name, folder = cfg.init_from, Path(cfg.init_from).expanduser()
    # refused before any download: the weights are a causal LM's, and no pretrained model reads char-level ids
    if cfg.arch != "gpt":
        raise ConfigError(f"init_from={name} holds a causal LM: it needs arch='gpt', not arch={cfg.arch!r}")
    if not folder.is_dir() and meta["tokenizer"]["type"] == "char":
        raise ConfigError(
            f"init_from={name} needs data in the model's token ids: a GPT-2 BPE dataset (e.g. dataset='shakespeare') "
            "for GPT-2, else one prepared with its tokenizer.json (--tokenizer)"
        )
    try:
        if not folder.is_dir():
            # a hub id: its config.json and tokenizer.json come down with the weights (or from the local cache)
            folder = hf.download_from_hub(name)
        # the ids the model was trained on, read before the slow load: an export's meta, its tokenizer.json, or
        # GPT-2's BPE
        trained_on = hf.pretrained_meta(folder)
        config = hf.folder_config(folder)
    except (OSError, ValueError) as e:
        raise ConfigError(f"init_from={name}: {one_line(e)}") from None
    accepted = [trained_on["tokenizer"]]
    # export.py's folders read what their meta says (a GPT-2 layout may hold a character-level model)
    exported = hf.EXPORT_KEY in config
    gpt2 = config.get("model_type") == "gpt2" and not exported
    if gpt2:
        # GPT-2 reads GPT-2 BPE however the data was prepared: with tiktoken, or with its own tokenizer.json
        accepted.append(tokens.GPT2_META["tokenizer"])
    # the weights only fit the token ids they were trained on
    if meta["tokenizer"] not in accepted:
        if gpt2:
            raise ConfigError(f"init_from={name} needs a GPT-2 BPE dataset (e.g. dataset='shakespeare')")
        if exported:  # its meta names the dataset it was trained on, as a checkpoint's does
            raise other_ids(folder, trained_on, meta, cfg)
        raise ConfigError(
            f"init_from={name} needs a dataset prepared with its tokenizer.json, which {meta.get('name')} was not; "
            f"prepare one with --tokenizer={folder}, e.g. --dataset=shakespeare "
            f"--data_options=\"{{'tokenizer': '{folder}'}}\""
        )
    try:
        model = hf.from_pretrained(folder, dropout=cfg.dropout, block_size=cfg.block_size)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"init_from={name}: {one_line(e)}") from None
    task = task_of(cfg, meta)
    cfg = with_model_settings(cfg, model.config, f"init_from={name} decides the model settings")
    return Start(cfg, model, task, task.meta)


def fit_to_data(begin, meta):
    """
    A new run's Start from other weights (a checkpoint, Hugging Face's), fitted to its data (meta): the vocabulary
    grown to the data's chat tokens (GPT.grow_vocabulary), then the converter the run's settings ask for applied.
    """
    cfg, model = begin.cfg, begin.model
    base_vocab = model.config.vocab_size
    # taken before the vocabulary grows: a converter records the base as load_base will load it to resume or sample
    converter = converters.for_new_run(cfg, model, meta, base_record(cfg.init_from, model))
    # only chat data (a GPT's) has ids beyond its model's: other data shares its checkpoint's tokenizer (other_ids)
    if meta["vocab_size"] > base_vocab:
        model.grow_vocabulary(meta["vocab_size"])
        head = "" if model.lm_head.weight is model.body.wte.weight else " and head"
        log(
            f"the token embedding{head} grown from {base_vocab:,} to {meta['vocab_size']:,} ids for the data's "
            "tokens beyond the model's vocabulary; each new row starts as the mean of the old ones"
        )
    if converter is None:
        return begin
    # seeded alike on every rank: FSDP keeps each rank's shards of what it adds
    converter.convert(model, torch.Generator().manual_seed(cfg.seed))
    log(converter.describe(model))
    return replace(begin, converter=converter)


def restore(ckpt, models, *, optimizers, scaler, generator, cfg, rt):
    """
    Put a resumed run's state back, in this order: the optimizers' states and the weight average, with a sharded
    checkpoint's weights, each group keeping this run's peak learning rate; the loss scale, the data stream's position
    (generator), and last each rank's random generators, so that nothing draws from them before training does.
    """
    # imported here, not at the top: half a second of every script's start that only a resume needs
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # this run's peak learning rates, which the checkpoint's groups would replace: a resume may change them
    peaks = {name: [group["initial_lr"] for group in o.param_groups] for name, o in optimizers.items()}
    if "sharded" in ckpt:
        # eval_only evaluates what best.pt would hold: the average, if there is one
        role = "average" if cfg.eval_only and "average" in ckpt["sharded_keys"] else "weights"
        load_sharded(ckpt, models.raw, optimizers=optimizers, ema_model=models.average, role=role)
    else:
        for name, optimizer in optimizers.items():
            if rt.fsdp:  # a file from a run without FSDP: whole tensors, of which each rank keeps its shards
                load_whole_optimizer_state(models.raw, optimizer, ckpt["optimizers"][name])
            else:
                optimizer.load_state_dict(ckpt["optimizers"][name])
    # a checkpoint without an average gives the run a fresh one: the copy parallelize made of the weights
    if models.average is not None and "average" in ckpt:
        if rt.fsdp:
            set_model_state_dict(models.average, ckpt["average"], options=StateDictOptions(full_state_dict=True))
        else:
            models.average.load_state_dict(ckpt["average"])
    if scaler.is_enabled() and ckpt["scaler"]:
        scaler.load_state_dict(ckpt["scaler"])
    generator.set_state(ckpt["sampler"]["generator"])
    for name, optimizer in optimizers.items():
        for group, peak in zip(optimizer.param_groups, peaks[name]):
            group["initial_lr"] = peak
    # each rank's own generators (dropout) back as they were, in rank order, if the rank count is unchanged
    if len(ckpt["rng"]) == rt.world_size:
        set_rng_state(ckpt["rng"][rt.rank], rt.device)
    else:
        log(
            f"note: the checkpoint has RNG states for {len(ckpt['rng'])} rank(s), not {rt.world_size}; "
            "dropout restarts from the seed"
        )


def load_whole_optimizer_state(model, optimizer, state):
    """
    An optimizer's state_dict() from a run without FSDP (ckpt.pt as a file) into optimizer over the FSDP-sharded
    model: its parameters renumbered as names, each rank then keeping its shards.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    # the names in the order of the optimizer's own numbering (the same in both runs: configure_optimizers's)
    names = [name for group in get_optimizer_state_dict(model, optimizer)["param_groups"] for name in group["params"]]
    by_name = {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


# -----------------------------------------------------------------------------
# A model from any source, to sample, evaluate or export, or as a converted run's base


def load_model(init_from, *, out_dir, checkpoint, dataset, device, compile=False):
    """
    (model in eval mode on device, its Tokenizer, its data's meta, the name of its task: its run's task setting, else
    "auto", for tasks.make_task) for sampling and evaluation. init_from: "resume" (out_dir/checkpoint), a checkpoint
    file or sharded folder (ours or nanoGPT's, whose characters come from dataset), else Hugging Face weights (a hub
    id or a folder). compile: torch.compile the layer stacks, which generation calls.
    """
    if init_from != "resume":
        check_local_path(init_from)
    if init_from == "resume" or is_checkpoint(init_from):
        path = run_checkpoint(out_dir, checkpoint) if init_from == "resume" else Path(init_from).expanduser()
        # to the CPU first: a checkpoint saved on a GPU loads on any machine; .to(device) below moves it
        ckpt = load_checkpoint(path, map_location="cpu")
        # nanoGPT's character-level checkpoints take their characters from the dataset named
        named = tokens.load_meta(tokens.dataset_dir(dataset)) if dataset else None
        meta = ckpt["meta"] or nanogpt_meta(ckpt, path, named, "name a prepared dataset with --dataset")
        task = ckpt.get("train_config", {}).get("task", "auto")  # "auto" for weights saved without a run
        try:
            model = model_from_checkpoint(ckpt, path.parent)
        except (KeyError, TypeError, RuntimeError) as err:  # a missing entry, or weights that do not fit
            raise ValueError(f"{path} does not hold a usable model ({type(err).__name__}: {err})") from None
    else:
        meta, model = pretrained_model(init_from)
        task = "auto"
    # eval: dropout off, so the same seed gives the same text
    model.eval().to(device)
    if torch.device(device).type == "cpu":
        # every Linear's weight stored column by column (the same values; an embedding tied to the head too): a
        # decoding step's few rows then read the weights in memory order, and MKL streams them twice as fast: a
        # token of GPT-2 124M in 26 ms instead of 32 (docs/serving.md)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.data = module.weight.data.t().contiguous().t()
    if compile:
        # generation calls the layer stacks, not the model's forward, so those are what gets compiled
        for module in model.modules():
            if isinstance(module, Stack):
                module.compile(dynamic=True)
    # the tokenizer the data was prepared with, rebuilt from the checkpoint alone
    return model, tokens.Tokenizer.from_meta(meta), meta, task


def pretrained_model(name, **overrides):
    """
    (its meta, the model) of Hugging Face weights: a folder or a hub id (downloaded, or from the local cache). The
    meta is the folder's tokenizer.json's, else GPT-2's BPE for GPT-2, read before the slow load so that a folder
    without its tokenizer fails first. overrides: ModelConfig fields, as hf.from_pretrained takes them.
    """
    # the Hugging Face wing, loaded only where a model comes from Hugging Face weights
    import hf

    folder = Path(name).expanduser()
    if not folder.is_dir():
        # a hub id: its config.json and tokenizer.json come down with the weights (or from the local cache)
        folder = hf.download_from_hub(name)
    return hf.pretrained_meta(folder), hf.from_pretrained(folder, **overrides)


def load_configured(cfg, device):
    """load_model with the settings of sample.py, eval.py or serve.py (cfg): init_from, out_dir, ..., compile."""
    settings = {"out_dir": cfg.out_dir, "checkpoint": cfg.checkpoint, "dataset": cfg.dataset, "compile": cfg.compile}
    return load_model(cfg.init_from, device=device, **settings)


def model_from_checkpoint(ckpt, folder=None, **overrides):
    """
    The model a loaded checkpoint describes, with its weights, in eval mode; a converted run's made plain, as
    sample.py, eval.py and export.py use it (folder: the checkpoint's, where a partial converter's base is kept).
    overrides: ModelConfig fields that keep the weights, such as dropout for a new run from them.
    """
    converter = converters.saved(ckpt)
    if converter is not None:
        return converter.plain(converted_model(converter, ckpt, folder, **overrides))
    # the architecture from the saved settings, then its weights: load_state_dict is strict, so a mismatch raises
    model = build_model(ModelConfig.from_dict({**ckpt["model_config"], **overrides}))
    model.load_state_dict(kept_weights(ckpt))
    return model.eval()


def converted_model(converter, ckpt, folder=None, **overrides):
    """
    A converted run's model, to train on, made again from its checkpoint: on its base (a partial converter's, as
    load_base loads it from folder) or on a model of its settings, with the run's own dropout.
    """
    overrides = {"dropout": ckpt["model_config"]["dropout"], **overrides}
    if converter.partial:
        base = load_base(converter.record["base"], folder, **overrides)
    else:
        base = build_model(ModelConfig.from_dict({**ckpt["model_config"], **overrides}))
    return converter.restore(base, ckpt)


# -----------------------------------------------------------------------------
# The base model of a partial converter (LoRA's adapters): recorded when the run starts, loaded and checked again


def base_record(init_from, base):
    """
    What a run records of the model it starts from: where it was loaded from, its settings, a fingerprint, and the
    name of the copy a partial converter's run keeps of it in its own folder (keep_base).
    """
    where = Path(init_from).expanduser()
    source = "checkpoint" if is_checkpoint(where) else "pretrained"
    return {
        "source": source,
        # absolute, so that sample.py finds it from any folder; a hub id as it is
        "init_from": str(where.resolve()) if where.exists() else init_from,
        "model_config": asdict(base.config),
        "fingerprint": fingerprint(base),
        # a checkpoint file as a file, a sharded checkpoint or a Hugging Face folder as a folder
        "kept": "base.pt" if source == "checkpoint" and where.is_file() else "base",
    }


def keep_base(converter, out_dir):
    """
    A partial converter's run keeps its base in its own folder (out_dir/base.pt, or out_dir/base/ for a folder), so
    that the base run going on, a better best.pt, or the original rewritten in place never strands the adapters.
    Each file is a clone (clone_file), never a hard link: a link shares the file, and torch.save, cp and safetensors
    rewrite a file in place. A base that is itself a converted run's checkpoint (LoRA on a LoRA run) is kept merged,
    as plain weights: its own base.pt lives in its own folder, and a chain of runs then never looks for it in this one.
    Written beside the destination and renamed into place, so a kill leaves no half-kept base.
    """
    if converter is None or not converter.partial:
        return
    base = converter.record["base"]
    source, dest = Path(base["init_from"]).expanduser(), out_dir / base["kept"]
    stage = dest.with_name(f".{dest.name}.partial")
    remove(stage)
    if base["source"] == "checkpoint" and source.is_file():
        ckpt = load_checkpoint(source, mmap=True)
        if "converter" in ckpt:
            save_checkpoint(merged_checkpoint(ckpt, model_from_checkpoint(ckpt, source.parent)), dest)
            return
    if base["source"] == "pretrained" and not source.is_dir():  # a hub id: the files of its local snapshot
        # the Hugging Face wing, loaded only to keep a hub id's weights
        import hf

        source = hf.download_from_hub(base["init_from"])
    if source.is_file():
        clone_file(source, stage)
    else:
        stage.mkdir(parents=True)
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            (stage / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            clone_file(path, stage / path.relative_to(source))
    move_into_place(stage, dest)


def clone_file(source, dest):
    """
    dest, a copy of file source (a hub snapshot's link: the file it names) that no rewrite of source changes:
    os.copy_file_range lets the kernel share the blocks copy-on-write where the file system can (btrfs, XFS), which
    takes no space, and copy them where it cannot; a plain copy where the call is missing or refused.
    """
    source = Path(source).resolve()
    try:
        with open(source, "rb") as src, open(dest, "wb") as dst:
            left = os.fstat(src.fileno()).st_size
            while left > 0:
                copied = os.copy_file_range(src.fileno(), dst.fileno(), left)
                if copied == 0:  # the file shrank while being read: what is there is copied
                    break
                left -= copied
        shutil.copystat(source, dest)
    except (AttributeError, OSError):  # no copy_file_range (not Linux), or one across file systems on an old kernel
        shutil.copy2(source, dest)


def fingerprint(model):
    """
    A cheap fingerprint of a model's weights (16 hex digits): names, shapes and 4,096 evenly spaced values of each
    tensor. A partial converter's checkpoint keeps its base's, to refuse a base that changed since.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 4096)][:4096].float().cpu().contiguous()
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def load_base(base, folder=None, **overrides):
    """
    The plain model a partial converter's state was trained on, from base (base_record's record of it): the copy its
    run keeps (keep_base) in folder, the run's folder, else where it was loaded from (a checkpoint file or folder,
    or Hugging Face weights; runs from before keep_base). ConfigError with one line if it is gone or has changed.
    """
    where = base["init_from"]
    if folder is not None and "kept" in base and (Path(folder) / base["kept"]).exists():
        where = str(Path(folder) / base["kept"])
    fix = "put it back, or fine-tune again from the base you have"
    if base["source"] == "checkpoint":
        if not is_checkpoint(where):
            raise ConfigError(f"the adapters' base checkpoint {where} is not there (moved or deleted?): {fix}")
        model = model_from_checkpoint(load_checkpoint(where), Path(where).parent, **overrides)
    else:  # a folder or a hub id, cut to the positions the run used, as from_pretrained did
        if Path(where).is_absolute() and not Path(where).is_dir():
            raise ConfigError(f"the adapters' base folder {where} is not there (moved or deleted?): {fix}")
        _, model = pretrained_model(where, **{"block_size": base["model_config"]["block_size"], **overrides})
    if (found := fingerprint(model)) != base["fingerprint"]:
        raise ConfigError(
            f"the adapters' base {where} has changed since they were trained on it (its weights' fingerprint is "
            f"{found}, not {base['fingerprint']}): {fix}"
        )
    return model
