"""
Model converters, one file each: rewrites of a run's model applied after it is built or loaded and before it is
spread over the ranks (converters/base.py: the contract; lora.py: LoRA). A converter is found by its file name
(CONVERTERS, config.Plugins) and imported only by a run that asks for it or a checkpoint that records it. train.py,
start.py and checkpoint.py name none of them: they call these functions.
"""

from config import ConfigError, Plugins
from converters.base import Converter

CONVERTERS = Plugins(__name__, __path__, Converter)


def requested(cfg):
    """The name of the converter a run's settings (cfg, a TrainConfig) ask for: "lora" for lora_rank alone; "" none."""
    return cfg.converter or ("lora" if cfg.lora_rank else "")


def check(cfg):
    """
    ConfigError for the settings of the converter cfg (a TrainConfig) asks for that are wrong, or that do not go
    together; a run that asks for none imports none.
    """
    name = requested(cfg)
    if not name:  # its settings then go unused, as muon_lr does with AdamW (--lora_rank=0 turns a config's LoRA off)
        return
    if name not in CONVERTERS:
        raise ConfigError(f"converter={name!r} is not one of the converters ({', '.join(CONVERTERS)}): add its file")
    CONVERTERS[name].check(cfg)


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
