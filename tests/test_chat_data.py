"""Chat data: prepare_data.py chat and shakespeare_chat, the conversation files (tokens.py), chat batches (data.py).

References are written by hand or computed independently: ids from tiktoken or the characters themselves, loss
masks spelled out token by token, batches built by explicit loops, the quiz's answers recomputed from the raw text.
"""

import json
import logging
import re

import numpy as np
import pytest
import tiktoken
import torch
from tiny_run import tiny

import prepare_data
import train
from config import ConfigError
from model import IGNORE_INDEX, ModelConfig, build_model
from recipes import prepare
from tasks import make_task
from tasks.chat import Chat, chat_batch, chat_rows, padding_fraction
from tokens import Tokenizer, check_prepared, final_reply, load_conversations, load_meta

GOOD = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Two plus two?"},
        {"role": "assistant", "content": "Four."},
    ],
    [
        {"role": "user", "content": "Name a cat."},
        {"role": "assistant", "content": "Tom."},
        {"role": "user", "content": "And a dog?"},
        {"role": "assistant", "content": "Rex."},
    ],
] + [
    [{"role": "user", "content": f"Say {word}."}, {"role": "assistant", "content": word}]
    for word in ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
]


def jsonl(path, conversations, extra_lines=()):
    """A JSONL file of {"messages": ...} lines, then extra raw lines (bytes or str)."""
    with open(path, "wb") as f:
        for messages in conversations:
            f.write(json.dumps({"messages": messages}).encode("utf-8") + b"\n")
        for line in extra_lines:
            f.write((line if isinstance(line, bytes) else line.encode("utf-8")) + b"\n")
    return path


def stored(folder):
    """Every stored conversation of both splits, as (ids list, targets list)."""
    return [
        (ids.tolist(), targets.tolist())
        for split in ("train", "val")
        for ids, targets in load_conversations(folder, split)
    ]


def builtin(messages, encode, special):
    """The built-in template written out: [<role> text <end_of_turn>]..., targets on the assistant's text and its
    end-of-turn; ids after the last target are not stored (there are none in this template)."""
    ids, targets = [], []
    for m in messages:
        text = encode(m["content"])
        ids += [special[m["role"]], *text, special["end_of_turn"]]
        targets += [0] + [int(m["role"] == "assistant")] * (len(text) + 1)
    return ids, targets


# ----------------------------------------------------------------------------- preparing


@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
def test_chat_jsonl_is_every_conversation_in_the_builtin_template(tmp_path, tokenizer):
    source = jsonl(tmp_path / "talk.jsonl", GOOD)
    folder = prepare("chat", data_dir=tmp_path, input=str(source), tokenizer=tokenizer, val_fraction=0.3)
    meta = load_meta(folder)
    check_prepared(folder)
    if tokenizer == "char":
        chars = sorted({c for messages in GOOD for m in messages for c in m["content"]})
        assert meta["tokenizer"] == {"type": "char", "chars": chars}
        base = len(chars)

        def encode(text):
            return [chars.index(c) for c in text]
    else:
        base = 50257
        encode = tiktoken.get_encoding("r50k_base").encode_ordinary
    special = {"system": base, "user": base + 1, "assistant": base + 2, "end_of_turn": base + 3}
    assert meta["kind"] == "chat" and meta["chat"] == {"template": "builtin"} and meta["vocab_size"] == base + 4
    assert all(meta["special_tokens"][name] == i for name, i in special.items())
    assert meta["exact_answers"] is False and meta["left_out"] == {}
    # each conversation once, in one split or the other; both splits hold some
    assert sorted(stored(folder)) == sorted(builtin(m, encode, special) for m in GOOD)
    assert all(meta["conversations"].values()) and sum(meta["conversations"].values()) == len(GOOD)


