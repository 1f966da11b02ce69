"""What passkey retrieval and the needle test share: greedy generation, the (length, depth, trial) grid,
records with resume, and accuracy tables."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import RopeExtendError
from . import runner
from .data import parse_trials_at
from .engines import is_engine
from .prompts import Prompt

# Passkey and needle records of rope-extend 0.1.0 carry the run's trial count in their setting id; resuming
# recognises those written by runs of up to this many trials.
LEGACY_TRIALS = 1024


def check_can_generate(model) -> None:
    """A model that cannot ``generate`` (a bare decoder, an encoder) gets a clear error up front."""
    if is_engine(model):  # a causal LM served by an engine
        return
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
    # here, not at the top: the task modules import this one, and the command line's parser imports them for their
    # options without loading transformers
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        temperature=1.0,
        top_p=1.0,
        top_k=50,
        min_p=None,
        typical_p=1.0,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        length_penalty=1.0,
        num_return_sequences=1,
        bad_words_ids=None,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
    )


@torch.no_grad()
def greedy(model, tokenizer, input_ids: Sequence[int], max_new_tokens: int) -> str:
    """The greedy continuation (``max_new_tokens`` at most) of ``input_ids``, as text."""
    if is_engine(model):
        ids = model.greedy(input_ids, max_new_tokens, tokenizer.eos_token_id)
        return tokenizer.decode(ids, skip_special_tokens=True)
    device = next(model.parameters()).device
    ids = torch.tensor([list(input_ids)], device=device)
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=greedy_config(tokenizer, max_new_tokens)
    )
    return tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)


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
    per_len = {n: sum(v) / len(v) for n, v in sorted(by_len.items())}
    per_cell = {k: sum(v) / len(v) for k, v in sorted(by_cell.items())}
    return (per_cell if grid else per_len), per_len


def run_grid(
    model,
    tokenizer,
    *,
    task: str,
    lengths: list[int],
    depths: list[float] | None,
    trials: int,
    seed: int,
    trials_at: dict[int, int] | None = None,
    setting: dict[str, Any],
    make_trial: Callable[[int, float | None, int], tuple[Prompt, Any]],
    score: Callable[[str, Any], tuple[Any, bool]],
    max_new_tokens: int,
    records: str | os.PathLike | None,
    resume: bool,
    progress: bool,
    run: dict[str, Any] | None = None,
    sliding_window: str = "auto",
) -> RetrievalResult:
    """Run ``trials`` trials per (length, depth) and score them, through the evaluation runner;
    ``trials_at`` gives other counts at particular lengths (``{16384: 10}``).

    ``make_trial(length, depth_or_None, trial) -> (prompt, answer)`` must be deterministic in its arguments
    (it seeds its own RNG from them), so a resumed run asks exactly the same questions. Trial ``t`` is the
    same question whatever the number of trials, so the trial count is not part of the setting: a run with
    more trials reuses the recorded ones and adds the rest.
    """
    check_can_generate(model)
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise RopeExtendError(f"trials must be a positive integer, got {trials!r}")
    trials_at = parse_trials_at(trials_at, lengths) or {}
    runner.check_reachable(model, max(lengths), cache=True, generated=max_new_tokens)  # before building a prompt
    for length in {min(lengths), max(lengths)}:  # a length the tokenizer or data cannot reach fails before any work
        make_trial(length, depths[0] if depths else 0.5, 0)
    jobs = [
        {"length": n, "depth_grid": d, "trial": t}
        for n in lengths
        for d in (depths if depths is not None else [None])
        for t in range(trials_at.get(n, trials))
    ]

    def measure(job: dict) -> dict:
        prompt, answer = make_trial(job["length"], job["depth_grid"], job["trial"])
        if len(prompt) != job["length"]:  # guaranteed by prompts.build; a wrong length would make the table a lie
            raise RopeExtendError(f"internal error: built a {len(prompt)}-token prompt for length {job['length']}")
        output = greedy(model, tokenizer, prompt.input_ids, max_new_tokens)
        prediction, correct = score(output, answer)
        depth = job["depth_grid"] if job["depth_grid"] is not None else round(prompt.depth, 4)
        return {
            "depth": depth,
            "actual_depth": round(prompt.actual_depth, 4),
            "answer": answer,
            "prediction": prediction,
            "output": output,
            "correct": bool(correct),
        }

    setting = {**setting, "seed": seed, "max_new_tokens": max_new_tokens}
    done = runner.run(
        model,
        tokenizer=tokenizer,
        task=task,
        setting=setting,
        # records written before the trial count left the setting (0.1.0) are reused too
        aliases=[{**setting, "trials": n} for n in range(1, LEGACY_TRIALS + 1)],
        jobs=jobs,
        measure=measure,
        longest=max(lengths),
        generated=max_new_tokens,
        records=records,
        resume=resume,
        progress=progress,
        run=run,
        sliding_window=sliding_window,
        cache=True,
    )
    accuracy, per_len = accuracy_tables(done, grid=depths is not None)
    return RetrievalResult(done, accuracy, per_len)
