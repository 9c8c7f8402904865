"""A task of one's own: one class, registered in data.TASKS, trained, evaluated and sampled through the scripts."""

import io

import torch
from tiny_run import tiny

import data
import eval as evaluation
import sample
import train
from data import CausalLM


class Successor(CausalLM):
    """
    A GPT predicting, at each position, its own token's successor in the vocabulary ((id + 1) mod V) rather than
    the next token of the text: a task with one exact answer per position, learnt by a tiny model in a few steps.
    """

    name, bits_per_byte = "successor", False

    def batch(self, data, batch_size, block_size, generator):
        (inputs,), _ = super().batch(data, batch_size, block_size, generator)
        return (inputs,), (inputs + 1) % self.meta["vocab_size"]

    def evaluate(self, model, tokenizer, cfg, progress):
        ids = torch.arange(self.meta["vocab_size"])
        # every id once, in windows the model can read
        logits = torch.cat([model(part[None])[0][0] for part in ids.split(model.config.block_size)])
        return {"successors": (logits.argmax(-1) == (ids + 1) % len(ids)).float().mean().item()}

    def sample(self, model, tokenizer, text, cfg, out):
        ids = tokenizer.encode(text)
        logits, _ = model(torch.tensor([ids]))
        print(tokenizer.decode(logits[0].argmax(-1).tolist()), file=out)
        return (ids,)


def test_a_task_of_its_own_trains_evaluates_and_samples_through_the_scripts(data_root, tmp_path, monkeypatch):
    monkeypatch.setitem(data.TASKS, "successor", Successor)
    out_dir = tmp_path / "successor"
    settings = dict(task="successor", max_iters=200, eval_interval=200, learning_rate=1e-2, lr_decay_iters=200)
    summary = train.main(tiny(data_root, out_dir, **settings))
    first, last = summary["evals"][0], summary["evals"][-1]
    assert last["val"] < 0.1 < first["val"]
    # eval.py and sample.py take the task from the checkpoint, and ask it
    results = evaluation.main(evaluation.EvalConfig(out_dir=str(out_dir)), out=io.StringIO())
    # the few characters the text never holds are never trained
    assert results["successors"] > 0.9 and results["task"] == "lm"
    printed = io.StringIO()
    sample.main(sample.SampleConfig(out_dir=str(out_dir), start="abc"), out=printed)
    assert printed.getvalue() == "bcd\n"
    # a task that TASKS does not hold is a one-line error
    assert train.cli([f"--out_dir={tmp_path / 'x'}", "--task=nonesuch"]) == 2
