"""What passkey retrieval and the needle test share: greedy generation, the (length, depth, trial) grid,
records with resume, and accuracy tables."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import RopeExtendError
from .prompts import Prompt
from .records import RecordLog, run_info, setting_id


def check_can_generate(model) -> None:
    """A model that cannot ``generate`` (a bare decoder, an encoder) gets a clear error up front."""
    can = getattr(model, "can_generate", None)
    if not callable(getattr(model, "generate", None)) or not callable(can) or not can():
        raise RopeExtendError(
            f"{type(model).__name__} cannot generate text: retrieval tests need a causal language model with its "
            "LM head (load it with AutoModelForCausalLM / rope_extend.loading.load_model)"
        )


def greedy_config(tokenizer, max_new_tokens: int):
    """Greedy decoding that inherits nothing from the checkpoint's sampling settings.

    transformers fills every unset (None) field of a passed GenerationConfig from the model's own
    generation_config, and checkpoints ship ``do_sample=True, temperature=0.6, top_p=0.9``; so every field that
    changes the choice of token is set here explicitly to its neutral value (``top_k=50`` is transformers'
    default, ignored by greedy search; 0 or None would make transformers warn or inherit the checkpoint's).
    """
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=0, temperature=1.0, top_p=1.0,
        top_k=50, min_p=None, typical_p=1.0, repetition_penalty=1.0, no_repeat_ngram_size=0, length_penalty=1.0,
        num_return_sequences=1, bad_words_ids=None, suppress_tokens=None, begin_suppress_tokens=None,
        forced_bos_token_id=None, forced_eos_token_id=None, eos_token_id=eos, pad_token_id=pad,
    )


@torch.no_grad()
def greedy(model, tokenizer, input_ids: Sequence[int], max_new_tokens: int) -> str:
    """The greedy continuation (``max_new_tokens`` at most) of ``input_ids``, as text."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(input_ids)], device=device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         generation_config=greedy_config(tokenizer, max_new_tokens))
    return tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


@dataclass
class RetrievalResult:
    """Every trial's record and the accuracy table.

    ``accuracy`` maps length -> accuracy when depths were random, or (length, depth) -> accuracy with a
    depth grid; ``accuracy_by_length`` is always length -> accuracy.
    """

    records: list[dict]
    accuracy: dict
    accuracy_by_length: dict[int, float] = field(default_factory=dict)

    def context(self, threshold: float = 0.8) -> int | None:
        """YaRN's "passkey context": the largest length with accuracy >= ``threshold`` (None if none)."""
        ok = [n for n, a in self.accuracy_by_length.items() if a >= threshold]
        return max(ok) if ok else None


def accuracy_tables(records: list[dict], grid: bool) -> tuple[dict, dict]:
    by_len: dict[int, list[bool]] = {}
    by_cell: dict[tuple[int, float], list[bool]] = {}
    for r in records:
        by_len.setdefault(r["length"], []).append(bool(r["correct"]))
        by_cell.setdefault((r["length"], r["depth"]), []).append(bool(r["correct"]))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    per_len = {n: mean(v) for n, v in sorted(by_len.items())}
    per_cell = {k: mean(v) for k, v in sorted(by_cell.items())}
    return (per_cell if grid else per_len), per_len


def run_grid(model, tokenizer, *, task: str, lengths: list[int], depths: list[float] | None, trials: int,
             seed: int, setting: dict[str, Any], make_trial: Callable[[int, float | None, int], tuple[Prompt, Any]],
             score: Callable[[str, Any], tuple[Any, bool]], max_new_tokens: int, records: str | os.PathLike | None,
             resume: bool, progress: bool, run: dict[str, Any] | None = None) -> RetrievalResult:
    """Run ``trials`` trials per (length, depth) and score them; one record per trial, appended at once.

    ``make_trial(length, depth_or_None, trial) -> (prompt, answer)`` must be deterministic in its arguments
    (it seeds its own RNG from them), so a resumed run asks exactly the same questions.
    """
    from tqdm.auto import tqdm

    check_can_generate(model)
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise RopeExtendError(f"trials must be a positive integer, got {trials!r}")
    for length in {min(lengths), max(lengths)}:  # a length the tokenizer or data cannot reach fails before any work
        make_trial(length, depths[0] if depths else 0.5, 0)
    info = run_info(model, run)
    setting = {**info, **setting, "task": task, "seed": seed, "max_new_tokens": max_new_tokens}
    sid = setting_id(setting)
    log = RecordLog(records, resume=resume)
    cells = [(n, d, t) for n in lengths for d in (depths if depths is not None else [None]) for t in range(trials)]
    done: list[dict] = []
    label = info.get("label") or info["method"]
    bar = tqdm(cells, desc=f"{task} {label}", unit="trial", disable=not progress)
    for length, depth, trial in bar:
        bar.set_postfix(length=length)
        key = {"setting": sid, "length": length, "depth_grid": depth, "trial": trial}
        found = log.find(key)
        if found is not None:
            done.append(found)
            continue
        prompt, answer = make_trial(length, depth, trial)
        if len(prompt) != length:  # guaranteed by prompts.build; a wrong length would make the table a lie
            raise RopeExtendError(f"internal error: built a {len(prompt)}-token prompt for length {length}")
        output = greedy(model, tokenizer, prompt.input_ids, max_new_tokens)
        prediction, correct = score(output, answer)
        done.append(log.add({
            "task": task, **{k: info[k] for k in info}, "setting": sid, "length": length,
            "depth": depth if depth is not None else round(prompt.depth, 4), "depth_grid": depth,
            "actual_depth": round(prompt.actual_depth, 4), "trial": trial, "answer": answer,
            "prediction": prediction, "output": output, "correct": bool(correct),
        }))
    accuracy, per_len = accuracy_tables(done, grid=depths is not None)
    return RetrievalResult(done, accuracy, per_len)
