"""A chat model end to end: trained on a prepared chat dataset, scored by eval.py and train.py, talked to through
sample.py --chat; every number checked against full forward passes over explicitly built ids."""

import io
import sys

import numpy as np
import pytest
import torch

import eval as evaluate
import sample
from checkpoint import load_checkpoint
from config import parse_config
from start import model_from_checkpoint
from tasks import make_task
from tokens import Tokenizer, load_conversations, load_meta


def model_and_meta(root):
    ckpt = load_checkpoint(root / "out" / "ckpt.pt")
    return model_from_checkpoint(ckpt), ckpt["meta"]


def builtin_prompt(meta, turns, system=""):
    """
    The built-in template's ids written out by hand: [<system> s <end_of_turn>] <user> q <end_of_turn> <assistant>
    [a <end_of_turn>] ...
    """
    tokenizer, special = Tokenizer.from_meta(meta), meta["special_tokens"]
    ids = [special["system"], *tokenizer.encode(system), special["end_of_turn"]] if system else []
    for question, answer in turns:
        ids += [special["user"], *tokenizer.encode(question), special["end_of_turn"], special["assistant"]]
        if answer is not None:
            ids += [*tokenizer.encode(answer), special["end_of_turn"]]
    return ids


@torch.no_grad()
def greedy(model, ids, stop):
    """Greedy decoding by full forward passes over the whole sequence each step, through the stop id (kept)."""
    out = []
    while len(ids) + len(out) <= model.config.block_size:
        token = int(model(torch.tensor([ids + out]))[0][0, -1].argmax())
        out.append(token)
        if token == stop:
            break
    return out


def test_eval_scores_the_assistant_tokens_and_exact_answers_as_explicit_loops_do(chat_run, capsys):
    root, folder, _ = chat_run
    model, meta = model_and_meta(root)
    stop = meta["special_tokens"]["end_of_turn"]
    results = evaluate.main(parse_config(evaluate.EvalConfig, [f"--out_dir={root / 'out'}", "--checkpoint=ckpt.pt"]))
    capsys.readouterr()
    conversations = load_conversations(folder, "val")
    nats, count, exact = 0.0, 0, 0
    for i in range(len(conversations)):
        ids, targets = (a.astype(np.int64) for a in conversations[i])
        with torch.no_grad():
            logits, _ = model(torch.tensor(ids[None, :-1]))
        logprobs = torch.log_softmax(logits[0].double(), dim=-1)
        # an id is learned where its flag is set; it is predicted from the ids before it
        learned = np.flatnonzero(targets[1:])
        nats -= float(logprobs[learned, ids[1:][learned]].sum())
        count += len(learned)
        # the final reply: the last run of flagged ids, decoded from everything before it
        start = max(k for k in range(len(ids)) if not targets[k]) + 1
        exact += greedy(model, ids[:start].tolist(), stop) == ids[start:].tolist()
    assert results["task"] == "chat" and results["conversations"] == len(conversations)
    assert results["targets"] == count
    assert results["loss"] == pytest.approx(nats / count, rel=1e-5)
    assert results["exact_match"] == pytest.approx(exact / len(conversations))
    assert 0 < results["exact_match"]  # the model learned something: the check compares real replies


def test_a_block_size_that_dwarfs_the_longest_conversation_is_noted(chat_run):
    root, folder, _ = chat_run
    conversations = load_conversations(folder, "train")
    longest = max(len(conversations[i][0]) - 1 for i in range(len(conversations)))  # inputs: the ids less one
    task = make_task("auto", "gpt", load_meta(folder))
    for block_size, said in [(4 * longest, True), (4 * longest - 1, False), (longest, False)]:
        note = task.length_note(task.load_split(folder, "train", block_size), block_size)
        assert (note is not None) == said
    note = task.length_note(task.load_split(folder, "train", 10 * longest), 10 * longest)
    assert f"is 10x the longest training conversation ({longest} positions)" in note


def test_train_reports_the_exact_match_of_its_val_replies(chat_run):
    root, folder, summary = chat_run
    model, meta = model_and_meta(root)
    conversations = load_conversations(folder, "val")
    stop = meta["special_tokens"]["end_of_turn"]
    exact = 0
    for i in range(len(conversations)):
        ids, targets = (a.astype(np.int64).tolist() for a in conversations[i])
        start = max(k for k in range(len(ids)) if not targets[k]) + 1
        exact += greedy(model, ids[:start], stop) == ids[start:]
    assert summary["evals"][-1]["accuracy"] == pytest.approx(exact / len(conversations))


