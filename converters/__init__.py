"""
Model converters, one file each: rewrites of a run's model applied after it is built or loaded and before it is
spread over the ranks, listed by name. converters/base.py holds the contract (Converter), lora.py LoRA. A converter
is registered by its file: every module of this folder is imported here, and each Converter class it defines with a
name is in CONVERTERS. train.py, start.py and checkpoint.py name none of them: they call these functions.
"""

import importlib
import pkgutil

from config import ConfigError
from converters.base import Converter


def discovered_converters():
    """{name: Converter class} of every module in this folder, in the order of their file names."""
    found = {}
    for module in sorted(info.name for info in pkgutil.iter_modules(__path__)):
        for value in vars(importlib.import_module(f"converters.{module}")).values():
            # the classes a module defines, not those it imports
            is_converter = isinstance(value, type) and issubclass(value, Converter) and value.name
            if is_converter and value.__module__ == f"converters.{module}":
                found[value.name] = value
    return found


CONVERTERS = discovered_converters()


def requested(cfg):
    """The name of the converter a run's settings (cfg, a TrainConfig) ask for: "lora" for lora_rank alone; "" none."""
    return cfg.converter or ("lora" if cfg.lora_rank else "")


def check(cfg):
    """ConfigError for converter settings of cfg (a TrainConfig) that are wrong, or that do not go together."""
    name = requested(cfg)
    if name and name not in CONVERTERS:
        raise ConfigError(f"converter={name!r} is not one of the converters ({', '.join(CONVERTERS)}): add its file")
    for converter in CONVERTERS.values():
        converter.check(cfg)


def for_new_run(cfg, base, meta, base_record):
    """The converter of a new run (cfg) on model `base` for data with this meta, or None if it asks for none."""
    name = requested(cfg)
    return CONVERTERS[name].for_new_run(cfg, base, meta, base_record) if name else None


def saved(ckpt, cfg=None):
    """
    The converter whose state a checkpoint holds, made again from its record, or None for a plain checkpoint. cfg:
    the TrainConfig of a run resuming it. A checkpoint of a converter whose file is not here is one line.
    """
    if "converter" not in ckpt:
        return None
    name = ckpt["converter"]["name"]
    if name not in CONVERTERS:
        raise ConfigError(f"the checkpoint was made by converter {name!r}, which is not here: add its file")
    return CONVERTERS[name](ckpt["converter"]["record"], cfg)
