"""Build `distill_stdlib.jsonl`: distillation prompts cut from Python's standard library (no download needed).

The templated distill set has few code completions and few texts to summarise, while users (and the bench) ask
for exactly those. The standard library is a large body of real code and English prose on every machine:
- code completion: a function's signature and docstring (mode completion), the target writes the body;
- summarising: prose paragraphs of the language reference (pydoc_data.topics) and module docstrings;
- explaining: questions about public functions and modules.
The shipped file was built with CPython 3.11 (`python -m specdec.prompts.stdlib`); other versions give a
similar, not identical, set — the shipped file is what the recipe uses.
"""
from __future__ import annotations

import ast
import json
import random
import re
import sys
import sysconfig
from pathlib import Path

from . import HERE, SETS, load_prompts

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "site-packages", "dist-packages",
             "ensurepip", "pydoc_data", "__pycache__", "venv", "msilib"}
SUMMARY_ASKS = ["Summarise this text in two sentences:", "Summarise the following paragraph:",
                "Summarise this note for a busy reader:", "Summarize this text in one sentence:",
                "Give a short summary of the following:", "TL;DR of this passage:",
                "Explain the main point of this text in plain words:", "Summarise the key points as a short list:"]
EXPLAIN_ASKS = ["Explain what the Python function `{}` does, with a short example.",
                "How do I use `{}` in Python?", "What does `{}` return? Answer briefly.",
                "Write a Python example that uses `{}` and explain it."]
MODULE_ASKS = ["What is the `{}` module in Python's standard library for?",
               "Give me three tips for using Python's `{}` module."]


def _sources(root: Path):
    for path in sorted(root.rglob("*.py")):
        if not SKIP_DIRS & set(path.relative_to(root).parts[:-1]) and not path.name.startswith(("_", "test")):
            try:
                text = path.read_text(encoding="utf-8")
                yield path.relative_to(root), text, ast.parse(text)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue


def _completion(lines: list[str], fn: ast.FunctionDef) -> str | None:
    """The function's source up to the end of its docstring (what a user has typed when asking for the body)."""
    doc = fn.body[0] if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(
        getattr(fn.body[0], "value", None), ast.Constant) and isinstance(fn.body[0].value.value, str) else None
    if doc is None or len(fn.body) < 2 or fn.name.startswith("_") or fn.decorator_list:
        return None
    start = fn.lineno - 1
    head = "\n".join(lines[start:doc.end_lineno]) + "\n"
    indent = len(lines[start]) - len(lines[start].lstrip())
    head = "\n".join(line[indent:] for line in head.split("\n"))
    return head if 40 <= len(head) <= 500 else None


def _paragraphs(text: str):
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        letters = sum(c.isalpha() or c == " " for c in para)
        if 250 <= len(para) <= 1000 and letters > 0.85 * len(para) and para.count(". ") >= 2 and ">>>" not in para:
            yield para


def build(n_code: int = 550, n_summary: int = 400, n_explain: int = 250, seed: int = 0, root: Path | None = None,
          reference_topics: bool = True) -> list[dict]:
    """Prompts cut from the Python sources under `root` (default: this interpreter's standard library) and, with
    reference_topics, the language reference's prose; never one of the bench prompts."""
    rng = random.Random(seed)
    root = Path(root or sysconfig.get_paths()["stdlib"])
    code, explain, modules, prose = [], [], [], []
    for rel, text, tree in _sources(root):
        lines = text.split("\n")
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        if ast.get_docstring(tree):
            modules.append(module)
            prose += list(_paragraphs(ast.get_docstring(tree)))
        for node in tree.body:
            fns = [node] if isinstance(node, ast.FunctionDef) else [
                f for f in node.body if isinstance(f, ast.FunctionDef)] if isinstance(node, ast.ClassDef) else []
            for fn in fns:
                head = _completion(lines, fn)
                if head:
                    code.append(head)
                    if fn is node:
                        explain.append(f"{module}.{fn.name}")
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    prose += [p for key in sorted(topics) for p in _paragraphs(topics[key])] if reference_topics else []
    held_out = {p["prompt"] for name in SETS for p in load_prompts(HERE / f"{name}.jsonl")}
    out = [{"prompt": c, "mode": "completion"} for c in rng.sample(code, min(n_code, len(code)))]
    out += [{"prompt": f"{rng.choice(SUMMARY_ASKS)}\n\n{p}", "mode": "chat"}
            for p in rng.sample(sorted(set(prose)), min(n_summary, len(set(prose))))]
    picks = rng.sample(explain, min(n_explain, len(explain)))
    out += [{"prompt": rng.choice(EXPLAIN_ASKS).format(f), "mode": "chat"} for f in picks[: n_explain * 4 // 5]]
    out += [{"prompt": rng.choice(MODULE_ASKS).format(m), "mode": "chat"}
            for m in rng.sample(sorted(set(modules)), min(n_explain // 5, len(set(modules))))]
    out = [p for p in out if p["prompt"] not in held_out]  # the bench prompts stay held out
    rng.shuffle(out)
    return out


def corpus(tok, code_tokens: int, root: Path | None = None) -> list[str]:
    """Plain text for teacher forcing (`specdec distill --stdlib-text N`): whole modules of the standard library in a
    seeded order (300 to 20,000 tokens each) until they reach `code_tokens`, then the first third as many tokens of
    the language reference's prose (pydoc_data.topics). The target's argmax at every position is the label, so
    text nobody generated still teaches the draft what the target predicts from its features (as EAGLE trains on
    fixed conversations)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py")) if not SKIP_DIRS & set(p.relative_to(root).parts[:-1])
             and not p.name.startswith(("_", "test"))]
    random.Random(0).shuffle(files)
    code, n = [], 0
    for path in files:
        if n >= code_tokens:
            break
        text = path.read_text(errors="ignore")
        k = len(tok(text).input_ids)
        if 300 <= k <= 20000:
            code.append(text)
            n += k
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    prose = tok("\n\n".join(topics[k] for k in sorted(topics))).input_ids[: code_tokens // 3]
    return ["\n\n".join(code)] + ([tok.decode(prose)] if prose else [])


if __name__ == "__main__":
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "distill_stdlib.jsonl"
    prompts = build()
    dest.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(f"{len(prompts)} prompts -> {dest}")
