import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("SPECDEC_CHECK_OWNER", "1")  # serving state touched off its owner's thread raises (runtime/owner.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHARED_KINDS = {"kernels", "tokenizers", "tokenizer-facts", "file-hashes", "gguf", "q8", "drafts", "drafts4", "vocab",
                "datastores", "recycle"}


def _private_measurements() -> None:
    """The suite's pass costs are timed beside its own work: they go to a cache of the session's own, never to the
    user's `measured/`, where a server would read them as its prior (a CI run once stored the default model's 64
    rows at 79 ms where a quiet pass takes 51). Everything else the cache holds (compiled kernels, tokenizers, q8
    layouts, drafts) is the user's, linked in, so nothing is built twice. Subprocesses inherit it; a test that sets
    SPECDEC_CACHE itself still gets its own."""
    real = Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))
    session = Path(tempfile.mkdtemp(prefix="specdec-tests-"))
    kinds = SHARED_KINDS | ({p.name for p in real.iterdir() if p.is_dir()} if real.is_dir() else set())
    for kind in sorted(kinds - {"measured"}):
        (real / kind).mkdir(parents=True, exist_ok=True)
        (session / kind).symlink_to(real / kind, target_is_directory=True)
    os.environ["SPECDEC_CACHE"] = str(session)
    os.environ["SPECDEC_USER_CACHE"] = str(real)  # (tests/test_suite_cache.py)
    atexit.register(shutil.rmtree, session, True)  # the links and the session's measurements; not what they link to


_private_measurements()

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import char_tokenizer, noisy_copy, tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tok():
    return char_tokenizer(chat=True)


@pytest.fixture(scope="session")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def draft_random():
    return tiny_llama(seed=1, layers=1, hidden=32)


@pytest.fixture(scope="session")
def draft_close(target):
    return noisy_copy(target, noise=0.03, seed=2)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, target, draft_close, draft_random):
    """Target and draft saved as HF model directories (fp32, so the CLI runs them on specdec's runtime, the production
    path), plus a draft with a different tokenizer."""
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, model, tk in [("target", target, char_tokenizer(chat=True)),
                            ("draft", draft_close, char_tokenizer(chat=True)),
                            ("random", draft_random, char_tokenizer(chat=True)),
                            ("alien", draft_close, char_tokenizer(chat=True, shift=7))]:
        model.float().save_pretrained(root / name)
        model.double()
        tk.save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


@pytest.fixture(scope="session")
def rt_sd(tiny_dirs):
    """The tiny target on specdec's runtime (the production path), n-gram drafts."""
    from specdec import SpecDecoder, models
    model, tok = models.load(tiny_dirs["target"], backend="runtime")
    return SpecDecoder.from_models(model, tok, draft="ngram", tau=3)


@pytest.fixture(scope="session")
def rt_live(rt_sd):
    """A live server (real HTTP) on rt_sd, named "tiny"."""
    from test_server import LiveServer

    from specdec.server import create_app
    srv = LiveServer(create_app(rt_sd, model_name="tiny"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def smol_live():
    """A live server on the default model (a byte-level vocabulary: what grammars and tools need), named "smol"."""
    from test_server import LiveServer

    from specdec import SpecDecoder
    from specdec.server import create_app
    srv = LiveServer(create_app(SpecDecoder(draft="ngram"), model_name="smol"))
    yield srv
    srv.stop()

