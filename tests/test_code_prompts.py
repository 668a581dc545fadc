"""The templated code to complete in the default distillation set (prompts/code_completion.py): what the pair
benchmark's completion and fill-in workloads give, about none of what its held-out prompts name."""
import json
import re
from pathlib import Path

import pytest

from specdec.distill.progress import DEFAULT_PROMPTS
from specdec.prompts import HERE, load_prompts
from specdec.prompts.code_chat import ANSWER_TOKENS
from specdec.prompts.code_completion import HELD_OUT_WORDS, completions, doc, snake_name

FILE = HERE / "distill_code_completion.jsonl"
NAMED = re.compile(r"\b(?:def|class|function|func|fn)\s+(\w+)")


def held_out() -> list[str]:
    pair = Path(__file__).parents[1] / "benchmarks" / "suite" / "pair_prompts.jsonl"
    rows = [json.loads(line) for line in pair.read_text().splitlines() if line.strip()]
    shipped = [p["prompt"] for f in sorted(HERE.glob("*.jsonl")) if not f.name.startswith("distill")
               for p in load_prompts(f)]
    return shipped + [r["prompt"] for r in rows] + [r.get("suffix", "") for r in rows]


def test_the_file_is_the_generators_output_last_in_the_default_set_at_the_pairs_length():
    rows = [json.loads(line) for line in FILE.read_text().splitlines() if line.strip()]
    assert [r["prompt"] for r in rows] == completions()
    assert {(r["mode"], r["max_new_tokens"]) for r in rows} == {("completion", ANSWER_TOKENS)}
    assert len(rows) > 500
    assert DEFAULT_PROMPTS[-1] == FILE  # a resumed distill keeps the answers to the sets before it


def test_no_prompt_names_or_is_about_what_a_held_out_prompt_names():
    held = held_out()
    names = {n.lower() for p in held for n in NAMED.findall(p)} - {"__init__"}
    assert {"merge_sorted", "lrucache", "is_prime", "load_config", "binary_search", "save_settings"} <= names
    ours = completions()
    assert not set(ours) & set(held)
    assert not names & {n.lower() for p in ours for n in NAMED.findall(p)}
    assert not [p for p in ours if any(w in p.lower() for w in HELD_OUT_WORDS)]


def test_the_python_heads_are_python_and_the_other_languages_are_all_there():
    ours = completions()
    whole = [p for p in ours if p.endswith(('"""\n', "):\n"))]
    for p in whole:  # a complete head (docstring closed, or `__init__(self):`) takes a body
        body = "        pass\n" if p.endswith("):\n") and "class " in p else "    pass\n"
        compile(p + body, "<prompt>", "exec")
    assert len(whole) > 100
    starts = {"#include <stdio.h>", "#include <string>", "// ", "/**", "package main", "/// ", "public class",
              "import pytest", "from dataclasses", "class "}
    assert all(any(p.startswith(s) for p in ours) for s in starts)


@pytest.mark.parametrize("task, name", [("counts the vowels in a string", "count_vowels"),
                                        ("checks whether a year is a leap year", "is_leap_year"),
                                        ("converts Celsius to Fahrenheit", "convert_celsius_to_fahrenheit"),
                                        ("compresses a string with run-length encoding", "compress_string"),
                                        ("multiplies two matrices", "multiply_matrices"),
                                        ("computes the median of a list", "compute_median_of_list")])
def test_a_task_becomes_a_function_name_and_an_imperative_docstring(task, name):
    assert snake_name(task) == name
    assert doc(task).split()[0] == name.split("_")[0].capitalize() or name.startswith("is_")
