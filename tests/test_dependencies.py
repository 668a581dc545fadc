"""The installed dependencies lie within pyproject.toml's ranges (.ci/deps tests the ranges' ends): an environment
installed before a range moved fails here, with the package named, instead of somewhere deep in another test."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)

ROOT = Path(__file__).resolve().parent.parent


def test_installed_versions_are_within_the_declared_ranges():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["server"]
            + project["optional-dependencies"]["test"] if not r.startswith("specdec[")]
    outside = []
    for req in reqs:
        try:
            have = version(req.name)
        except PackageNotFoundError:
            outside.append(f"{req.name}: not installed")
            continue
        if not req.specifier.contains(have, prereleases=True):
            outside.append(f"{req.name} {have} (wants {req.specifier})")
    assert outside == [], "reinstall: pip install -e '.[test]' -- " + "; ".join(outside)


def test_every_bounded_dependency_has_an_upper_bound():
    """The packages whose interfaces the code reaches into are capped at the newest version tested."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = {Requirement(r).name: Requirement(r) for group in [project["dependencies"],
                                                              *project["optional-dependencies"].values()]
            for r in group if not r.startswith("specdec[")}
    for name in ("transformers", "tokenizers", "huggingface_hub", "llguidance", "openai", "anthropic", "fastapi",
                 "ray", "gguf", "schemathesis"):
        assert any(s.operator in ("<=", "<") for s in reqs[name].specifier), name