def test_sample_chat_answers_once_and_talks_turn_by_turn(chat_run, monkeypatch, capsys):
    root, _, _ = chat_run
    model, meta = model_and_meta(root)
    tokenizer, stop = Tokenizer.from_meta(meta), meta["special_tokens"]["end_of_turn"]

    def reply(turns):
        return tokenizer.decode([t for t in greedy(model, builtin_prompt(meta, turns), stop) if t != stop])

    options = [f"--out_dir={root / 'out'}", "--checkpoint=ckpt.pt", "--chat", "--temperature=0"]
    out = io.StringIO()
    sample.main(parse_config(sample.SampleConfig, [*options, "--start=abca"]), out=out)
    assert out.getvalue() == reply([("abca", None)]) + "\n"

    # two turns (the second reads the first), a new conversation, an unknown command, then the end
    first = reply([("abc", None)])
    second = reply([("abc", first), ("cab", None)])
    fresh = reply([("cab", None)])
    monkeypatch.setattr(sys, "stdin", io.StringIO("abc\ncab\n/reset\ncab\n/what\n/quit\nnever read\n"))
    out = io.StringIO()
    sample.main(parse_config(sample.SampleConfig, options), out=out)
    assert out.getvalue() == f"{first}\n{second}\n{fresh}\n"
    err = capsys.readouterr().err
    assert "/reset starts a new conversation" in err and "unknown command /what" in err and "a new conversation" in err


def test_sample_chat_goes_on_past_block_size_without_the_oldest_turns(chat_run, monkeypatch, capsys):
    """
    Five questions, more than block_size holds: each gets the reply the model gives to the conversation without its
    oldest exchanges, written out here by hand (the system prompt kept; when the next question does not fit, the
    oldest exchanges dropped until the conversation takes at most half of block_size), and one note says so.
    """
    root, _, _ = chat_run
    model, meta = model_and_meta(root)
    tokenizer, stop, block = Tokenizer.from_meta(meta), meta["special_tokens"]["end_of_turn"], model.config.block_size
    system, questions = "ab", ["abcabcabcabc", "bcabcabcaabc", "cabcabbcaabc", "aabcabcabcab", "bbacabcabcab"]
    kept, replies, drops = [], [], 0
    for question in questions:
        prompt = builtin_prompt(meta, [*kept, (question, None)], system)
        if len(prompt) >= block:
            drops += 1
            while kept and len(prompt) > block // 2:
                kept = kept[1:]
                prompt = builtin_prompt(meta, [*kept, (question, None)], system)
        reply = tokenizer.decode([t for t in greedy(model, prompt, stop) if t != stop])
        kept.append((question, reply))
        replies.append(reply)
    assert drops >= 2 and all(replies)  # what makes this a test: the oldest turns went more than once

    options = [f"--out_dir={root / 'out'}", "--checkpoint=ckpt.pt", "--chat", "--temperature=0", f"--system={system}"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(questions) + "\n"))
    out = io.StringIO()
    sample.main(parse_config(sample.SampleConfig, options), out=out)
    assert out.getvalue() == "".join(f"{reply}\n" for reply in replies) + "\n"  # the last newline: end of input
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == [
        f"note: the conversation outgrew the {block} tokens the model reads (block_size): its oldest turns are left "
        "out from now on (the system prompt stays)"
    ]


def test_chat_mistakes_are_one_line(chat_run, tmp_path, capsys):
    root, folder, _ = chat_run
    meta = load_meta(folder)
    assert meta["kind"] == "chat"
    for argv, message in [
        (["--chat", "--num_samples=2"], "one message at a time"),
        (["--system=be brief"], "add --chat"),
        (["--chat", "--attention=x.png", "--start=abc"], "drop it with --chat"),
    ]:
        assert sample.cli([f"--out_dir={root / 'out'}", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("sample.py: error:") and message in err and err.count("\n") == 1
    # a model trained on plain text has no template to chat with
    plain = tmp_path / "plain"
    ckpt = load_checkpoint(root / "out" / "ckpt.pt")
    ckpt["meta"] = {k: v for k, v in ckpt["meta"].items() if k != "chat"}
    plain.mkdir()
    torch.save(ckpt, plain / "ckpt.pt")
    assert sample.cli([f"--init_from={plain / 'ckpt.pt'}", "--chat", "--start=abc"]) == 2
    err = capsys.readouterr().err
    assert "no chat template" in err and err.count("\n") == 1
    assert evaluate.cli([f"--out_dir={root / 'out'}", "--task=lm", "--exact_match=True"]) == 2
    assert "--exact_match applies to task=chat" in capsys.readouterr().err
