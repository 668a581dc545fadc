import sys
from pathlib import Path

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
