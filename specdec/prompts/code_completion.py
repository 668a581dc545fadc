"""Code to complete, for distillation (`distill_code_completion.jsonl`): the kind of prompt the pair benchmark's
completion and fill-in workloads give (a function or class head with its docstring, a file's first lines with a
comment cut mid-word, in Python and six other languages), from code_chat's small tasks and the classes below. None
names what a held-out prompt names (HELD_OUT_WORDS: merging sorted lists, an LRU cache, a config loader, ...).
Answered at ANSWER_TOKENS, the pair benchmark's length.

    python -m specdec.prompts.code_completion >> specdec/prompts/distill_code_completion.jsonl   (lines already
    there are skipped)
"""
import json
import re
import sys

from . import HERE
from .code_chat import ANSWER_TOKENS, LANGUAGE_TASKS, TASKS, _split

# what the held-out completion, fill-in and edit prompts are about (the shipped sets', the pair benchmark's)
HELD_OUT_WORDS = ("merge", "lru", "config", "linked list", "prime", "fibonacci", "binary search", "duplicate",
                  "settings", "log", "counter", "withdraw", "balance", "stack", "quicksort", "normalize",
                  "reverses the words", "counts the words")

CLASSES = """Queue: a first-in, first-out queue|MinHeap: a binary min-heap of comparable items|Trie: a prefix tree of
words|Graph: an undirected graph stored as adjacency lists|PriorityQueue: a queue that pops the item with the lowest
priority first|CircularBuffer: a fixed-size ring buffer that overwrites the oldest item|BloomFilter: a probabilistic
set membership filter|UnionFind: disjoint sets with path compression|Matrix: a small dense matrix of floats|Vector2D: a
two-dimensional vector with arithmetic operators|Fraction: an exact rational number|Timer: a context manager that
measures elapsed time|RateLimiter: a token-bucket rate limiter|EventEmitter: a publish-subscribe event
dispatcher|Inventory: the stock of items in a shop|ShoppingCart: items a customer intends to buy, with
prices|TodoList: a list of tasks that can be completed|Rectangle: an axis-aligned rectangle|Circle: a circle with a
center and a radius|Point: a point in the plane|Student: a student with grades per course|Library: a collection of
books that can be borrowed|Playlist: an ordered list of songs|Tokenizer: splits arithmetic expressions into
tokens|ConnectionPool: a pool of reusable database connections|RetryPolicy: how often and how long to retry a failed
call|TTLCache: a cache whose entries expire after a time to live|Interval: a closed interval of numbers|Money: an
amount in a currency|Histogram: counts of values in fixed-width bins|BitSet: a set of small integers stored as
bits|SparseVector: a vector that stores only its non-zero entries|Stopwatch: a stopwatch with laps|Polynomial: a
polynomial with integer coefficients|Temperature: a temperature that converts between scales|Deck: a deck of
playing cards|Board: a tic-tac-toe board|Employee: an employee with a salary and a manager|Order: a customer order
with line items|Scheduler: runs callbacks at given times|Router: maps URL paths to handler functions|KeyValueStore: a
dictionary persisted to a JSON file|Markdown: builds a Markdown document piece by piece|Maze: a grid maze that can
be solved"""

