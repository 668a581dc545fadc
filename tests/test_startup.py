"""Start-up work done once: the q8 layout cached in a file and mapped afterwards, measured pass costs remembered."""
import json

import pytest
import torch
from test_runtime import gguf_pair  # noqa: F401

from specdec import kernels
from specdec.runtime import measured, q8cache
from specdec.runtime.load import load_gguf

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="CPU kernels unavailable")
IDS = [5, 17, 33, 8, 61, 2, 40, 12, 90, 3, 77]


@needs_kernel
def test_q8_layout_is_built_once_then_mapped_and_gives_the_same_bits(gguf_pair, tmp_path, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    path = gguf_pair[0]
    monkeypatch.setenv("SPECDEC_Q8_CACHE", "0")
    memory = load_gguf(path)
    memory.set_numerics("q8")
    assert memory.q8_layout == "memory" and not (tmp_path / "q8").exists()
    monkeypatch.delenv("SPECDEC_Q8_CACHE")

    built = load_gguf(path)
    built.set_numerics("q8")
    assert built.q8_layout == "built"
    assert "preparing the q8 layout of tiny.gguf" in capsys.readouterr().err
    mapped = load_gguf(path)
    mapped.set_numerics("q8")
    assert mapped.q8_layout == "mapped"
    assert capsys.readouterr().err == ""  # nothing to prepare the second time

    cache = next((tmp_path / "q8").glob("*.q8"))
    assert cache.name.startswith(mapped.fingerprint[:24]) and kernels.library().key in cache.name
    for w in q8cache.q8_weights(mapped):  # each layout a view of the cache file, equal to a fresh repack
        if w.packed() is not None:
            assert torch.equal(w.packed(), kernels.repack(w.fmt, w.data, w.n, w.k))
    assert any(w.packed() is not None for w in q8cache.q8_weights(mapped))

    outs = []
    for model in (memory, built, mapped):
        slot = model.acquire_slot()
        outs.append(model.forward(IDS, [slot] * len(IDS), list(range(len(IDS)))))
        step = model.acquire_slot()  # row-invariant on the mapped layout too: rows equal one-token steps
        steps = torch.cat([model.forward([t], [step], [i]) for i, t in enumerate(IDS)])
        assert torch.equal(steps, outs[-1])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_kernel
def test_a_cache_that_does_not_describe_the_model_is_rebuilt(gguf_pair, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    model = load_gguf(gguf_pair[0])
    model.set_numerics("q8")
    cache = next((tmp_path / "q8").glob("*.q8"))
    reference = cache.read_bytes()
    with open(cache, "r+b") as f:  # truncated: the wrong size
        f.truncate(len(reference) // 2)
    again = load_gguf(gguf_pair[0])
    again.set_numerics("q8")
    assert again.q8_layout == "built" and cache.read_bytes() == reference

    index = cache.with_suffix(".json")
    meta = json.loads(index.read_text())
    meta["tensors"][0]["n"] += 16  # an index for other tensors
    index.write_text(json.dumps(meta))
    third = load_gguf(gguf_pair[0])
    third.set_numerics("q8")
    assert third.q8_layout == "built"
    index.write_text("{not json")
    fourth = load_gguf(gguf_pair[0])
    fourth.set_numerics("q8")
    assert fourth.q8_layout == "built"


@needs_kernel
def test_an_unwritable_cache_repacks_in_memory_with_one_line(gguf_pair, tmp_path, monkeypatch, capsys):  # noqa: F811
    blocker = tmp_path / "file"
    blocker.write_text("")  # the cache root is a file: nothing can be created under it
    monkeypatch.setenv("SPECDEC_CACHE", str(blocker))
    model = load_gguf(gguf_pair[0])
    model.set_numerics("q8")
    assert model.q8_layout == "memory"
    err = capsys.readouterr().err
    assert "cannot write the q8 cache" in err and "Traceback" not in err
    slot = model.acquire_slot()
    assert model.forward(IDS[:3], [slot] * 3, [0, 1, 2]).isfinite().all()


def test_file_hash_is_remembered_by_identity_and_follows_the_content(tmp_path, monkeypatch):
    from specdec.cachedir import file_sha256
    import hashlib
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(1000))
    assert file_sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest()
    assert len(list((tmp_path / "cache" / "file-hashes").iterdir())) == 1
    f.write_bytes(b"GGUF" + bytes(999) + b"x")  # new content, new identity (size or mtime): hashed again
    assert file_sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest()


class _Model:
    def __init__(self, fingerprint, numerics="q8"):
        self.fingerprint, self.numerics = fingerprint, numerics


def test_measurements_are_taken_once_per_file_machine_and_numerics(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    calls = []

    def measure():
        calls.append(1)
        return {1: 10.0 + len(calls), 4: 12.5}
    a = _Model("a" * 64)
    first = measured.remembered_curve(a, "pass_curve", {"sizes": [1, 4]}, measure)
    assert first == {1: 11.0, 4: 12.5} and len(calls) == 1
    assert measured.remembered_curve(a, "pass_curve", {"sizes": [1, 4]}, measure) == first and len(calls) == 1
    measured.remembered_curve(_Model("a" * 64, "exact"), "pass_curve", {"sizes": [1, 4]}, measure)
    measured.remembered_curve(_Model("b" * 64), "pass_curve", {"sizes": [1, 4]}, measure)
    measured.remembered_curve(a, "pass_curve", {"sizes": [1, 8]}, measure)
    assert len(calls) == 4  # another numerics, file or parameter set is measured
    monkeypatch.setenv("SPECDEC_REMEASURE", "1")
    assert measured.remembered_curve(a, "pass_curve", {"sizes": [1, 4]}, measure) == {1: 15.0, 4: 12.5}
    monkeypatch.delenv("SPECDEC_REMEASURE")
    assert measured.remembered_curve(a, "pass_curve", {"sizes": [1, 4]}, measure) == {1: 15.0, 4: 12.5}
    for f in (tmp_path / "measured").iterdir():
        f.write_text("garbage")  # a damaged file is measured again, not an error
    measured.remembered_curve(a, "pass_curve", {"sizes": [1, 4]}, measure)
    assert len(calls) == 6
    measured.remembered(_Model(None), "row_cost", {}, lambda: calls.append(1))
    measured.remembered(_Model(None), "row_cost", {}, lambda: calls.append(1))
    assert len(calls) == 8  # not one file: never stored


@needs_kernel
def test_building_a_layout_drops_the_same_files_layouts_from_older_kernel_builds(gguf_pair, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    model = load_gguf(gguf_pair[0])
    isa = kernels.library().isa
    q8 = tmp_path / "q8"
    q8.mkdir()
    fp = model.fingerprint[:24]
    stale = [q8 / f"{fp}-rows-{isa}-0000000000000000.q8", q8 / f"{fp}-rows-{isa}-0000000000000000.json"]
    kept = [q8 / f"{'f' * 24}-rows-{isa}-0000000000000000.q8", q8 / f"{fp}-rows-other-0000000000000000.q8"]
    for f in stale + kept:
        f.write_bytes(b"old")
    model.set_numerics("q8")
    assert model.q8_layout == "built"
    assert not any(f.exists() for f in stale) and all(f.exists() for f in kept)


def test_a_servers_refined_pass_curve_is_stored_for_the_next_start(tiny_dirs, tmp_path, monkeypatch):
    """A curve measured at a slow moment is not kept for good: the passes a server runs refine it (sizes it ran
    REFINED_AFTER passes of), and at shutdown the refinement replaces what is stored; the next start reads it."""
    from test_server import LiveServer, two_completions

    from specdec import models
    from specdec.api import SpecDecoder
    from specdec.batch import calibration
    from specdec.server import create_app
    from specdec.server.app import batch_engine

    curve = calibration.OnlineCurve({1: 30.0, 2: 31.0, 4: 40.0})
    for _ in range(calibration.REFINED_AFTER):
        curve.observe(1, 10.0)
    refined = curve.refined()
    assert refined[1] < 11.0 and refined[2] == 31.0 and refined[4] == 40.0  # 2 and 4 rows: too few passes seen
    curve.observe(2, 5.0)
    assert curve.refined()[2] == 31.0  # (no size stored above a larger size timed here: a time is only ever too high)
    assert list(calibration.OnlineCurve({1: 9.0, 2: 5.0}).refined().values()) == [5, 5]

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "REFINED_AFTER", 3)
    model, tok = models.load(tiny_dirs["target"], backend="runtime")
    model._fingerprint = "f" * 64  # as if one file: its measurements are stored
    slow = {}

    def stored():  # what the next start reads (nothing is measured: a measurement here would fail the test)
        return measured.remembered_curve(model, "pass_curve", slow["params"], lambda: pytest.fail("measured"))
    real_measure = calibration.measure_pass_curve

    def measure_slowly(m, sizes, context, check=False, step=None):  # the start-up measurement at a slow moment: everything 50 ms more
        slow["params"] = {"sizes": sorted(sizes), "context": context}
        return {n: ms + 50.0 for n, ms in real_measure(m, sizes, context=context).items()}
    monkeypatch.setattr("specdec.batch.measure_pass_curve", measure_slowly)
    srv = LiveServer(create_app(SpecDecoder.from_models(model, tok, "ngram", tau=3), model_name="tiny"))
    try:
        before = stored()
        assert min(before.values()) > 50.0
        two_completions(srv.url)
    finally:
        srv.stop()
    after = stored()
    assert after.keys() == before.keys() and after[1] < 50.0  # one-row passes as they ran, not as measured
    assert all(after[n] <= after[m] for n, m in zip(sorted(after), sorted(after)[1:]))
    assert batch_engine(SpecDecoder.from_models(model, tok, "none"), None, 32).pass_ms(1) == after[1]


@needs_kernel
def test_a_damaged_cache_is_rebuilt_with_one_line_never_used(gguf_pair, tmp_path, monkeypatch, capsys):  # noqa: F811
    """A layout file of the right size with a few flipped bytes (a disk error): its checksum fails at mapping, it is
    rebuilt with one stderr line, and the model computes what it computed before (before: it talked garbage at
    every start until the file was deleted by hand)."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    model = load_gguf(gguf_pair[0])
    model.set_numerics("q8")
    slot = model.acquire_slot()
    want = model.forward(IDS, [slot] * len(IDS), list(range(len(IDS))))
    cache = next((tmp_path / "q8").glob("*.q8"))
    reference = cache.read_bytes()
    spans = json.loads(cache.with_suffix(".json").read_text())["spans"]
    at, size = next(s for s in spans if s[1])
    with open(cache, "r+b") as f:  # a few bytes inside the first layout flipped, the size unchanged
        f.seek(at + size // 2)
        f.write(bytes(b ^ 0xFF for b in reference[at + size // 2: at + size // 2 + 8]))
    capsys.readouterr()
    again = load_gguf(gguf_pair[0])
    again.set_numerics("q8")
    err = capsys.readouterr().err
    assert again.q8_layout == "built" and "is damaged" in err and "rebuilding" in err
    assert len([line for line in err.splitlines() if "fails its checksum" in line]) == 1
    assert cache.read_bytes() == reference
    slot = again.acquire_slot()
    assert torch.equal(again.forward(IDS, [slot] * len(IDS), list(range(len(IDS)))), want)
