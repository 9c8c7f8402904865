"""
Conversations for chat fine-tuning: your own (chat; one per JSONL line, {"messages": [{"role", "content"}, ...]},
or parquet/JSON/arrow through `datasets`) and the Shakespeare quiz (shakespeare_chat), rendered by a chat template
(chat.py) into ids and loss targets. A conversation that cannot be used is counted by reason and left out, and the
count reported; a file that is mostly such lines is refused whole.
"""

import contextlib
import json
import re
import zlib
from pathlib import Path

from tqdm import tqdm

from chat import (
    SPECIAL_TOKENS_MAP,
    TEMPLATE_FILE,
    TOKENIZER_CONFIG,
    ChatFormat,
    conversation_problem,
    folder_chat,
    with_chat_tokens,
)
from log import one_line
from recipes.base import (
    INPUT_OPTION,
    Option,
    Recipe,
    boolean,
    char_vocab,
    count_option,
    expand_input,
    fraction_option,
    gpt2_vocab,
    input_fingerprint,
    input_option,
)
from recipes.hub import load_local_dataset
from recipes.shakespeare_char import SHAKESPEARE_INPUT, shakespeare_inputs
from synthetic import QUIZ_BLOCK, quiz_conversations
from tokens import CHAT_SPLITS, ConversationWriter, huggingface_tokenizer, load_meta, logger, tokenizer_json_file

CHAT_FORMATS = (".jsonl", ".json", ".parquet", ".arrow")  # .jsonl is read here, line by line; the rest by datasets
# what chat.folder_chat reads from a model folder besides its tokenizer.json (config.json: its eos ids)
TEMPLATE_FILES = (TEMPLATE_FILE, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, "config.json")


def chat_inputs(name, opts, root):
    """The conversation files --input names (required), and their fingerprint."""
    if not opts["input"]:
        raise ValueError(
            f'chat needs {INPUT_OPTION}: a JSONL file of {{"messages": [...]}} lines, a directory or a glob'
        )
    files = expand_input(opts["input"])
    # a model folder's template and special tokens are inputs too (its tokenizer.json is the option's own file): a
    # changed template must rebuild the data, as a changed tokenizer does
    folder = Path(opts["tokenizer"]).expanduser()
    # gpt2 and char are names, even where a folder so named exists; a path that is no folder holds no template files
    named = opts["tokenizer"] in ("gpt2", "char")
    template = [] if named else [folder / n for n in TEMPLATE_FILES if (folder / n).is_file()]
    return files, input_fingerprint(files + template)


def chat_tokenizer_file(value):
    """The file a chat --tokenizer path stands for: a dataset's meta.json (or its folder), else a tokenizer.json."""
    path = Path(value).expanduser()
    if path.name == "meta.json" and path.is_file():
        return path
    return path / "meta.json" if (path / "meta.json").is_file() else tokenizer_json_file(path)


def chat_meta(choice, files):
    """
    The kind, tokenizer, vocab_size, special_tokens and chat entries of chat data tokenized by --tokenizer=choice (see
    the option's help): a tokenizer without a chat template of its own gets the built-in one.
    """
    if choice == "gpt2":
        base = gpt2_vocab()
    elif choice == "char":
        chars = sorted(conversation_chars(files))
        if not chars:
            raise ValueError("the input holds no usable conversation to take characters from")
        base = char_vocab(chars)
    elif (file := chat_tokenizer_file(choice)).name == "meta.json":
        dataset = load_meta(file.parent)
        base = {key: dataset[key] for key in ("tokenizer", "vocab_size", "special_tokens", "chat") if key in dataset}
        if "chat" in base:
            return {"kind": "chat", **base}
    else:
        base = huggingface_tokenizer(choice)
        chat = folder_chat(choice) if Path(choice).expanduser().is_dir() else None
        if chat is not None:
            return {"kind": "chat", **base, "chat": chat}
    return with_chat_tokens({"kind": "lm", **base})


def build_chat(stage, name, opts, files, check_tokenizer):
    """Conversations from JSONL (or parquet, JSON, arrow) files, rendered by the tokenizer's chat template."""
    meta = chat_meta(opts["tokenizer"], files)
    check_tokenizer(meta["tokenizer"])
    chat_format = ChatFormat.from_meta(meta)
    spec = meta["tokenizer"]
    # characters outside a character vocabulary are a reason of their own, not a render error per character
    chars = set(spec["chars"]) if spec["type"] == "char" else None
    left_out = LeftOut()
    items = file_conversations(files, chat_format, opts["block_size"], opts["val_fraction"], chars, left_out)
    # the bar counts the conversations kept as they are written
    with tqdm(items, desc=f"tokenizing {name}", unit="conversation", unit_scale=True, disable=None) as bar:
        written = write_conversations(stage, bar, meta["vocab_size"])
    if left_out.reasons:
        logger.warning("%s", left_out.summary())
    return {
        **meta,
        "exact_answers": opts["exact_answers"],
        **written,
        "left_out": {reason: count for reason, (count, _) in left_out.reasons.items()},
    }


