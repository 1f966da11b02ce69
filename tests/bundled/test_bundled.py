"""The bundled testbed: files and checksums, loading, the data generator, the pretraining recipe."""

import json
import re

import pytest
import torch

from rope_extend import bundled
from rope_extend.bundled.corpus import evaluation_documents
from rope_extend.bundled.mix import training_documents

needs_model = pytest.mark.skipif(not bundled.available(), reason="the bundled model is not built into this checkout")


@needs_model
def test_files_match_the_model_card_checksums():
    listed = bundled.card_checksums()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(listed)
    for name, digest in listed.items():
        assert bundled.sha256(bundled.MODEL_DIR / name) == digest, name
    total = sum(p.stat().st_size for p in bundled.MODEL_DIR.iterdir()) + bundled.EVAL_CORPUS.stat().st_size
    assert total < 20 * 2**20


@needs_model
def test_load_gives_the_model_at_its_trained_context():
    model, tokenizer = bundled.load()
    config = model.config
    assert config.max_position_embeddings == bundled.trained_length() == 256
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1600.0}
    assert not model.training and model.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = tokenizer("The pass key is 4821.", return_tensors="pt").input_ids
    assert tokenizer.convert_ids_to_tokens(ids[0, -5:-1].tolist()) == ["4", "8", "2", "1"]  # one digit per token
    with torch.no_grad():
        assert model(ids).logits.isfinite().all()


@needs_model
def test_the_shipped_model_retrieves_the_key_and_copies():
    """What the model card's numbers rest on, in small: passkey retrieval at the trained context with the
    protocol's filler and with prose it never saw, and a repeated list of random words predicted far better
    the second time (eval/benchmarks/testbed_quality.py and induction_probe.py measure them in full)."""
    import random

    import torch.nn.functional as F

    from rope_extend.evaluation import passkey

    model, tokenizer = bundled.load()
    L = bundled.trained_length()
    assert passkey(model, tokenizer, [L], trials=10, seed=7, progress=False).accuracy[L] >= 0.9
    assert (
        passkey(model, tokenizer, [L], trials=10, seed=7, progress=False, filler=bundled.unseen_filler()).accuracy[L]
        >= 0.6
    )
    words = [
        i
        for i in range(len(tokenizer))
        if tokenizer.decode([i])[1:].isalpha()
        and tokenizer.decode([i]).startswith(" ")
        and len(tokenizer.decode([i])) > 2
    ]
    seq = random.Random(0).choices(words, k=40)
    ids = torch.tensor([seq + seq])
    with torch.no_grad():
        nll = F.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:], reduction="none")
    assert nll[:39].mean() - nll[40:].mean() > 2.0  # nats per token


def test_generator_is_deterministic_under_a_seed():
    assert training_documents(7, 50) == training_documents(7, 50)
    assert training_documents(7, 50) != training_documents(8, 50)
    assert evaluation_documents(5, 2, 300) == evaluation_documents(5, 2, 300)


@needs_model
def test_shipped_eval_corpus_is_the_generators_and_long_enough():
    shipped = bundled.eval_texts()
    assert shipped == evaluation_documents()
    _, tokenizer = bundled.load()
    for text in shipped:
        assert len(tokenizer(text).input_ids) >= 16 * bundled.trained_length()


@needs_model
def test_passkey_training_examples_use_the_protocols_words_and_fit_the_window():
    from rope_extend.evaluation.prompts import FILLER, QUESTION, TASK

    _, tokenizer = bundled.load()
    docs = [d for d in training_documents(3, 400) if d.startswith(TASK)]
    assert len(docs) > 80
    fits = standard = 0
    for doc in docs:
        question, answer = doc.rsplit(QUESTION, 1)
        key = int(answer.strip().rstrip("."))
        assert f"The pass key is {key}. Remember it. {key} is the pass key." in question
        fits += len(tokenizer(doc).input_ids) < 256  # with the EOS, inside the window
        standard += any(s in doc for s in FILLER.split(". "))
    assert fits >= 0.97 * len(docs)
    assert 0.15 * len(docs) < standard < 0.4 * len(docs)  # one filler kind in four is the protocol's


def test_recall_examples_answer_from_the_facts():
    import random
    import re

    from rope_extend.bundled.corpus import recall_example

    for seed in range(20):
        doc = recall_example(random.Random(seed), 4, 10)
        facts = dict(re.findall(r"The code of ([A-Z]\w+ [A-Z]\w+) is (\d+)\.", doc.split("\n")[0]))
        asked = re.findall(r"What is the code of ([\w ]+)\? The code of \1 is (\d+)\.", doc.split("\n")[1])
        assert len(facts) == 4 and len(asked) == 3
        assert all(facts[name] == code for name, code in asked)


