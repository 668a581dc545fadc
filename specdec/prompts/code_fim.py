"""Build `distill_code_fim.jsonl`: code to fill in, cut from Python's standard library (`python -m
specdec.prompts.code_fim`), for the feature draft of a target with fill-in-the-middle tokens.

An editor sends the code before the cursor and the code after it (llama-server's /infill, OpenAI's `suffix`), and
the model writes the gap. Each prompt is a function of the standard library with one to four lines of its body
taken out: the prefix ends with a whole line, the suffix starts with the newline before the next one, as an editor
cuts at the cursor. A quarter take the whole body after the docstring, with the next function as the suffix. The
target's own middle is the answer (at ANSWER_TOKENS); nothing a held-out prompt names (HELD_OUT_WORDS,
HELD_OUT_NAMES) is cut.
"""
from __future__ import annotations

import ast
import json
import random
import re
import sysconfig
from pathlib import Path

from . import HERE
from .code_completion import HELD_OUT_WORDS
from .stdlib import _sources

FILE = HERE / "distill_code_fim.jsonl"
# what the pair benchmark's fill-in and completion prompts define: no gap is cut from a function that defines one
HELD_OUT_NAMES = {"add", "most_common", "is_prime", "save_settings", "load_settings", "binary_search",
                  "merge_sorted", "load_config", "count_words"}
DEFINED = re.compile(r"\b(?:def|class)\s+(\w+)")
ANSWER_TOKENS = 64  # a gap of 1-4 lines, or a short body: the target ends it with its end-of-text token first
N_PROMPTS = 400


def _functions(root: Path):
    """(name, dedented source lines, index of the first body line after a docstring) of each function of 6 to 30
    lines with a body of at least 3 lines, no decorators, in the standard library under `root`."""
    for _, text, tree in _sources(root):
        lines = text.split("\n")
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.decorator_list or node.name.startswith("__"):
                continue
            body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(
                getattr(node.body[0], "value", None), ast.Constant) else node.body
            src = lines[node.lineno - 1: node.end_lineno]
            if not body or not 6 <= len(src) <= 30 or len(src) - (body[0].lineno - node.lineno) < 3:
                continue
            indent = len(src[0]) - len(src[0].lstrip())
            if any(line.strip() and len(line) - len(line.lstrip()) < indent for line in src):
                continue
            yield node.name, [line[indent:] for line in src], body[0].lineno - node.lineno


def gaps(seed: int = 0, n: int = N_PROMPTS, root: Path | None = None) -> list[dict]:
    """`n` fill-in prompts: {"prompt": prefix, "suffix": suffix} (see the module's docstring)."""
    rng = random.Random(seed)
    fns = [f for f in _functions(Path(root or sysconfig.get_paths()["stdlib"]))
           if not any(w in "\n".join(f[1]).lower() for w in HELD_OUT_WORDS)
           and not HELD_OUT_NAMES & set(DEFINED.findall("\n".join(f[1])))]
    rng.shuffle(fns)
    out = []
    for i, (name, src, first) in enumerate(fns):
        if len(out) >= n:
            break
        if i % 4 == 3:  # the whole body: the prefix is the signature and docstring, the next function follows
            after = fns[(i + 1) % len(fns)][1]
            prefix, suffix = "\n".join(src[:first]) + "\n", "\n\n\n" + "\n".join(after) + "\n"
        else:
            start = rng.randrange(first, len(src) - 1)  # at least one line of the body after the gap
            end = min(len(src) - 1, start + rng.randint(1, 4))
            if not any(line.strip() for line in src[start:end]):
                continue
            prefix, suffix = "\n".join(src[:start]) + "\n", "\n" + "\n".join(src[end:]) + "\n"
        out.append({"prompt": prefix, "suffix": suffix})
    return out


def main() -> None:
    rows = [{"prompt": g["prompt"], "suffix": g["suffix"], "mode": "fim", "max_new_tokens": ANSWER_TOKENS}
            for g in gaps()]
    FILE.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} fill-in prompts -> {FILE}")


if __name__ == "__main__":
    main()
