"""The suite's measured pass costs stay out of the user's cache (conftest._private_measurements): a server reads
what is stored there as its prior, and the suite times passes beside its own work."""
import os
from pathlib import Path

from specdec.cachedir import cache_root


def test_measurements_go_to_the_sessions_cache_and_the_rest_is_shared():
    user = Path(os.environ["SPECDEC_USER_CACHE"])
    assert cache_root() != user and not (cache_root() / "measured").is_symlink()
    for kind in ("kernels", "tokenizers", "q8"):
        assert (cache_root() / kind).resolve() == (user / kind).resolve()  # built once, for the user too


def test_a_stored_measurement_lands_in_the_session_only(tiny_dirs):
    from specdec.runtime import measured

    class Model:
        fingerprint, numerics = "suite-cache-test", "q8"
    before = set((Path(os.environ["SPECDEC_USER_CACHE"]) / "measured").glob("*"))
    assert measured.remembered(Model(), "suite_probe", {}, lambda: 1.5) == 1.5
    assert list((cache_root() / "measured").glob("suite_probe-*.json"))
    assert set((Path(os.environ["SPECDEC_USER_CACHE"]) / "measured").glob("*")) == before