def test_unseen_filler_is_not_in_the_training_corpus():
    from rope_extend.bundled.corpus import NARRATIVE, RECALL

    filler = bundled.unseen_filler()
    text = " ".join(filler)
    assert len(filler) >= 50 and not any(ch.isdigit() for ch in text)
    corpus = "\n".join(training_documents(0, 3000))
    assert not any(sentence in corpus for sentence in filler)
    # and none of the templates' fixed words: e.g. "walked to the", "still lives on"
    for template in NARRATIVE + RECALL:
        for piece in re.split(r"\{\w+\}", template):
            if len(piece.strip()) > 12:
                assert piece.strip() not in text, piece


def test_pretraining_recipe_runs_from_scratch(tmp_path):
    from rope_extend.bundled.build import write_pretraining_data
    from rope_extend.training import load_args, train
    from rope_extend.training.cli import find_recipe

    data = write_pretraining_data(tmp_path / "data", documents=120)
    assert json.loads((data / "train.jsonl").read_text().splitlines()[0])["text"]
    args = load_args(
        find_recipe("bundled-pretrain"),
        [
            f"data.path={data / 'train.jsonl'}",
            f"model.tokenizer={data / 'tokenizer'}",
            f"output_dir={tmp_path / 'run'}",
            "max_steps=6",
            "per_device_train_batch_size=4",
            "warmup_steps=1",
            "save_steps=6",
            "logging_steps=1",
            "learning_rate=3e-3",
        ],
    )
    result = train(args)
    losses = [row["loss"] for row in result.history]
    assert len(losses) == 6 and losses[-1] < losses[0]
    saved = json.loads((result.final_dir / "config.json").read_text())
    assert saved["rope_parameters"]["rope_type"] == "default" and saved["max_position_embeddings"] == 256
    # and the run becomes a bundled model folder with its card (parameters counted from the weights)
    from rope_extend.bundled.export import COMMANDS, export

    folder = export(tmp_path / "run", tmp_path / "bundled", commands=COMMANDS, notes="notes\n")
    card = (folder / "README.md").read_text()
    assert "| parameters | 1,442,944 (tied" in card and "6 steps x" in card and "bundled-ruler" in card


@needs_model
def test_induction_probe_measures_the_shipped_model(tmp_path):
    """The diagnostic the model card cites runs and gives numbers in range (a smoke test of the script)."""
    import importlib.util
    import types
    from pathlib import Path

    path = Path(__file__).parents[2] / "eval" / "benchmarks" / "induction_probe.py"
    spec = importlib.util.spec_from_file_location("induction_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    args = types.SimpleNamespace(sequences=2, length=20, trials=4, seed=0)
    result = probe.probe("bundled", args)
    assert len(result["heads"]) == 4 and all(len(h["induction"]) == 4 for h in result["heads"])
    assert 0 <= result["max_induction"] <= 1 and 0 <= result["max_prev_token"] <= 1
    assert result["loss_first_copy"] > 1  # random words are surprising
    assert len(result["passkey_digit_accuracy"]) == 5
    assert all(0 <= a <= 1 for a in result["passkey_digit_accuracy"])
    run = probe.formation(types.SimpleNamespace(seed=0, lr=1e-3, batch=2, seq=40, vocab=50, train_steps=2, log_every=1))
    assert [row["step"] for row in run["log"]] == [1, 2] and run["formed_at"] is None


@needs_model
def test_the_documented_needle_examples_mean_what_the_docs_say():
    """docs/evaluation.md: its needle example (a pass key in the bundled haystack) retrieves at 2x L under yarn x4;
    a needle in words the testbed was never taught scores 0.0 even unpatched within L (issue 55)."""
    import rope_extend
    from rope_extend.evaluation import niah

    model, tokenizer = bundled.load()
    texts = bundled.eval_texts()
    words = dict(needle="The secret fruit is a mango.", question="What is the secret fruit?", answer="mango")
    assert set(
        niah(model, tokenizer, texts, [256], depths=[0.5], trials=1, progress=False, **words).accuracy.values()
    ) == {0.0}
    rope_extend.patch(model, "yarn", factor=4)
    needle = dict(needle="The pass key is 68103. Remember it. 68103 is the pass key.", answer="68103",
                  question="What is the pass key? The pass key is")  # fmt: skip
    assert niah(model, tokenizer, texts, [512], depths=[0.5], trials=1, progress=False, **needle).accuracy == {
        (512, 0.5): 1.0
    }