def test_loss_mask_by_hand(tmp_path):
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "bc"},
    ]
    # others of the same characters, so that train and val both get some
    others = [[{"role": "user", "content": "a" * k}, {"role": "assistant", "content": "b" * k}] for k in range(1, 20)]
    source = jsonl(tmp_path / "x.jsonl", [messages, *others])
    folder = prepare("chat", data_dir=tmp_path, input=str(source), tokenizer="char", val_fraction=0.5)
    # characters a b c s are ids 0-3; <system> 4, <user> 5, <assistant> 6, <end_of_turn> 7
    ids = [4, 3, 7, 5, 0, 1, 7, 6, 2, 7, 5, 0, 7, 6, 1, 2, 7]
    mask = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    (split, row) = next(
        (split, i)
        for split in ("train", "val")
        for i, (stored_ids, _) in enumerate(load_conversations(folder, split))
        if stored_ids.tolist() == ids
    )
    conversations = load_conversations(folder, split)
    assert conversations[row][1].tolist() == mask
    # the batch: inputs ids[:-1], targets ids[1:] where the next id is learned
    inputs, targets = chat_batch(conversations, [row])
    expected = [i if m else IGNORE_INDEX for i, m in zip(ids[1:], mask[1:])]
    assert inputs.tolist() == [ids[:-1]] and targets.tolist() == [expected]
    # exact match asks for the last reply after everything before it, up to <assistant>
    prompt, reply = final_reply(*conversations[row])
    assert prompt.tolist() == ids[:14] and reply.tolist() == [1, 2, 7]


BAD_LINES = [
    ("{not json", "not valid JSON"),
    (b"\xff\xfe", "not UTF-8 text"),
    ('{"text": "hi"}', 'not an object with a "messages" list'),
    ('{"messages": []}', "an empty conversation"),
    ('{"messages": [{"role": "user", "content": "Hi"}]}', "no assistant message"),
    (
        '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}, '
        '{"role": "user", "content": "?"}]}',
        "the last message is the user's, not the assistant's",
    ),
    ('{"messages": [{"role": "bot", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}', "has role 'bot'"),
    (
        '{"messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "x"}, '
        '{"role": "assistant", "content": "Yo"}]}',
        "is a system message",
    ),
    ('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": 3}]}', "'content' strings"),
    (
        json.dumps({"messages": [{"role": "user", "content": " x" * 40}, {"role": "assistant", "content": "ok"}]}),
        "too long",
    ),
]


def test_bad_lines_are_counted_by_reason_and_reported(tmp_path, caplog):
    good = GOOD * 2  # more good lines than bad ones: the file is kept
    source = jsonl(tmp_path / "mixed.jsonl", good, [line for line, _ in BAD_LINES] + [""])
    with caplog.at_level(logging.WARNING, logger="nanoformer.data"):
        folder = prepare(
            "chat", data_dir=tmp_path, input=str(source), tokenizer="gpt2", block_size=32, val_fraction=0.3
        )
    left_out = load_meta(folder)["left_out"]
    assert sum(left_out.values()) == len(BAD_LINES) and len(left_out) == len(BAD_LINES)
    for (_, reason), counted in zip(BAD_LINES, left_out):
        assert reason in counted
    assert "too long for block_size=32" in left_out
    (record,) = caplog.records
    line = record.getMessage()
    assert "\n" not in line and line.startswith(f"kept {len(good)} of {len(good) + len(BAD_LINES)} conversations; ")
    # where the first of a reason was: the line after the good ones (a blank line is no conversation)
    assert f"(first: {source} line {len(good) + 1})" in line
    assert len(stored(folder)) == len(good)


