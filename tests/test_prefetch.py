"""The one-row prefetch distance is chosen by timing, once per model file and machine, and changes no bit."""
import pytest
import torch

from specdec import kernels, models
from specdec.runtime import prefetch

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no q8 kernels on this machine")


@pytest.fixture
def lib():
    lib = kernels.library()
    before = lib.prefetch
    yield lib
    lib.set_prefetch(*before)


def test_the_fastest_distance_is_chosen_once_stored_and_set(tiny_dirs, tmp_path, monkeypatch, lib):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv("SPECDEC_Q8_AHEAD", raising=False)
    monkeypatch.setattr(prefetch, "_chosen", [])
    model, _ = models.load(tiny_dirs["target"], backend="runtime", numerics="q8")
    assert prefetch.choose(model) is None  # not one file: nothing to store a choice under
    model._fingerprint = "f" * 64
    timed = []
    monkeypatch.setattr(prefetch, "one_row_ms", lambda m, lib, step=None: timed.append(1) or {
        0: 30.0, 2048: 16.0, 4096: 15.0, 8192: 14.0, 16384: 15.0})
    assert prefetch.choose(model) == 8192 and lib.prefetch[0] == 8192 and timed == [1]
    assert prefetch.choose(model) is None  # once per process: the first model's choice holds for a draft
    monkeypatch.setattr(prefetch, "_chosen", [])
    lib.set_prefetch(0, 0, 0)
    assert prefetch.choose(model) == 8192 and timed == [1]  # the next start reads it, whatever was set
    monkeypatch.setattr(prefetch, "_chosen", [])
    monkeypatch.setenv("SPECDEC_Q8_AHEAD", "2048")
    assert prefetch.choose(model) is None  # the user's distance stands


def test_every_distance_gives_the_same_bits_and_is_timed(tiny_dirs, lib):
    model, _ = models.load(tiny_dirs["target"], backend="runtime", numerics="q8")
    slot = model.acquire_slot()
    outs = []
    for d in prefetch.CANDIDATES:
        lib.set_prefetch(d, d, d)
        outs.append(model.forward(list(range(1, 40)), [slot] * 39, list(range(39))))
        model.truncate(slot, 0)
    model.release_slot(slot)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    before = lib.prefetch
    ms = prefetch.one_row_ms(model, lib, reps=2)
    assert sorted(ms) == list(prefetch.CANDIDATES) and all(t > 0 for t in ms.values()) and lib.prefetch == before
