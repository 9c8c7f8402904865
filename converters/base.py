"""What every model converter is: the Converter contract. Each converter is one file beside this one."""


class Converter:
    """
    A rewrite of a run's model, found by its name (the run's `converter` setting; a checkpoint records it). A new
    run makes one with for_new_run, a checkpoint's is made again from its record (what the checkpoint keeps of it).
    partial: its checkpoints keep only what it trains, over a base model that record["base"] describes (start.py
    loads that base and hands it to restore); else they keep every weight, and restore gets a model of the
    checkpoint's settings to load them into.
    """

    name = ""  # its name in CONVERTERS: the `converter` setting of train.py
    partial = False

    def __init__(self, record, cfg=None):
        self.record = record  # what the checkpoints keep of it: plain data
        self.cfg = cfg  # the TrainConfig of a run that trains (or resumes) it; None to sample or evaluate

    @classmethod
    def check(cls, cfg):
        """ConfigError for this converter's settings in cfg (a TrainConfig) that are wrong, or that it cannot take."""

    @classmethod
    def for_new_run(cls, cfg, base, meta, base_record):
        """The converter of a new run (cfg) on `base`, as loaded, for data with this meta; base_record: where from."""
        raise NotImplementedError

    def convert(self, model, generator):
        """model rewritten in place (and returned); generator draws anything new, alike on every rank."""
        raise NotImplementedError

    def describe(self, model):
        """The line a run logs about the converted model."""
        return f"converter {self.name}"

    def state(self, model):
        """What a checkpoint keeps of the converted model: {name: tensor}, whole, on the CPU (a collective on FSDP)."""
        return {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}

    def restore(self, base, ckpt):
        """The converted model of a checkpoint, to train on: base (see partial) converted, with ckpt's state in it."""
        raise NotImplementedError

    def plain(self, model):
        """The converted model as sample.py, eval.py and export.py use it: a plain model of model.py, in eval mode."""
        return model.eval()

    def run_settings(self):
        """The TrainConfig settings a run resuming a checkpoint of this converter takes from it ({name: value})."""
        return {"converter": self.name}
