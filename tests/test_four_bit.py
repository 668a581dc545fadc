"""A GGUF draft model runs as its 4-bit copy (runtime/four_bit.py): made once, only the wide matrices requantized,
the file's metadata kept, and the output still the target's own."""
import gguf
import numpy as np
import pytest
from test_runtime import gguf_pair  # noqa: F401

from specdec import models
from specdec.api import SpecDecoder
from specdec.drafters import registry
from specdec.errors import InvalidRequest
from specdec.runtime import four_bit
from specdec.runtime.load import load_gguf

T = gguf.GGMLQuantizationType


@pytest.fixture
def copies(tmp_path, monkeypatch):
    """The copies' folder, apart from the rest of the cache (the target's q8 layout and tokenizer stay shared)."""
    monkeypatch.setattr(four_bit, "cache_root", lambda: tmp_path / "cache")
    return tmp_path / "cache" / "drafts4"


def types(path) -> dict[str, T]:
    return {t.name: T(int(t.tensor_type)) for t in gguf.GGUFReader(path).tensors}


def test_the_copy_requantizes_only_the_wide_matrices_once(gguf_pair, copies, capsys):  # noqa: F811
    path = gguf_pair[0]
    copy = four_bit.four_bit_copy(path)
    assert copy.parent == copies and copy.name.startswith("tiny-") and copy.name.endswith(f"-v{four_bit.RECIPE}.gguf")
    assert "preparing a 4-bit copy of the draft tiny.gguf" in capsys.readouterr().err
    before, after = types(path), types(copy)
    assert before.keys() == after.keys()
    for name, t in before.items():
        matrix = name.endswith(("attn_v.weight", "attn_output.weight", "ffn_up.weight")) or name == "output.weight"
        # Q8_0, F16, BF16 and the Q8_0 head: 64 or 128 columns, so Q4_0; Q4_0/Q4_1, the norms and the embedding
        # (the file has its own head) as they were
        assert after[name] == (T.Q4_0 if matrix else t), name
    original, copied = gguf.GGUFReader(path), gguf.GGUFReader(copy)
    for name, field in original.fields.items():
        if not name.startswith("GGUF."):
            assert copied.fields[name].contents() == field.contents(), name
    for t in copied.tensors:  # the kept tensors' bytes are the file's
        if after[t.name] == before[t.name]:
            assert np.array_equal(np.asarray(t.data), np.asarray(original.get_tensor(list(before).index(t.name)).data))

    stamp = copy.stat().st_mtime_ns
    assert four_bit.four_bit_copy(path) == copy and copy.stat().st_mtime_ns == stamp  # made once
    assert capsys.readouterr().err == ""
    assert four_bit.four_bit_copy(copy) == copy  # nothing wide left: the file itself

    for t in copied.tensors:  # the requantized matrices hold the file's weights as 4 bits can
        if after[t.name] != before[t.name]:
            o = original.get_tensor(list(before).index(t.name))
            w = gguf.quants.dequantize(o.data, o.tensor_type)
            back = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
            assert 0 < np.abs(back - w).mean() / np.abs(w).mean() < 0.15, t.name
    model = load_gguf(copy)  # and the runtime runs the copy
    assert model.forward([5, 17, 33], [model.acquire_slot()] * 3, [0, 1, 2]).isfinite().all()


def test_a_gguf_draft_model_runs_as_its_copy_and_keep_runs_the_file(tmp_path, copies, monkeypatch, capsys):
    """The default model (Q4_1, a tied Q8_0 embedding as its head) drafting for itself from another path: its copy
    has a Q4_0 head; greedy output equals target-only with the copy, with `keep:` and when no copy can be made."""
    draft = tmp_path / "draft.gguf"
    draft.symlink_to(models.default_model_path())
    prompt = "Write a haiku about the sea."
    plain = SpecDecoder(draft="none").generate(prompt, max_new_tokens=24).token_ids
    sd = SpecDecoder(draft=str(draft))
    copy = next(copies.glob("draft-*.gguf"))
    assert sd.engine.drafter.lm.model.source == str(copy) and types(copy)["token_embd.weight"] == T.Q4_0
    assert sd.generate(prompt, max_new_tokens=24).token_ids == plain
    keep = SpecDecoder(draft=f"keep:{draft}")
    assert keep.engine.drafter.lm.model.source == str(draft) and keep.engine.drafter.name == f"keep:{draft}"
    assert keep.generate(prompt, max_new_tokens=24).token_ids == plain

    def unwritable(path):
        raise OSError("read-only cache")
    monkeypatch.setattr(four_bit, "four_bit_copy", unwritable)
    capsys.readouterr()
    fallback = SpecDecoder(draft=str(draft))
    assert fallback.engine.drafter.lm.model.source == str(draft)
    assert capsys.readouterr().err.strip().splitlines() == [
        "specdec: no 4-bit copy of the draft draft.gguf (read-only cache); it runs as its file is"]
    assert fallback.generate(prompt, max_new_tokens=24).token_ids == plain
    with pytest.raises(InvalidRequest, match="keep:FILE needs a draft model file"):
        registry.build("keep:", registry.Target(sd.model, sd.tokenizer))
