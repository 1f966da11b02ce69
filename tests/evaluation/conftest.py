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


def untimed(record: dict) -> dict:
    """A record without its times (``seconds``, ``cpu_seconds``), which differ between identical runs."""
    return {k: v for k, v in record.items() if k not in ("seconds", "cpu_seconds")}


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


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny Llama and its tokenizer saved in a folder (for the command line and suites)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path
