import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_extend.training.args import DataArgs, RecipeError
from rope_extend.training.data import Batches, pack, pose_position_ids, read_documents

EOS = 2


def test_pack_eos_keeps_positions_running_and_separates_documents():
    docs = [[10, 11, 12], [20, 21], [30, 31, 32, 33]]  # + EOS each: 4 + 3 + 5 = 12 tokens
    p = pack(docs, EOS, 5, "eos")
    assert p.input_ids.tolist() == [[10, 11, 12, EOS, 20], [21, EOS, 30, 31, 32]]  # tail of 2 dropped
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4]] * 2
    assert not p.restart


def test_pack_mask_restarts_positions_after_each_eos_and_at_window_start():
    p = pack([[10, 11, 12], [20, 21], [30, 31, 32, 33]], EOS, 6, "mask")
    assert p.input_ids.tolist() == [[10, 11, 12, EOS, 20, 21], [EOS, 30, 31, 32, 33, EOS]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1], [0, 0, 1, 2, 3, 4]]


def test_mask_mode_targets_do_not_cross_documents_and_have_no_attention_mask():
    p = pack([[10, 11, 12], [20, 21], [30, 31, 32, 33]], EOS, 6, "mask")
    b = Batches(p, seed=0, batch_size=1, accumulation=1, num_processes=1).get(0, 0, 0)
    row = p.input_ids.tolist().index(b["input_ids"][0].tolist())
    t = b["targets"][0].tolist()
    if row == 0:
        assert t == [11, 12, EOS, -100, 21, -100]
    else:
        assert t == [-100, 31, 32, 33, EOS, -100]
    assert "attention_mask" not in b


def test_too_little_text_for_one_window_is_an_error():
    with pytest.raises(RecipeError, match="max_seq_length"):
        pack([[1, 2, 3]], EOS, 100)


def _packed(n=10, T=8):
    ids = torch.arange(n * T).view(n, T)
    return pack([ids.flatten().tolist()[:-1]], n * T - 1, T)  # one long doc, EOS is the last id


def test_a_step_sees_the_same_sequences_however_it_is_split():
    p = _packed()
    one = Batches(p, seed=3, batch_size=1, accumulation=4, num_processes=1)
    two = Batches(p, seed=3, batch_size=2, accumulation=1, num_processes=2)
    for step in range(4):  # crosses an epoch boundary (10 windows, 4 per step)
        a = sorted(one.get(step, m, 0)["input_ids"][0, 0].item() for m in range(4))
        b = sorted(r.item() for rank in range(2) for r in two.get(step, 0, rank)["input_ids"][:, 0])
        assert a == b
    seen = [one.get(s, m, 0)["input_ids"][0, 0].item() for s in range(2) for m in range(4)] + [
        one.get(2, m, 0)["input_ids"][0, 0].item() for m in range(2)
    ]
    assert sorted(seen) == sorted(p.input_ids[:, 0].tolist())  # one epoch = every window once


def test_read_documents_names_missing_text_field(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"body": "hello there"}\n{"body": "more text"}\n')
    with pytest.raises(RecipeError, match=r"no column 'text'.*body"):
        read_documents(DataArgs(path=str(f)))
    assert read_documents(DataArgs(path=str(f), text_field="body")) == ["hello there", "more text"]


def test_read_documents_text_paragraphs_and_parquet(tmp_path):
    (tmp_path / "a.txt").write_text("first doc\nline two\n\nsecond doc\n")
    assert read_documents(DataArgs(path=str(tmp_path / "a.txt"), sample_by="paragraph")) == [
        "first doc\nline two",
        "second doc",
    ]
    assert read_documents(DataArgs(path=str(tmp_path / "a.txt"))) == ["first doc\nline two\n\nsecond doc"]
    import datasets

    datasets.Dataset.from_dict({"text": ["x y", "z"]}).to_parquet(str(tmp_path / "b.parquet"))
    assert read_documents(DataArgs(path=str(tmp_path / "b.parquet"))) == ["x y", "z"]
    with pytest.raises(RecipeError, match="data.path: .*missing.jsonl is not a local file"):
        read_documents(DataArgs(path=str(tmp_path / "missing.jsonl")))


