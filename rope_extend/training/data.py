"""Training data: read documents (the one reader), tokenize, pack into fixed-length windows; PoSE positions.

Packing: documents are tokenized, each followed by EOS, concatenated, and cut into windows of
``max_seq_length`` tokens (the tail that does not fill a window is dropped). ``document_boundaries``
decides what the model sees at a boundary (see ``DataArgs``): ``eos`` keeps positions running across
documents (full causal attention, as YaRN and LongLoRA trained on PG19); ``mask`` restarts positions at
each document, which makes transformers confine attention to each document.

Order: a global index ``i`` (the i-th sequence the run consumes) maps to window ``perm_e[i % n]`` where
``perm_e`` is a seeded permutation for epoch ``e = i // n``. Global step ``s`` consumes indices
``s*G .. (s+1)*G-1`` with ``G = batch * accumulation * processes``, laid out as
``[micro-batch][process][row]``: the set of sequences in a step does not depend on how it is split over
processes, so 1 process x 2 accumulation steps and 2 processes x 1 see the same data, and resuming at
step ``s`` needs nothing but ``s``. PoSE offsets are drawn from a generator seeded by ``(seed, i)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import documents
from ..errors import RopeExtendError
from .args import DataArgs, RecipeError


# ------------------------------------------------------------------------------------------ reading
def read_documents(args: DataArgs) -> list[str]:
    """The documents of ``data``, through the one reader (``rope_extend.documents``); errors name data.path."""
    if args.path is None:  # a recipe checks this; DataArgs built in Python may not have been
        raise RecipeError(
            "data.path: not given; name a text/JSONL/Parquet file, folder, glob, list of files or dataset"
        )
    try:
        return documents.read_documents(
            args.path,
            text_field=args.text_field,
            split=args.split,
            name=args.name,
            sample_by=args.sample_by,
            max_docs=args.max_docs,
        )
    except RecipeError:
        raise
    except RopeExtendError as exc:
        raise RecipeError(f"data.path: {exc}") from None


# ------------------------------------------------------------------------------------------ packing
@dataclass
class Packed:
    """Windows of token ids and, per window, the position ids under ``document_boundaries``."""

    input_ids: torch.Tensor  # [n, T] int64
    position_ids: torch.Tensor  # [n, T] int64
    restart: bool  # positions restart at documents (attention confined to them)
    attention_mask: torch.Tensor | None = None  # [n, T]; 0 on padding (unpacked documents only)


def pack(docs: list[list[int]], eos_token_id: int, max_seq_length: int, document_boundaries: str = "eos") -> Packed:
    stream: list[int] = []
    for doc in docs:
        stream += list(doc) + [eos_token_id]
    n = len(stream) // max_seq_length
    if n == 0:
        raise RecipeError(
            f"data: {len(stream)} tokens in all, fewer than one window of data.max_seq_length="
            f"{max_seq_length}; use more text or a shorter window"
        )
    ids = torch.tensor(stream[: n * max_seq_length], dtype=torch.long).view(n, max_seq_length)
    restart = document_boundaries == "mask"
    # With restarts, a window that starts mid-document counts from 0 too: each window is its own sequence.
    positions = _restart_positions(ids, eos_token_id) if restart else torch.arange(max_seq_length).expand(n, -1).clone()
    return Packed(ids, positions, restart)


def pad_documents(docs: list[list[int]], eos_token_id: int, pad_token_id: int, max_seq_length: int) -> Packed:
    """No packing: one document (plus EOS) per row, cut to ``max_seq_length`` and right-padded."""
    rows = [(list(ids) + [eos_token_id])[:max_seq_length] for ids in docs if len(ids) > 0]
    if not rows:
        raise RecipeError("data: no non-empty documents to train on")
    ids = torch.full((len(rows), max_seq_length), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    positions = torch.arange(max_seq_length).expand(len(rows), -1).clone()
    return Packed(ids, positions, restart=False, attention_mask=mask)


def _restart_positions(ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Positions that count from 0 at the window start and again after every EOS."""
    n, T = ids.shape
    after_eos = torch.zeros_like(ids, dtype=torch.bool)
    after_eos[:, 1:] = ids[:, :-1] == eos_token_id
    after_eos[:, 0] = True
    idx = torch.arange(T).expand(n, -1)
    start = torch.where(after_eos, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start


def with_passkey_windows(packed: Packed, rows: list[list[int]]) -> Packed:
    """``packed`` plus ``rows`` (each exactly one window long) as more windows, positions from 0."""
    if not rows:
        return packed
    extra = torch.tensor(rows, dtype=torch.long)
    n, width = extra.shape
    if width != packed.input_ids.shape[1]:
        raise ValueError(f"passkey windows of {width} tokens for windows of {packed.input_ids.shape[1]}")
    mask = None if packed.attention_mask is None else torch.cat([packed.attention_mask, torch.ones_like(extra)])
    return Packed(
        torch.cat([packed.input_ids, extra]),
        torch.cat([packed.position_ids, torch.arange(width).expand(n, -1)]),
        packed.restart,
        mask,
    )


def passkey_windows(tokenizer, texts: list[str], count: int, window: int, seed: int) -> list[list[int]]:
    """``count`` passkey examples of exactly ``window`` tokens: the evaluation protocol's prompt
    (``evaluation.prompts.passkey_prompt``: task line, haystack, key line, haystack, question) with the
    haystack read from a random sentence of a random training text, a key in 1..99999 at a uniform random
    depth, then the answer `` KEY.``. Same seed, same windows (so a resumed run sees what it saw)."""
    from ..evaluation.prompts import encode, passkey_prompt, split_sentences

    rng = np.random.default_rng([seed, 2])
    docs = [split_sentences(t) for t in texts if t.strip()]
    weights = np.array([len(d) for d in docs], dtype=float)
    weights /= weights.sum()
    rows = []
    for _ in range(count):
        key = int(rng.integers(1, 100000))
        answer = encode(tokenizer, f" {key}.")
        doc = docs[int(rng.choice(len(docs), p=weights))]
        depth, start = float(rng.random()), int(rng.integers(len(doc)))
        try:
            prompt = passkey_prompt(tokenizer, window - len(answer), key, depth, filler=doc, start=start)
        except RopeExtendError as exc:
            raise RecipeError(f"data.passkey_share: {exc}") from None
        rows.append(prompt.input_ids + answer)
    return rows


# ------------------------------------------------------------------------------------------ PoSE
def pose_position_ids(window: int, target_length: int, num_chunks: int, generator: np.random.Generator) -> torch.Tensor:
    """PoSE position ids for a window of ``window`` tokens that should see distances up to ``target_length``.

    Zhu et al. 2024, "PoSE: Efficient Context Window Extension of LLMs via Positional Skip-wise Training":
    the window is cut into ``num_chunks`` non-empty chunks at cut points drawn uniformly without
    replacement from ``1 .. window-1``; chunk ``k`` gets skip bias ``u_k`` with ``u_0 ~ U{0..J}`` and
    ``u_k ~ U{u_(k-1)..J}`` where ``J = target_length - window``; token ``t`` of chunk ``k`` gets position
    ``t + u_k``. Positions are strictly increasing, contiguous inside a chunk, and lie in
    ``[0, target_length)``; with ``num_chunks=2`` this is the paper's reference sampler.
    """
    if target_length < window:
        raise ValueError(f"pose target_length {target_length} is shorter than the window {window}")
    J = target_length - window
    cuts = (
        np.sort(generator.choice(np.arange(1, window), size=num_chunks - 1, replace=False))
        if num_chunks > 1
        else np.array([], dtype=np.int64)
    )
    biases, low = [], 0
    for _ in range(num_chunks):
        low = int(generator.integers(low, J + 1))
        biases.append(low)
    chunk = np.searchsorted(cuts, np.arange(window), side="right")  # chunk index of each token
    return torch.from_numpy(np.arange(window) + np.asarray(biases)[chunk]).long()


# ------------------------------------------------------------------------------------------ batches
class Batches:
    """Deterministic batches by (step, micro-batch, process); see the module docstring."""

    def __init__(
        self,
        packed: Packed,
        *,
        seed: int,
        batch_size: int,
        accumulation: int,
        num_processes: int,
        pose_target_length: int | None = None,
        pose_chunks: int = 2,
    ):
        self.packed = packed
        self.seed = seed
        self.B, self.G, self.P = batch_size, accumulation, num_processes
        self.pose_target_length = pose_target_length
        self.pose_chunks = pose_chunks
        self._perms: dict[int, np.ndarray] = {}

    @property
    def windows(self) -> int:
        return self.packed.input_ids.shape[0]

    def window(self, i: int) -> int:
        """The window the i-th consumed sequence of the run is."""
        epoch, j = divmod(i, self.windows)
        if epoch not in self._perms:
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
        return int(self._perms[epoch][j])

    def indices(self, step: int, micro: int, rank: int) -> list[int]:
        first = step * self.B * self.G * self.P + (micro * self.P + rank) * self.B
        return list(range(first, first + self.B))

    def get(self, step: int, micro: int, rank: int) -> dict[str, torch.Tensor]:
        """``input_ids``, ``position_ids``, ``targets`` (next token, -100 where none) and, unless positions
        restart at documents, an all-ones ``attention_mask`` (so PoSE's jumps are not read as packing)."""
        rows = self.indices(step, micro, rank)
        w = [self.window(i) for i in rows]
        ids = self.packed.input_ids[w]
        if self.pose_target_length is not None:
            pos = torch.stack(
                [
                    pose_position_ids(
                        ids.shape[1],
                        self.pose_target_length,
                        self.pose_chunks,
                        np.random.default_rng([self.seed, 1, i]),
                    )
                    for i in rows
                ]
            )
        else:
            pos = self.packed.position_ids[w]
        targets = torch.full_like(ids, -100)
        targets[:, :-1] = ids[:, 1:]
        if self.packed.restart:
            # Do not predict a document's first token from the previous document's EOS.
            targets[:, :-1][pos[:, 1:] == 0] = -100
        batch = {"input_ids": ids, "position_ids": pos, "targets": targets}
        if self.packed.attention_mask is not None:  # unpacked documents: padding is neither seen nor scored
            mask = self.packed.attention_mask[w]
            targets[mask == 0] = -100
            targets[:, :-1][mask[:, 1:] == 0] = -100
            batch["attention_mask"] = mask
        elif not self.packed.restart:
            batch["attention_mask"] = torch.ones_like(ids)
        return batch


# ------------------------------------------------------------------------------------------ tokenizer
def train_bpe_tokenizer(texts: list[str], vocab_size: int, *, min_frequency: int = 0):
    """A byte-level BPE tokenizer (pad=0, bos=1, eos=2) trained on ``texts``: offline, for random models and
    the bundled one. Digits are split one per token (as Llama's are), so a number is spelled the same way
    wherever it stands; byte-level, so any text encodes; no BOS is added (documents are joined by EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        min_frequency=min_frequency,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=1 << 20
    )


def tokenize(texts: list[str], tokenizer) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"]