def shakespeare_chat_folder(opts):
    """shakespeare_chat with characters; shakespeare_chat_gpt2 with GPT-2 BPE."""
    return "shakespeare_chat" if opts["tokenizer"] == "char" else f"shakespeare_chat_{opts['tokenizer']}"


def build_shakespeare_chat(stage, name, opts, files, check_tokenizer):
    """The Shakespeare quiz (synthetic.py): conversations with exact answers, in the built-in chat template."""
    text = files[0].read_text(encoding="utf-8")
    # char: shakespeare_char's vocabulary exactly, so that its models fine-tune on these ids
    base = char_vocab(sorted(set(text))) if opts["tokenizer"] == "char" else gpt2_vocab()
    meta = with_chat_tokens({"kind": "lm", **base})
    check_tokenizer(meta["tokenizer"])
    chat_format = ChatFormat.from_meta(meta)
    drawn = quiz_conversations(text, opts["num_train"], opts["num_val"], opts["seed"])
    # every quiz conversation is usable and fits QUIZ_BLOCK by construction: encode_conversation raising is a bug
    items = (
        (split, *encode_conversation({"messages": messages}, chat_format, QUIZ_BLOCK))
        for split, conversations in drawn.items()
        for messages in conversations
    )
    return {**meta, "exact_answers": True, **write_conversations(stage, items, meta["vocab_size"])}


# ----------------------------------------------------------------------------- conversations


class BadConversation(ValueError):
    """A conversation that cannot be trained on; the message is the reason, as the report counts it."""


class LeftOut:
    """The conversations of some input kept, and those left out counted by reason, with where each reason first was."""

    def __init__(self):
        self.kept, self.reasons = 0, {}  # reason -> [count, where it was first met]

    def add(self, reason, where):
        self.reasons.setdefault(reason, [0, where])[0] += 1

    def merge(self, other):
        self.kept += other.kept
        for reason, (count, where) in other.reasons.items():
            self.reasons.setdefault(reason, [0, where])[0] += count

    def bad(self):
        return sum(count for count, _ in self.reasons.values())

    def describe(self):
        """'150 too long for block_size=256 (first: a.jsonl line 17), ...', the most frequent reasons first."""
        ranked = sorted(self.reasons.items(), key=lambda item: -item[1][0])
        # four reasons keep the report one readable line; the rest are summed
        parts = [f"{count:,} {reason} (first: {where})" for reason, (count, where) in ranked[:4]]
        rest = sum(count for _, (count, _) in ranked[4:])
        return ", ".join(parts + ([f"{rest:,} for {len(ranked) - 4} other reasons"] if rest else []))

    def summary(self):
        return f"kept {self.kept:,} of {self.kept + self.bad():,} conversations; {self.describe()}"


def chat_records(path):
    """(where, object or BadConversation) of each conversation of one input file."""
    suffix = path.suffix.lower()
    if suffix not in CHAT_FORMATS:
        raise ValueError(f"{path}: chat input files must be {', '.join(CHAT_FORMATS)}; leave it out of --input")
    return jsonl_records(path) if suffix == ".jsonl" else dataset_records(path)


def jsonl_records(path):
    """(where, object) of each non-blank line of a JSONL file; the object is BadConversation for a line that is not
    UTF-8 JSON."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path} line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield where, BadConversation("not UTF-8 text")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError:
                yield where, BadConversation("not valid JSON")


def dataset_records(path):
    """(where, row) of each row of a parquet, JSON or arrow file, read through `datasets` as the hub's files are."""
    try:
        for number, row in enumerate(load_local_dataset([path]), 1):
            yield f"{path} row {number}", row
    # datasets raises its own errors, pyarrow's or json's for a file it cannot read: all mean the same here
    except Exception as err:
        raise ValueError(f"{path} could not be read through datasets ({one_line(err)})") from None


def encode_conversation(obj, chat_format, block_size, chars=None):
    """
    (ids, targets) of a conversation as stored: rendered by chat_format and cut after its last loss target (what
    a template writes after the last end-of-turn, ChatML's newline, teaches nothing). chars: a character
    vocabulary the texts must keep to. BadConversation says why a conversation cannot be used.
    """
    if isinstance(obj, BadConversation):
        raise obj
    problem = conversation_problem(obj)
    if problem is not None:
        # counted by kind: 'message 3 has role ...' and 'message 5 has role ...' are one reason
        raise BadConversation(re.sub(r"\bmessage \d+", "a message", problem))
    if chars is not None and any(set(m["content"]) - chars for m in obj["messages"]):
        raise BadConversation(f"characters outside the {len(chars)}-character vocabulary")
    try:
        ids, targets = chat_format.render(obj["messages"])
    except ValueError as err:  # a template that refuses the conversation (roles must alternate, ...)
        raise BadConversation(one_line(err)) from None
    learned = [k for k, target in enumerate(targets) if target]
    # a target is predicted from the ids before it: the first id never is
    if not learned or learned[-1] == 0:
        raise BadConversation("no assistant token to learn")
    ids, targets = ids[: learned[-1] + 1], targets[: learned[-1] + 1]
    if len(ids) > block_size + 1:
        raise BadConversation(f"too long for block_size={block_size}")
    return ids, targets


