"""The synthetic datasets, drawn rather than downloaded, each question with one right answer: the seq2seq puzzles
(what a source looks like, how one is drawn, its answer) and the Shakespeare quiz of the chat demo.

reverse and sort take a string of digits and lowercase letters; num2words takes a whole number written in digits and
answers in English words (1234 -> one thousand two hundred thirty-four); solve() gives the answer.
"""

import random
import string
from collections import Counter
from dataclasses import dataclass

SYMBOLS = string.digits + string.ascii_lowercase  # what reverse/sort strings are made of
# every character a source or an answer holds (num2words adds the space and the hyphen): one vocabulary for all tasks
CHARS = sorted(" -" + SYMBOLS)

ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen"
).split()
TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
SCALES = ("", " thousand", " million", " billion")
# 999,999,999,999: the largest number these scales can spell
MAX_NUMBER = 1000 ** len(SCALES) - 1


def below_thousand(n):
    """0..999 in words; 0 gives '', since a zero group is left out of a larger number."""
    hundreds, rest = divmod(n, 100)
    words = [f"{ONES[hundreds]} hundred"] if hundreds else []
    if rest >= 20:
        words.append(TENS[rest // 10] + (f"-{ONES[rest % 10]}" if rest % 10 else ""))
    elif rest:
        words.append(ONES[rest])
    return " ".join(words)


def number_words(n):
    """0..MAX_NUMBER in words: 1234 -> 'one thousand two hundred thirty-four'."""
    if n == 0:
        return "zero"
    groups = []
    # groups of three digits, lowest first; joined highest first below
    for scale in SCALES:
        n, group = divmod(n, 1000)
        if group:
            groups.append(below_thousand(group) + scale)
    return " ".join(reversed(groups))


def solve(task, src_text):
    """The correct target of a synthetic task for a source string (sample.py grades answers with it)."""
    if task == "reverse":
        return src_text[::-1]
    if task == "sort":
        return "".join(sorted(src_text))
    if task == "num2words":
        if not (src_text.isascii() and src_text.isdigit()) or int(src_text) > MAX_NUMBER:
            raise ValueError(
                f"num2words takes a whole number from 0 to {MAX_NUMBER:,} written in digits, got {src_text!r}"
            )
        return number_words(int(src_text))
    raise ValueError(f"unknown synthetic task {task!r}; choose one of: reverse, sort, num2words")


def random_source(task, rng, opts):
    """One source of `task` drawn with `rng` (a random.Random), within the dataset options `opts` (max_number for
    num2words, min_len and max_len for reverse and sort)."""
    if task == "num2words":
        # a uniform digit count first, so small numbers are not drowned out by six-digit ones
        digits = rng.randint(1, len(str(opts["max_number"])))
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return str(rng.randint(low, min(10**digits - 1, opts["max_number"])))
    # reverse and sort: a uniform length, then uniform symbols
    length = rng.randint(opts["min_len"], opts["max_len"])
    return "".join(rng.choices(SYMBOLS, k=length))


def distinct_sources(task, opts):
    """How many different sources random_source(task, rng, opts) can return."""
    if task == "num2words":
        return opts["max_number"] + 1
    return sum(len(SYMBOLS) ** k for k in range(opts["min_len"], opts["max_len"] + 1))


# ----------------------------------------------------------------------------- the Shakespeare quiz (chat demo)
#
# Conversations about tiny Shakespeare with one right answer each: who speaks a line, the line after it, how many
# words it has, its last word, and sums asked in words. prepare_data.py's shakespeare_chat writes them; a fine-tuned
# model's greedy replies are scored by exact match.

# the quick-start model's block_size (configs/shakespeare.py): every quiz conversation is at most QUIZ_BLOCK + 1
# characters, chat markers included, the inputs and targets of QUIZ_BLOCK positions
QUIZ_BLOCK = 64
QUIZ_TRAIN_SHARE = 0.9  # lines come from this first share of the text, shakespeare_char's train split
QUIZ_VAL_SHARE = 0.1  # the share of the lines and sums only val asks about
# how often each kind of question opens a conversation
QUIZ_KINDS = {"speaker": 0.15, "next_line": 0.15, "words": 0.2, "last_word": 0.2, "arithmetic": 0.3}
OPERATIONS = {"plus": 20, "minus": 20, "times": 12}  # the largest operand of each: answers stay within 400
FOLLOW_UP = "And the next?"
SYSTEM_PROMPT = "Answer in as few words as you can."


@dataclass(frozen=True)
class Line:
    """A line the quiz asks about: said once in the text, so it has one speaker and one next line."""

    text: str
    speaker: str
    next_line: str | None  # the next line of the same speech; None for a speech's last
    then: str | None  # the line after that, which FOLLOW_UP asks for


def speeches(text):
    """(speaker, lines, offset) of each speech of a text laid out as tiny Shakespeare is: 'NAME:', lines, a blank."""
    found, offset = [], 0
    for block in text.split("\n\n"):
        head, _, body = block.partition("\n")
        # a name alone on its line, then at least one line of speech
        if head.endswith(":") and body.strip():
            found.append((head[:-1], body.split("\n"), offset))
        offset += len(block) + 2
    return found


def last_word(line):
    """The last word of a line without the punctuation after it: 'hear me speak.' -> 'speak'."""
    return line.split()[-1].rstrip(".,;:!?-")


def quiz_lines(text, limit):
    """The Lines of the text's speeches that start before offset limit, said once and of two words or more."""
    speech_list = speeches(text)
    counts = Counter(line for _, lines, _ in speech_list for line in lines)
    found = []
    for speaker, lines, offset in speech_list:
        if offset >= limit:
            break
        # None past the speech's end
        after = [*lines[1:], None, None]
        for i, line in enumerate(lines):
            # a short line says too little to ask about; a last word with an apostrophe or a dash is no clean answer
            if counts[line] == 1 and len(line.split()) >= 2 and last_word(line).isalpha():
                found.append(Line(line, speaker, after[i], after[i + 1]))
    return found


def quiz_sums():
    """Every sum the quiz asks, as (a, operation, b): no negative answers."""
    return [
        (a, op, b)
        for op, top in OPERATIONS.items()
        for a in range(top + 1)
        for b in range(top + 1)
        if op != "minus" or b <= a
    ]


def quiz_question(kind, item):
    """(question, answer) of a kind of question about item: a Line, or a sum (a, operation, b)."""
    if kind == "arithmetic":
        a, op, b = item
        result = a + b if op == "plus" else a - b if op == "minus" else a * b
        return f"What is {number_words(a)} {op} {number_words(b)}?", number_words(result)
    if kind == "speaker":
        return f"Who says: {item.text}", item.speaker
    if kind == "next_line":
        return f"Next line: {item.text}", item.next_line
    if kind == "words":
        return f"Words in: {item.text}", number_words(len(item.text.split()))
    return f"Last word: {item.text}", last_word(item.text)


def fits(messages):
    """Whether messages fit QUIZ_BLOCK + 1 characters in the built-in chat template: texts, role and end markers."""
    return sum(len(m["content"]) + 2 for m in messages) <= QUIZ_BLOCK + 1


def exchange(question, answer):
    """A user's question and the assistant's answer, as messages."""
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def quiz_conversation(rng, pools):
    """
    One conversation drawn with rng from pools ({kind: [Line or sum]}): a question and its answer; then, within
    QUIZ_BLOCK + 1 characters, sometimes the line after that (next_line) or a second question, and sometimes a system
    prompt first.
    """
    kinds, weights = list(QUIZ_KINDS), list(QUIZ_KINDS.values())
    first_kind, second_kind = rng.choices(kinds, weights, k=2)
    first, second = rng.choice(pools[first_kind]), rng.choice(pools[second_kind])
    # every draw is made whether or not its part is used, so one conversation's length never shifts the next one's
    follow, another, system = rng.random() < 0.5, rng.random() < 0.2, rng.random() < 0.1
    messages = exchange(*quiz_question(first_kind, first))
    if follow and first_kind == "next_line" and first.then is not None:
        more = exchange(FOLLOW_UP, first.then)
    else:
        more = exchange(*quiz_question(second_kind, second)) if another else []
    if more and fits(messages + more):
        messages += more
    with_system = [{"role": "system", "content": SYSTEM_PROMPT}, *messages]
    return with_system if system and fits(with_system) else messages


def quiz_conversations(text, num_train, num_val, seed):
    """
    {"val": [...], "train": [...]}: num_val and num_train quiz conversations (lists of {"role", "content"}) about
    `text` (tiny Shakespeare), drawn from seed; no val question is ever a train question (QUIZ_VAL_SHARE).
    """
    lines = quiz_lines(text, int(len(text) * QUIZ_TRAIN_SHARE))
    if not lines:
        raise ValueError("the text holds no speeches laid out as tiny Shakespeare's ('NAME:', lines, a blank line)")
    rng = random.Random(seed)
    out, held = {}, {}
    for name, items in (("lines", lines), ("sums", quiz_sums())):
        # shuffled apart, in place, so that val asks about lines and sums in the proportions train does
        rng.shuffle(items)
        cut = round(len(items) * QUIZ_VAL_SHARE)
        held[name] = {"val": items[:cut], "train": items[cut:]}
    for split, n in (("val", num_val), ("train", num_train)):
        chosen = held["lines"][split]
        pools = {"speaker": chosen, "words": chosen, "last_word": chosen, "arithmetic": held["sums"][split]}
        pools["next_line"] = [line for line in chosen if line.next_line is not None]
        # only what fits the block as a first question: short lines, most of the sums
        pools = {kind: [x for x in pool if fits(exchange(*quiz_question(kind, x)))] for kind, pool in pools.items()}
        out[split] = [quiz_conversation(rng, pools) for _ in range(n)]
    return out