ARTICLES = {"a", "an", "the", "two", "all", "each"}
STOPS = {"in", "from", "with", "by", "into", "for", "up", "as", "that", "on", "and", "after", "at", "is", "are", "has"}
LANGUAGE_FORMS = ("C", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C++")
PY_IMPORTS = (("file", "from pathlib import Path"), ("director", "import os"), ("json", "import json"),
              ("csv", "import csv"), ("date", "from datetime import datetime"), ("regular", "import re"),
              ("random", "import random"), ("asyncio", "import asyncio"), ("url", "from urllib import parse"),
              ("sha", "import hashlib"), ("parallel", "from multiprocessing import Pool"), ("time", "import time"))
ARGS = (("two strings", "a, b"), ("two lists", "a, b"), ("two numbers", "a, b"), ("two vectors", "u, v"),
        ("two matrices", "a, b"), ("two files", "path_a, path_b"), ("two dictionaries", "a, b"),
        ("two functions", "f, g"), ("grid", "grid"), ("matrix", "matrix"), ("file", "path"), ("director", "root"),
        ("dict", "records"), ("date", "text"), ("url", "base, params"), ("string", "text"), ("text", "text"),
        ("sentence", "text"), ("password", "text"), ("list", "items"), ("array", "items"), ("stream", "stream"),
        ("tree", "root"), ("function", "func"), ("number", "n"), ("year", "year"), ("value", "value"))


def _base(verb: str) -> str:
    """A third-person verb's base form: counts -> count, compresses -> compress, multiplies -> multiply."""
    if verb.endswith("ies"):
        return verb[:-3] + "y"
    if verb.endswith(("sses", "shes", "ches", "xes")):
        return verb[:-2]
    return verb[:-1] if verb.endswith("s") else verb


def _words(phrase: str) -> list[str]:
    return [re.sub(r"[^a-z0-9]", "", w.lower().replace("-", "")) for w in phrase.split()]


def snake_name(task: str) -> str:
    """A function name for a task: 'checks whether a year is a leap year' -> is_leap_year, 'counts the vowels in a
    string' -> count_vowels, 'converts Celsius to Fahrenheit' -> convert_celsius_to_fahrenheit."""
    words = _words(task)
    if words[0] == "checks" and "whether" in words:
        tail = words[words.index("whether") + 1:]
        at = next((i for i, w in enumerate(tail) if w in ("is", "are", "has")), None)
        if at is not None:
            return "_".join([tail[at]] + [w for w in tail[at + 1:] if w not in ARTICLES][:4])
    name = [_base(words[0])]
    for w in words[1:]:
        if w in STOPS or len(name) == 5:
            break
        if w and w not in ARTICLES and w != "whether":
            name.append(w)
    while name[-1] in ("of", "to") and len(name) > 1:
        name.pop()
    return "_".join(name)


def camel_name(task: str, upper: bool = False) -> str:
    first, *rest = snake_name(task).split("_")
    out = first + "".join(w.capitalize() for w in rest)
    return out[0].upper() + out[1:] if upper else out


def args_for(task: str) -> str:
    low = task.lower()
    args = next((a for key, a in ARGS if key in low), "data")
    return args + (", k" if " k " in f" {low} " else ", n" if " n " in f" {low} " else "")


def doc(task: str) -> str:
    """The task as an imperative sentence: 'counts the vowels in a string' -> 'Count the vowels in a string.'"""
    verb, _, rest = task.partition(" ")
    return f"{_base(verb).capitalize()} {rest}."


def cut(text: str, at: float) -> str:
    """`text` cut inside a word about `at` of the way through (the held-out prompts stop mid-word)."""
    i = max(4, int(len(text) * at))
    while i < len(text) - 2 and text[i - 1] == " ":
        i += 1
    return text[:i]


def python_prompts(tasks: list[str]) -> list[str]:
    out = []
    for i, t in enumerate(tasks):
        head = f"def {snake_name(t)}({args_for(t)}):\n"
        out.append(f'{head}    """{doc(t)}"""\n')
        imports = next((imp for key, imp in PY_IMPORTS if key in t.lower()), ("import sys", "import math",
                                                                             "from typing import List")[i % 3])
        out.append(f'{imports}\n\n\n{head}    """{cut(doc(t) + " Return the result.", 0.6 + 0.1 * (i % 3))}')
    return out


def test_prompts(tasks: list[str]) -> list[str]:
    """pytest tests of a task's function, from their first line (the target writes the cases)."""
    return [f"import pytest\n\nfrom utils import {snake_name(t)}\n\n\ndef test_{snake_name(t)}" for t in tasks]


def class_prompts() -> list[str]:
    out = []
    for i, line in enumerate(_split(CLASSES)):
        name, what = (s.strip() for s in line.split(":", 1))
        head = f'class {name}:\n    """{what[0].upper() + what[1:]}."""\n\n    def __init__(self'
        out += [head + ",", head + "):\n"] if i % 2 else [head + "):\n", head + ","]
        out.append(f"from dataclasses import dataclass, field\n\n\n@dataclass\n{head.split('    def')[0]}")
    return out


def language_prompt(lang: str, task: str, i: int) -> str:
    d = doc(task)
    if lang == "C":
        return f"#include <stdio.h>\n#include <stdlib.h>\n#include <string.h>\n\n/* {cut(d, 0.5 + 0.1 * (i % 4))}"
    if lang == "C++":
        return f"#include <string>\n#include <vector>\n#include <algorithm>\n\n// {d}\n"
    if lang == "JavaScript":
        return f"// {d}\nfunction {camel_name(task)}("
    if lang == "TypeScript":
        return f"/**\n * {d}\n */\nexport function {camel_name(task)}("
    if lang == "Go":
        name = camel_name(task, True)
        return f'package main\n\nimport (\n\t"fmt"\n\t"strings"\n)\n\n// {name} {task}.\nfunc {name}('  # Go's doc form
    if lang == "Rust":
        return f"/// {d}\nfn {snake_name(task)}("
    return f"public class Utils {{\n    /**\n     * {d}\n     */\n    public static "


def completions() -> list[str]:
    """Every templated prompt, in a fixed order; none about what a held-out prompt is about."""
    tasks = [t for t in _split(TASKS) if not any(w in t.lower() for w in HELD_OUT_WORDS)]
    out = python_prompts(tasks) + class_prompts() + test_prompts(tasks)
    out += [language_prompt(LANGUAGE_FORMS[i % len(LANGUAGE_FORMS)], t, i) for i, t in enumerate(tasks)]
    out += [language_prompt(lang, t, i) for i, t in enumerate(_split(LANGUAGE_TASKS)) for lang in LANGUAGE_FORMS
            if not any(w in t.lower() for w in HELD_OUT_WORDS)]
    return [p for p in dict.fromkeys(out) if not any(w in p.lower() for w in HELD_OUT_WORDS)]


def main() -> None:
    path = HERE / "distill_code_completion.jsonl"
    have = {json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()} \
        if path.exists() else set()
    for p in completions():
        if p not in have:
            sys.stdout.write(json.dumps({"prompt": p, "mode": "completion", "max_new_tokens": ANSWER_TOKENS}) + "\n")


if __name__ == "__main__":
    main()