def test_a_file_of_mostly_bad_lines_is_refused_whole(tmp_path, capsys):
    source = jsonl(tmp_path / "notes.jsonl", GOOD[:2], ['{"prompt": "a", "completion": "b"}'] * 3)
    status = prepare_data.cli(["chat", f"--input={source}", f"--data_dir={tmp_path / 'data'}", "--tokenizer=char"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1
    assert f"{source}: 3 of 5 conversations cannot be used" in err and 'not an object with a "messages" list' in err
    # nothing written, not even a staging folder
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())


def test_chat_options_on_the_command_line(tmp_path, capsys):
    inputs = tmp_path / "in"
    inputs.mkdir()
    source = jsonl(inputs / "a.jsonl", GOOD)
    argv = ["chat", f"--input={inputs}", f"--data_dir={tmp_path / 'data'}", "--name=mine", "--val_fraction=0.3"]
    assert prepare_data.cli([*argv, "--exact_answers=true"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path / 'data' / 'mine'}: train ") and "conversations" in out
    meta = load_meta(tmp_path / "data" / "mine")
    assert meta["exact_answers"] is True and meta["source"]["exact_answers"] is True
    assert prepare_data.cli([*argv, "--exact_answers=maybe"]) == 2
    assert "--exact_answers takes true or false (or 1, 0), got 'maybe'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="exact_answers must be boolean"):
        prepare("chat", data_dir=tmp_path, input=str(source), exact_answers="maybe")
    # a folder holding other files: one line naming the file
    (inputs / "notes.txt").write_text("hello")
    assert prepare_data.cli([*argv, "--force"]) == 2
    message = (
        f"{inputs / 'notes.txt'}: chat input files must be .jsonl, .json, .parquet, .arrow; leave it out of --input"
    )
    assert capsys.readouterr().err == f"prepare_data.py: error: {message}\n"


def test_chat_from_parquet_through_datasets(tmp_path, caplog):
    import pyarrow as pa  # datasets' own dependency
    import pyarrow.parquet as pq

    bot = [{"role": "bot", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    table = pa.table({"messages": [*GOOD, bot], "id": list(range(len(GOOD) + 1))})
    pq.write_table(table, tmp_path / "talk.parquet")
    with caplog.at_level(logging.WARNING, logger="nanoformer.data"):
        folder = prepare("chat", data_dir=tmp_path, input=str(tmp_path / "talk.parquet"), val_fraction=0.3)
    encode = tiktoken.get_encoding("r50k_base").encode_ordinary
    special = {"system": 50257, "user": 50258, "assistant": 50259, "end_of_turn": 50260}
    assert sorted(stored(folder)) == sorted(builtin(m, encode, special) for m in GOOD)
    assert f"(first: {tmp_path / 'talk.parquet'} row {len(GOOD) + 1})" in caplog.records[0].getMessage()


def test_a_dataset_folder_lends_its_characters(tmp_path, shakespeare_char_dir):
    conversations = [
        [{"role": "user", "content": f"Who? {i}"}, {"role": "assistant", "content": "ROMEO."}] for i in "3"
    ]
    conversations += [
        [{"role": "user", "content": "Who?" * k}, {"role": "assistant", "content": "ROMEO."}] for k in range(9)
    ]
    conversations.append([{"role": "user", "content": "Café?"}, {"role": "assistant", "content": "No."}])
    source = jsonl(tmp_path / "a.jsonl", conversations)
    folder = prepare(
        "chat", data_dir=tmp_path, input=str(source), tokenizer=str(shakespeare_char_dir), val_fraction=0.4
    )
    meta, base = load_meta(folder), load_meta(shakespeare_char_dir)
    # the dataset's 65 characters, the four chat tokens after them: its models fine-tune on these ids
    assert meta["tokenizer"] == base["tokenizer"] and meta["vocab_size"] == base["vocab_size"] + 4
    assert meta["left_out"] == {"characters outside the 65-character vocabulary": 1}
    # its meta.json named instead of its folder: the same data
    again = prepare(
        "chat",
        data_dir=tmp_path,
        input=str(source),
        tokenizer=str(shakespeare_char_dir / "meta.json"),
        val_fraction=0.4,
        name="by_meta",
    )
    assert all((again / f).read_bytes() == (folder / f).read_bytes() for f in meta["files"])


def test_a_model_folders_own_template_and_exact_match_split(tmp_path):
    import tokenizers
    import transformers

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(["Say one two three four five six seven eight nine. Hello Hi"], trainer)
    model = tmp_path / "model"
    model.mkdir()
    bpe.save(str(model / "tokenizer.json"))
    # ChatML, with a newline after each <|im_end|>
    template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "eos_token": "<|im_end|>"}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    source = jsonl(tmp_path / "a.jsonl", GOOD)
    folder = prepare("chat", data_dir=tmp_path, input=str(source), tokenizer=str(model), val_fraction=0.3)
    meta = load_meta(folder)
    assert meta["chat"]["template"] == template and meta["vocab_size"] == 280
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(model)
    im_end = reference.convert_tokens_to_ids("<|im_end|>")

    def apply(messages, prompt=False):
        return reference.apply_chat_template(messages, add_generation_prompt=prompt, return_dict=True)["input_ids"]

    # stored: transformers' ids up to the last <|im_end|>, the newline after it, which nothing learns, left out
    expected = sorted(apply(messages)[:-1] for messages in GOOD)
    assert apply(GOOD[0])[-2:] == [im_end, reference.convert_tokens_to_ids("Ċ")]
    assert sorted(ids for ids, _ in stored(folder)) == expected
    for ids, targets in load_conversations(folder, "val"):
        prompt, reply = final_reply(ids, targets)
        (messages,) = [m for m in GOOD if apply(m)[:-1] == ids.tolist()]
        # the exact-match question: the conversation before the last reply, asking for it; the answer and its end
        assert prompt.tolist() == apply(messages[:-1], prompt=True)
        assert reply.tolist() == reference.encode(messages[-1]["content"], add_special_tokens=False) + [im_end]
    # up to date: kept; another template in the same folder: prepared again
    stamp = (folder / "meta.json").stat().st_mtime_ns
    assert prepare("chat", data_dir=tmp_path, input=str(source), tokenizer=str(model), val_fraction=0.3) == folder
    assert (folder / "meta.json").stat().st_mtime_ns == stamp
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template.replace("\\n", " ")}))
    prepare("chat", data_dir=tmp_path, input=str(source), tokenizer=str(model), val_fraction=0.3)
    assert load_meta(folder)["chat"]["template"] == template.replace("\\n", " ")