def conversation_split(messages, val_fraction):
    """'val' or 'train' by a hash of the conversation: deterministic, and a repeated conversation never straddles."""
    text = json.dumps(messages, sort_keys=True, ensure_ascii=False)
    return "val" if zlib.crc32(text.encode("utf-8")) / 2**32 < val_fraction else "train"


def file_conversations(files, chat_format, block_size, val_fraction, chars, left_out):
    """
    (split, ids, targets) of the usable conversations of the files; the others are counted in left_out. A file
    where more than half are unusable raises ValueError: it is most likely not a conversation file.
    """
    for path in files:
        tally = LeftOut()
        for where, obj in chat_records(path):
            try:
                ids, targets = encode_conversation(obj, chat_format, block_size, chars)
            except BadConversation as err:
                tally.add(str(err), where)
                continue
            tally.kept += 1
            yield conversation_split(obj["messages"], val_fraction), ids, targets
        if 2 * tally.bad() > tally.kept + tally.bad():
            raise ValueError(
                f"{path}: {tally.bad():,} of {tally.kept + tally.bad():,} conversations cannot be used "
                f'({tally.describe()}); each line must be {{"messages": [{{"role": ..., "content": ...}}, ...]}} '
                "ending with the assistant's message"
            )
        left_out.merge(tally)


def conversation_chars(files):
    """The characters of every message of the files' usable conversations: a character vocabulary for them."""
    chars = set()
    for path in files:
        for _, obj in chat_records(path):
            if not isinstance(obj, BadConversation) and conversation_problem(obj) is None:
                chars.update(*(m["content"] for m in obj["messages"]))
    return chars


def write_conversations(stage, conversations, vocab_size):
    """Stream (split, ids, targets) into the chat files of train and val, both non-empty; returns meta's "files" and
    "conversations"."""
    with contextlib.ExitStack() as stack:
        writers = {s: ConversationWriter(stack, stage, s, vocab_size) for s in CHAT_SPLITS}
        for split, ids, targets in conversations:
            writers[split].add(ids, targets)
        counts = {s: w.finish() for s, w in writers.items()}
        # raised inside the stack, so no partial file is kept
        if not all(counts.values()):
            raise ValueError(f"a split came out empty ({counts}); give more conversations or a larger --val_fraction")
    files = {}
    for split, writer in writers.items():
        files |= {f"{split}.bin": writer.ids.count, f"{split}_targets.bin": writer.targets.count}
    return {"files": files, "conversations": counts}


RECIPES = {
    "chat": Recipe(
        'your own conversations: JSONL lines of {"messages": [{"role", "content"}, ...]} (or parquet/JSON '
        "through datasets), in a chat template, loss on the assistant's tokens",
        options=(
            input_option("a .jsonl file (or .parquet, .json, .arrow), a directory or a glob; required"),
            Option(
                "tokenizer",
                str,
                "gpt2",
                "gpt2: GPT-2 BPE; char: the conversations' characters; else a tokenizer.json, a Hugging Face "
                "model folder (its chat_template, if any) or a prepared dataset's folder or meta.json (its tokenizer, "
                "e.g. data/shakespeare_char); the built-in template where there is no other",
                choices=("gpt2", "char"),
                file=chat_tokenizer_file,
            ),
            count_option("block_size", 1024, "conversations longer than block_size + 1 tokens are left out (counted)"),
            fraction_option("val_fraction", 0.05, "held-out fraction of the conversations (by a hash of each)"),
            Option(
                "exact_answers",
                boolean,
                False,
                "true: each conversation's last reply is the one right answer, so evaluation scores exact matches",
            ),
            Option("name", str, "chat", "output folder name under data_dir", affects_output=False),
        ),
        inputs=chat_inputs,
        build=build_chat,
    ),
    "shakespeare_chat": Recipe(
        "a quiz on tiny Shakespeare, generated offline: who speaks a line, the next line, word counts, sums in "
        "words; exact answers (chat demo)",
        options=(
            SHAKESPEARE_INPUT,
            Option(
                "tokenizer",
                str,
                "char",
                "char: shakespeare_char's 65 characters (and the 4 chat markers), so its models fine-tune on it; "
                "gpt2: GPT-2 BPE, written to shakespeare_chat_gpt2",
                choices=("char", "gpt2"),
            ),
            count_option("num_train", 10000, "training conversations"),
            count_option("num_val", 500, "validation conversations (about lines and sums that train never asks)"),
            Option("seed", int, 0, "random seed; the same seed gives the same files"),
        ),
        inputs=shakespeare_inputs,
        build=build_shakespeare_chat,
        folder=shakespeare_chat_folder,
    ),
}
