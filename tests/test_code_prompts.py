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


SOURCE = '''
def mean(xs):
    """Average of xs."""
    total = 0
    for x in xs:
        total += x
    n = len(xs)
    return total / n
'''


def test_fill_in_gaps_are_real_cuts_of_a_function_ending_and_starting_at_a_line(tmp_path):
    from specdec.prompts.code_fim import gaps
    lib = tmp_path / "lib"
    lib.mkdir()
    for i in range(8):
        (lib / f"m{i}.py").write_text(SOURCE.replace("mean", f"mean{i}"))
    out = gaps(seed=1, n=8, root=lib)
    assert out == gaps(seed=1, n=8, root=lib) and len(out) == 8
    for g in out:
        assert g["prompt"].endswith("\n") and g["suffix"].startswith("\n") and g["suffix"].strip()
        name = NAMED.findall(g["prompt"])[0]
        src = SOURCE.replace("mean", name[:4] + name[4:]).strip("\n").split("\n")
        before, after = g["prompt"].rstrip("\n").split("\n"), g["suffix"].strip("\n").split("\n")
        if after[0].startswith("def "):  # the whole body: the signature and docstring, then the next function
            assert before == src[:2] and len(after) == len(src)
        else:  # one to four lines of the body taken out, in order
            assert before == src[:len(before)] and after == src[len(src) - len(after):]
            assert 1 <= len(src) - len(before) - len(after) <= 4 and len(before) >= 2
    assert any(g["suffix"].lstrip("\n").startswith("def ") for g in out)


def test_the_shipped_fill_in_prompts_are_fim_lines_about_nothing_held_out():
    rows = load_prompts(HERE / "distill_code_fim.jsonl", fim=True)
    assert len(rows) == 400 and all(not r["chat"] and r["max_new_tokens"] == 64 for r in rows)
    assert all(r["prompt"].endswith("\n") and r["suffix"].startswith("\n") for r in rows)
    defined = re.compile(r"\b(?:def|class)\s+(\w+)")
    names = {n.lower() for p in held_out() for n in defined.findall(p)} - {"__init__"}
    assert {"add", "most_common", "is_prime", "binary_search"} <= names
    ours = [r["prompt"] + r["suffix"] for r in rows]
    assert not names & {n.lower() for p in ours for n in defined.findall(p)}
    assert not [p for p in ours if any(w in p.lower() for w in HELD_OUT_WORDS)]
