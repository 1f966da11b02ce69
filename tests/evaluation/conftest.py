import pytest

from tests.tiny import tiny_model, tiny_tokenizer

WORDS = [
    "river",
    "stone",
    "window",
    "garden",
    "letter",
    "autumn",
    "signal",
    "harbor",
    "pencil",
    "meadow",
    "lantern",
    "copper",
    "violet",
    "engine",
    "candle",
    "forest",
    "mirror",
    "button",
    "planet",
    "ticket",
]


def make_text(n_sentences: int, seed: int = 0) -> str:
    """Deterministic English-like sentences (so the tiny BPE has periods to find boundaries at)."""
    import random

    rng = random.Random(seed)
    return " ".join(
        f"The {rng.choice(WORDS)} is near the {rng.choice(WORDS)} {rng.randint(0, 99)}." for _ in range(n_sentences)
    )


@pytest.fixture(scope="session")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def texts():
    return [make_text(120, seed=i) for i in range(3)]
