"""The synthetic seq2seq tasks: what a source looks like, how one is drawn, and its one right answer.

reverse and sort take a string of digits and lowercase letters; num2words takes a whole number written in
digits and answers in English words (1234 -> one thousand two hundred thirty-four). solve() gives the answer:
prepare_data.py writes drawn sources and their answers as datasets, sample.py grades a model's output with it.
"""

import string

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
    """One source of `task` drawn with `rng` (a random.Random), within the dataset options `opts`.

    opts holds max_number for num2words, min_len and max_len (string lengths) for reverse and sort.
    """
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