def test_a_text_saved_with_windows_line_endings_is_the_same_documents(tmp_path):
    (tmp_path / "unix.txt").write_bytes(b"first doc\nline two\n\nsecond doc\n")
    (tmp_path / "windows.txt").write_bytes(b"first doc\r\nline two\r\n\r\nsecond doc\r\n")
    for sample_by in ("document", "paragraph", "line"):
        unix, windows = (
            read_documents(DataArgs(path=str(tmp_path / f), sample_by=sample_by)) for f in ("unix.txt", "windows.txt")
        )
        assert windows == unix and not any("\r" in t for t in windows)
    assert read_documents(DataArgs(path=str(tmp_path / "windows.txt"), sample_by="paragraph")) == [
        "first doc\nline two",
        "second doc",
    ]


def test_a_data_file_swapped_for_a_pipe_is_refused_naming_data_path(tmp_path, monkeypatch):
    """A recipe's ``data.path`` reads through the one reader (``documents``): a ``x.jsonl`` that passed the first
    check and is a named pipe when it would go to datasets is refused at once, naming what it is (before: datasets'
    "Unable to find" it), under the recipe's key."""
    import os
    from pathlib import Path

    from tests.blocking import within

    fifo = tmp_path / "x.jsonl"
    os.mkfifo(fifo)
    is_file = Path.is_file
    monkeypatch.setattr(Path, "is_file", lambda self: self == fifo or is_file(self))
    with pytest.raises(RecipeError, match=f"^data.path: {fifo} is a named pipe, not a regular file: give regular"):
        within(20, lambda: read_documents(DataArgs(path=str(fifo))), fifo)


# ------------------------------------------------------------------------------------------ PoSE
@settings(max_examples=200, deadline=None)
@given(window=st.integers(2, 64), extra=st.integers(0, 500), chunks=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_pose_positions_are_increasing_chunked_and_inside_the_target(window, extra, chunks, seed):
    chunks = min(chunks, window)
    target = window + extra
    pos = pose_position_ids(window, target, chunks, np.random.default_rng(seed)).numpy()
    assert pos.shape == (window,)
    assert pos.min() >= 0 and pos.max() <= target - 1
    steps = np.diff(pos)
    assert (steps >= 1).all()  # strictly increasing: causal order is kept
    assert (steps > 1).sum() <= chunks - 1  # contiguous inside chunks, at most one jump between chunks
    assert pos.max() - pos.min() + 1 - window <= extra  # total skip bounded by target - window


def test_pose_two_chunks_match_the_stated_distribution():
    """u_0 ~ U{0..J}; u_1 ~ U{u_0..J}; the cut uniform over 1..w-1. Checked against exact expectations."""
    w, target, n = 16, 16 + 9, 20000  # J = 9
    rng = np.random.default_rng(0)
    u0, u1, cut = [], [], []
    for _ in range(n):
        pos = pose_position_ids(w, target, 2, rng).numpy()
        jump = np.nonzero(np.diff(pos) > 1)[0]
        u0.append(pos[0])
        u1.append(pos[-1] - (w - 1))
        c = int(jump[0]) + 1 if len(jump) else None
        cut.append(c)
    u0, u1 = np.array(u0), np.array(u1)
    J = 9
    # u_0 uniform on 0..9: each value has probability 0.1 (5 sigma ~ 0.011 at n=20000)
    freq = np.bincount(u0, minlength=J + 1) / n
    assert np.abs(freq - 0.1).max() < 0.011
    # E[u_1] = E[(u_0 + J) / 2] = (4.5 + 9) / 2 = 6.75; P(u_1 = J) = mean over u_0 of 1/(J-u_0+1)
    assert abs(u1.mean() - 6.75) < 0.05
    p_top = np.mean([1 / (J - k + 1) for k in range(J + 1)])
    assert abs((u1 == J).mean() - p_top) < 0.015
    assert (u1 >= u0).all()
    # the cut, where observable (u_1 > u_0), is uniform on 1..15
    cuts = np.array([c for c, a, b in zip(cut, u0, u1, strict=True) if a < b])
    freq = np.bincount(cuts, minlength=w)[1:] / len(cuts)
    assert np.abs(freq - 1 / 15).max() < 0.012


def test_pose_batches_are_deterministic_per_sequence_and_keep_an_attention_mask():
    p = _packed(T=8)
    a = Batches(p, seed=1, batch_size=1, accumulation=2, num_processes=1, pose_target_length=64)
    b = Batches(p, seed=1, batch_size=1, accumulation=1, num_processes=2, pose_target_length=64)
    assert torch.equal(a.get(3, 1, 0)["position_ids"], b.get(3, 0, 1)["position_ids"])
    batch = a.get(0, 0, 0)
    assert batch["position_ids"].max() < 64 and batch["attention_mask"].all()
    jumped = [a.get(s, 0, 0)["position_ids"][0] for s in range(20)]
    assert sum(int(p.max()) > 7 for p in jumped) >= 15  # positions reach past the window (P(no skip) ~ 1/57)


def test_unpacked_documents_are_padded_and_masked_out_of_the_loss():
    from rope_extend.training.data import Batches, pad_documents

    packed = pad_documents([[5, 6, 7], [8] * 10, []], eos_token_id=2, pad_token_id=0, max_seq_length=6)
    assert packed.input_ids.tolist() == [[5, 6, 7, 2, 0, 0], [8] * 6]
    assert packed.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [1] * 6]
    batch = Batches(packed, seed=0, batch_size=2, accumulation=1, num_processes=1).get(0, 0, 0)
    rows = {
        tuple(r[:3]): (t, m)
        for r, t, m in zip(
            batch["input_ids"].tolist(), batch["targets"].tolist(), batch["attention_mask"].tolist(), strict=True
        )
    }
    targets, mask = rows[(5, 6, 7)]
    assert targets == [6, 7, 2, -100, -100, -100] and mask == [1, 1, 1, 1, 0, 0]
    assert rows[(8, 8, 8)][0] == [8, 8, 8, 8, 8, -100]