# ----------------------------------------------------------------------------- batches


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A chat dataset of conversations of many lengths, characters, 90% train."""
    root = tmp_path_factory.mktemp("chat")
    conversations = [
        [{"role": "user", "content": "q" * (1 + i % 7)}, {"role": "assistant", "content": "a" * (1 + i % 11)}]
        + ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "b" * (i % 5)}] if i % 3 == 0 else [])
        for i in range(400)
    ]
    return prepare("chat", data_dir=root, input=str(jsonl(root / "c.jsonl", conversations)), tokenizer="char")


def test_chat_batches_match_an_explicit_loop(chat_dir):
    meta = load_meta(chat_dir)
    task = make_task("auto", "gpt", meta)
    assert isinstance(task, Chat) and task.varying and task.pad_id is None
    assert task.model_vocab == meta["vocab_size"]
    split = task.load_split(chat_dir, "train", 64)
    conversations = split.conversations
    lengths = np.diff(conversations.index)
    for seed in range(5):
        (inputs,), targets = task.batch(split, 8, 64, torch.Generator().manual_seed(seed))
        rows = chat_rows(split, 8, torch.Generator().manual_seed(seed))
        # neighbours in length order: at most one step back, where the order wraps around
        assert sum(np.diff(lengths[rows]) < 0) <= 1
        T = max(lengths[rows]) - 1
        expected_inputs, expected_targets = [], []
        for row in rows:
            ids, flags = (a.tolist() for a in conversations[int(row)])
            pad = T - (len(ids) - 1)
            expected_inputs.append(ids[:-1] + [0] * pad)
            expected_targets.append(
                [i if f else IGNORE_INDEX for i, f in zip(ids[1:], flags[1:])] + [IGNORE_INDEX] * pad
            )
        assert inputs.tolist() == expected_inputs and targets.tolist() == expected_targets
        assert task.count_tokens((inputs,), targets) == sum(lengths[rows] - 1)


def test_a_micro_batch_depends_on_its_seed_only(chat_dir):
    meta = load_meta(chat_dir)
    task = make_task("auto", "gpt", meta)
    split = task.load_split(chat_dir, "train", 64)

    def batch(seed):
        return task.batch(split, 4, 64, torch.Generator().manual_seed(seed))

    first = batch(7)
    others = [batch(seed) for seed in range(20)]  # draws in between change nothing
    again = batch(7)
    assert torch.equal(first[0][0], again[0][0]) and torch.equal(first[1], again[1])
    # and other seeds draw other conversations
    assert len({tuple(inputs.flatten().tolist()) for (inputs,), _ in others}) > 10


def test_padding_fraction_counts_every_start(chat_dir):
    meta = load_meta(chat_dir)
    task = make_task("auto", "gpt", meta)
    split = task.load_split(chat_dir, "val", 64)
    n, B = len(split.order), 6
    padding = positions = 0
    for start in range(n):
        rows = [split.order[(start + i) % n] for i in range(B)]
        inputs, targets = chat_batch(split.conversations, rows)
        positions += inputs.numel()
        padding += inputs.numel() - task.count_tokens((inputs,), targets)
    assert padding_fraction(split, B) == pytest.approx(padding / positions)


def test_chat_data_fits_block_size_or_says_so(chat_dir, capsys):
    meta = load_meta(chat_dir)
    lengths = np.diff(load_conversations(chat_dir, "train").index)
    block = int(np.median(lengths))
    task = make_task("auto", "gpt", meta)
    split = task.load_split(chat_dir, "train", block)
    assert sorted(split.order.tolist()) == np.flatnonzero(lengths <= block + 1).tolist()
    assert "do not fit block_size" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="fits block_size=2"):
        task.load_split(chat_dir, "train", 2)
    for arch in ("encoder", "encoder_decoder"):
        with pytest.raises(ConfigError, match="only arch=gpt"):
            make_task("auto", arch, meta)
    # a task that trains on other data names the one that fits
    with pytest.raises(
        ConfigError, match=r"task=lm trains on lm data, and .* is chat data: use --task=chat \(or auto\)"
    ):
        make_task("lm", "gpt", meta)


# ----------------------------------------------------------------------------- the Shakespeare quiz

NUMBERS = {
    w: i
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen nineteen".split()
    )
} | {w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), 2)}


def number(words):
    """An English number up to 999, parsed independently of synthetic.number_words: 'one hundred forty-four'."""
    total = 0
    for word in words.replace("-", " ").split():
        total = total * 100 if word == "hundred" else total + NUMBERS[word]
    return total


def messages_of(text):
    """The (role, content) messages of a decoded built-in conversation."""
    return re.findall(r"<(system|user|assistant)>(.*?)<end_of_turn>", text, flags=re.S)


def check_answer(question, answer, lines, where, previous):
    """
    Recompute the answer to one quiz question from the text's lines (where: line -> its indices); previous: the
    last answer, which a follow-up asks about.
    """
    if question == "And the next?":
        assert answer in {lines[i + 1] for i in where[previous]}
        return
    kind, _, line = question.partition(": ")
    if not line:
        a, op, b = re.fullmatch(r"What is (.+) (plus|minus|times) (.+)\?", question).groups()
        a, b = number(a), number(b)
        assert number(answer) == {"plus": a + b, "minus": a - b, "times": a * b}[op]
        return
    # the quiz asks about lines that occur once, so each has one speaker and one next line
    (i,) = where[line]
    if kind == "Who says":
        # the speech's first line names its speaker: the line after the blank line before it
        start = max((k for k in range(i) if lines[k] == ""), default=-1) + 1
        assert lines[start] == f"{answer}:"
    elif kind == "Next line":
        assert lines[i + 1] == answer
    elif kind == "Words in":
        assert number(answer) == len(line.split())
    else:
        assert kind == "Last word"
        assert answer == re.sub(r"[^A-Za-z']+$", "", line.split()[-1])


@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
def test_shakespeare_chat_is_deterministic_held_out_and_right(tmp_path, shakespeare_path, tokenizer):
    text = shakespeare_path.read_text(encoding="utf-8")
    options = {"num_train": 400, "num_val": 150, "tokenizer": tokenizer}
    folder = prepare("shakespeare_chat", data_dir=tmp_path / "a", **options)
    again = prepare("shakespeare_chat", data_dir=tmp_path / "b", **options)
    assert folder.name == ("shakespeare_chat" if tokenizer == "char" else "shakespeare_chat_gpt2")
    for name in ("train.bin", "train_targets.bin", "train_idx.npy", "val.bin", "val_targets.bin", "val_idx.npy"):
        assert (folder / name).read_bytes() == (again / name).read_bytes()
    meta = load_meta(folder)
    assert meta["exact_answers"] is True and meta["conversations"] == {"train": 400, "val": 150}
    if tokenizer == "char":
        # shakespeare_char's vocabulary, then the chat tokens
        assert meta["tokenizer"] == {"type": "char", "chars": sorted(set(text))} and meta["vocab_size"] == 69
    decode = Tokenizer.from_meta(meta).decode
    lines, where = text.split("\n"), {}
    for i, line in enumerate(lines):
        where.setdefault(line, []).append(i)
    questions = {}
    for split in ("train", "val"):
        questions[split] = set()
        for ids, targets in load_conversations(folder, split):
            # every conversation fits the quick-start model's 64 positions (inputs and targets of 64)
            assert len(ids) <= 65
            messages = messages_of(decode(ids))
            assert decode(ids) == "".join(f"<{role}>{content}<end_of_turn>" for role, content in messages)
            previous = None
            turns = [(r, c) for r, c in messages if r != "system"]
            for (role, question), (answer_role, answer) in zip(turns[::2], turns[1::2]):
                assert (role, answer_role) == ("user", "assistant")
                check_answer(question, answer, lines, where, previous)
                questions[split].add(question)
                previous = answer
            # the final reply is what exact match compares
            assert decode(final_reply(ids, targets)[1]) == f"{turns[-1][1]}<end_of_turn>"
    # val asks nothing train asks (the follow-up's words are the same, its line is not)
    assert questions["val"] & questions["train"] <= {"And the next?"}


def test_compile_tries_the_graph_that_conversations_of_any_length_reuse(chat_dir):
    """compile's trial on the task's example batch builds one dynamic graph: real batches, shorter, compile nothing."""
    task = make_task("auto", "gpt", load_meta(chat_dir))
    split = task.load_split(chat_dir, "train", 64)
    model = build_model(ModelConfig(vocab_size=task.model_vocab, block_size=64, n_layer=1, n_head=2, n_embd=16))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", dynamic=None)  # as runtime.parallelize compiles varying batches
    task.loss(compiled, *task.to_device(*task.example_batch(4, 64), torch.device("cpu"))).backward()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            batch = task.batch(split, 4, 64, torch.Generator().manual_seed(seed))
            assert batch[1].size(1) < 64  # shorter than the trial's
            task.loss(compiled, *task.to_device(*batch, torch.device("cpu"))).backward()


def test_resuming_a_character_model_on_chat_data_is_one_line_and_rewrites_nothing(data_root, tmp_path, capsys):
    """Chat data's tokens lie beyond a character model's ids: a resume cannot grow them, and says what can."""
    out = tmp_path / "run"
    train.main(tiny(data_root, out, max_iters=4))
    chat_root = tmp_path / "chat"
    prepare("shakespeare_chat", data_dir=chat_root, num_train=40, num_val=20)
    config = (out / "config.json").read_bytes()
    capsys.readouterr()
    args = ["--init_from=resume", f"--out_dir={out}", "--dataset=shakespeare_chat", f"--data_dir={chat_root}"]
    assert train.cli([*args, "--max_iters=8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot grow" in err and f"--init_from={out / 'ckpt.pt'}" in err, err
    assert (out / "config.json").read_bytes() == config