def _word_tokenizer():
    from rope_extend.training.data import train_bpe_tokenizer

    text = "The cat sat on the mat. A dog ran far away! Is it here? " * 40
    from rope_extend.evaluation.prompts import KEY_LINE, QUESTION, TASK

    return train_bpe_tokenizer([text, TASK, KEY_LINE, QUESTION], 300)


def test_passkey_windows_fill_the_window_end_with_the_answer_and_repeat_per_seed():
    from rope_extend.training.data import passkey_windows, with_passkey_windows

    tok = _word_tokenizer()
    texts = ["The cat sat on the mat. A dog ran far away! Is it here?", "Rain fell. The sun came out."]
    rows = passkey_windows(tok, texts, 4, 400, seed=3)
    assert len(rows) == 4 and all(len(r) == 400 for r in rows)
    for r in rows:
        text = tok.decode(r)
        key = int(text.split("The pass key is ")[1].split(".")[0])
        assert text.endswith(f"What is the pass key? The pass key is {key}.")
        assert text.count(str(key)) == 3  # twice in the key line, once as the answer
    assert rows == passkey_windows(tok, texts, 4, 400, seed=3)
    assert rows != passkey_windows(tok, texts, 4, 400, seed=4)
    packed = with_passkey_windows(pack([[5] * 800], EOS, 400), rows)
    assert packed.input_ids.shape == (6, 400) and packed.input_ids[2:].tolist() == rows
    assert packed.position_ids[5].tolist() == list(range(400))


def test_passkey_share_must_be_a_share():
    from rope_extend.training import load_args

    with pytest.raises(RecipeError, match=r"data.passkey_share: got 1.0; expected a share in \[0, 1\)"):
        load_args("tiny-cpu", ["data.passkey_share=1.0"])


def test_a_fetched_text_is_named_by_its_file(tmp_path, monkeypatch):
    from rope_extend import RopeExtendError, fetch

    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("first text")
    (folder / "b.txt").write_text("second text")
    monkeypatch.setattr(fetch, "fetch", lambda name, **kw: folder)
    assert read_documents(DataArgs(path=["canterbury/b.txt"])) == ["second text"]
    assert read_documents(DataArgs(path="canterbury")) == ["first text", "second text"]
    with pytest.raises(RopeExtendError, match="canterbury has no text 'c.txt'; it has a.txt, b.txt"):
        read_documents(DataArgs(path="canterbury/c.txt"))


def test_read_documents_without_a_path_is_a_recipe_error():
    # DataArgs built in Python skips the recipe's check: it used to fail with "'NoneType' object is not iterable"
    with pytest.raises(RecipeError, match=r"^data\.path: not given"):
        read_documents(DataArgs(path=None))


def test_build_model_without_name_or_config_is_a_recipe_error():
    from rope_extend.training.args import ModelArgs
    from rope_extend.training.model import build_model

    with pytest.raises(RecipeError, match="give name_or_path .* or config .*, got neither"):
        build_model(ModelArgs(), ["some text"], seed=0)
