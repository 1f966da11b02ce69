"""What a card measures, decided and checked before anything is measured (``decide_measurements``).

A card that fails after an hour for a reason known at the start is the worst first run, so every check that
needs no measurement is made here, before the first record: the scaling, the lengths (inside L for retention,
within the memory the longest needs), the perplexity texts, every RULER task's prompt with its answer budget at
the lengths it runs at (each sample at the shortest, the essay haystack at the longest), and the served step's
packages.

What was chosen stays measured exactly or is refused; what was left to the defaults fits the model:

- **lengths** given (``--lengths``): every length gets every measurement, or the card is refused (one line,
  naming the length, the task and what would fit). Left to the defaults (``default_lengths``): a length the
  model cannot reach in memory is dropped, perplexity runs at the lengths its texts reach, and RULER starts at
  the shortest length where a task fits;
- **RULER tasks** given (``--tasks``): each runs at every RULER length, or the card is refused. Left to the
  defaults: the tasks whose prompt and answer budget fit at RULER's shortest length (RULER's average is over
  the same tasks at every length, so a task that fits only at longer lengths is left out, not averaged in
  later);
- **RULER's answer budgets** given (``--answer-tokens``): one for every task. Left to the defaults: RULER's per
  task, capped at L/4 (``answer_budgets``), and a task whose answers would not fit its capped budget left out;
- **the served step** (``--engine``): asked for explicitly, a missing llama-cpp-python or gguf is refused at
  once; left to the default, the card measures it when both are installed and says so in one line when not.
  ``--engine vllm`` (only when asked for) needs vLLM importable, and measures passkey at the lengths whose
  answer fits in the export (``_vllm_passkey``).

Each thing left out is one line of ``Measurements.left_out``, printed before measuring and written into the card.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, fields
from typing import Any, cast

from ..documents import read_documents
from ..errors import RopeExtendError
from ..export import routes
from ..export.targets.base import EXPORTED
from ..hf.reading import rotary_geometry, text_config
from ..patching import patched
from .card_options import CardOptions
from .data import default_texts
from .engines import INSTALL
from .passkey import PasskeyOptions
from .prompts import encode
from .records import _config_scaling as configured
from .records import scaling_in_force
from .ruler.sizing import Haystack, PromptFormat, build_prompt
from .ruler.subtasks import ESSAY, GENERATE, check_tasks
from .runner import check_reachable
from .vllm_engine import vllm_missing

ANSWER_SHARE = 4  # RULER's answer budget may take at most a quarter of the trained context (answer_budgets)
# what the served step imports: the export (gguf) and the engine (llama_cpp), as CI installs them
SERVE_PACKAGES = {"gguf": "gguf", "llama_cpp": "llama-cpp-python"}
# the answer tokens the card's passkey generates past each length (the harness's default)
PASSKEY_NEW = cast(int, next(f.default for f in fields(PasskeyOptions) if f.name == "max_new_tokens"))


@dataclass
class Measurements:
    """The card's measurements: ``lengths`` (passkey, and the card's rows), ``ruler_lengths`` with ``tasks``,
    ``perplexity_lengths`` with ``texts``, each RULER task's tokens to generate (``budgets``), whether the GGUF is served (``served`` is ``None`` when it is, else why
    not) and ``left_out``: one line per task, length or step the card leaves out, with why."""

    scaling: Any
    lengths: list[int]
    ruler_lengths: list[int]
    tasks: list[str]
    perplexity_lengths: list[int]
    texts: list[str]
    budgets: dict[str, int] = field(default_factory=dict)
    served: str | None = None
    left_out: list[str] = field(default_factory=list)
    served_passkey: list[int] | None = None  # vLLM: the lengths passkey's answer fits in the export (None: all)
    scaling_from: str = "patch"  # "config": the model runs its config's scaling (a fine-tune), as its records say

    @property
    def original_length(self) -> int:
        return int(self.scaling.original_max_position_embeddings)

    def at(self, lengths: list[int]) -> Measurements:
        """The same measurements at those of its lengths that are in ``lengths`` (the original is measured inside L,
        the served GGUF at ``--engine-lengths``)."""

        def keep(mine: list[int]) -> list[int]:
            return [n for n in mine if n in lengths]

        return Measurements(
            self.scaling,
            keep(self.lengths),
            keep(self.ruler_lengths),
            self.tasks,
            keep(self.perplexity_lengths),
            self.texts,
            self.budgets,
            self.served,
            served_passkey=None if self.served_passkey is None else keep(self.served_passkey),
            scaling_from=self.scaling_from,
        )


def default_lengths(original: int, target: int) -> list[int]:
    """``L/2`` (when ``L >= 2048``: RULER's answer budget, up to 128 tokens, leaves a prompt), ``L``, then ``2L, 4L,
    ...`` up to ``target`` (``target`` itself when it is not a doubling of ``L``)."""
    lengths, n = ([original // 2] if original >= 2048 else []) + [original], original
    while n * 2 <= target:
        n *= 2
        lengths.append(n)
    if lengths[-1] < target:
        lengths.append(target)
    return lengths


def answer_budgets(original: int, answer_tokens: int | None) -> dict[str, int]:
    """The tokens each RULER task generates: ``answer_tokens`` for every task when given, else RULER's
    ``tokens_to_generate`` capped at ``L / ANSWER_SHARE``. RULER set its budgets (up to 128) for contexts of 4k
    and more, where they are at most 3% of a length; on a model trained on 256 tokens 128 would be half its
    context and no niah prompt would fit inside L, where retention and the relative effective length are
    measured. From L = 512 on the cap is RULER's own budget."""
    if answer_tokens is not None:
        return dict.fromkeys(GENERATE, answer_tokens)
    return {t: min(n, max(1, original // ANSWER_SHARE)) for t, n in GENERATE.items()}


def missing_serve_packages() -> list[str]:
    """The packages of the served step that are not installed (pip names)."""
    return [pip for module, pip in SERVE_PACKAGES.items() if importlib.util.find_spec(module) is None]


def check_engine(options: CardOptions) -> list[str]:
    """The served step's missing packages; asked for explicitly (``--engine``), a missing one is refused (the
    first check of a card: before anything loads). ``--engine vllm`` needs vLLM importable here."""
    if options.engine_name == "vllm":
        problem = vllm_missing()
        if problem is not None:
            raise RopeExtendError(
                f"--engine vllm: {problem}; or leave --engine out (the card then skips the served rows)"
            )
        return []
    missing = missing_serve_packages() if options.engine is not False else []
    if missing and options.engine:
        raise RopeExtendError(
            f"--engine: the served step needs {' and '.join(missing)}, not installed here: {INSTALL}; or "
            "leave --engine out (the card then skips the served rows)"
        )
    return missing


def decide_measurements(model, tok, model_name: str, options: CardOptions) -> Measurements:
    """The card's measurements for ``model`` (patched or configured) and ``tok``, every check made (see the module)."""
    scaling = patched(model) or configured(model)
    if scaling is None:
        raise RopeExtendError(
            f"{model_name} is neither patched nor configured with a scaling: give --method (the card measures a "
            "context extension)"
        )
    L = scaling.original_max_position_embeddings
    given = options.lengths is not None
    lengths = list(options.lengths or default_lengths(L, scaling.target_length))
    if not any(n <= L for n in lengths):
        raise RopeExtendError(f"retention needs a length inside L={L}; got lengths {lengths}")
    extra = sorted(set(options.engine_lengths or ()) - set(lengths))
    if extra:
        raise RopeExtendError(f"engine_lengths {extra} are not among the card's lengths {lengths}")
    served = _served(model, scaling, options)
    left: list[str] = [] if served is None or options.engine is False else [f"the served rows: {served}"]
    served_lengths = None
    if served is None and options.engine_name == "vllm":
        served_lengths = _vllm_passkey(options.engine_lengths or lengths, scaling.target_length, options, left)
    budgets = answer_budgets(L, options.answer_tokens)
    lengths = _reachable(model, lengths, given, left, max(budgets.values()))  # RULER's decoding adds the most
    ppl_lengths, texts = _texts(tok, lengths, given, options, left)
    ruler_lengths, tasks = _ruler(tok, lengths, given, options, left, budgets)
    budgets = {t: budgets[t] for t in tasks}
    return Measurements(
        scaling,
        lengths,
        ruler_lengths,
        tasks,
        ppl_lengths,
        texts,
        budgets,
        served,
        left,
        served_passkey=served_lengths,
        scaling_from=scaling_in_force(model)[1],
    )


def _vllm_passkey(lengths: list[int], served: int, options: CardOptions, left: list[str]) -> list[int]:
    """The lengths passkey is measured at in vLLM: those whose prompt and ``PASSKEY_NEW`` answer tokens fit in
    the export's ``served`` tokens (its rotary table ends there; transformers and llama.cpp compute past it).
    RULER's lengths hold their answers and perplexity generates nothing, so both run at every length. A length
    given by ``--engine-lengths`` that does not fit is refused; a default one is left out, in one line."""
    fits = [n for n in lengths if n + PASSKEY_NEW <= served]
    past = [n for n in lengths if n not in fits]
    if past and options.engine_lengths is not None:
        raise RopeExtendError(
            f"--engine-lengths {past}: passkey generates {PASSKEY_NEW} tokens past each length, past the {served} "
            f"tokens the vLLM export serves; give engine lengths up to {served - PASSKEY_NEW}"
        )
    if past:
        left.append(
            f"passkey served in vLLM at {', '.join(map(str, past))}: its {PASSKEY_NEW} answer tokens go past the "
            f"{served} tokens the export serves (RULER and perplexity are measured there)"
        )
    return fits


def _served(model, scaling, options: CardOptions) -> str | None:
    """Why the export is not measured in its engine (``None``: it is): ``--no-engine``, a method the engine
    does not compute exactly, or a package missing (refused when ``--engine`` was asked for)."""
    if options.engine is False:
        return "--no-engine"
    missing = check_engine(options)
    target = "vllm" if options.engine_name == "vllm" else "gguf"
    decision = routes.decide(scaling, target, *rotary_geometry(text_config(model.config)))
    if decision.status != EXPORTED:
        return decision.message(scaling.method.name, target)
    if missing:
        return f"{' and '.join(missing)} not installed: {INSTALL}"
    return None


def _reachable(model, lengths: list[int], given: bool, left: list[str], generated: int) -> list[int]:
    """The lengths whose forward (with the tokens generated after it) fits in memory now: a given one that does
    not is refused (``runner.check_reachable``'s message), a default one is left out."""
    kept = []
    for n in lengths:
        try:
            check_reachable(model, n, cache=True, generated=generated)
        except RopeExtendError as exc:
            if given:
                raise
            left.append(f"length {n}: {exc}")
            continue
        kept.append(n)
    return kept


def _texts(tok, lengths: list[int], given: bool, options: CardOptions, left: list[str]):
    """``(perplexity lengths, texts)``: the texts that reach the longest of them (the same documents at every
    length). A given length no text reaches is refused; a default one is left out for perplexity."""
    source = default_texts() if options.text is None else read_documents(options.text)
    sizes = [len(tok(t)["input_ids"]) for t in source]
    where = f"{options.text or 'the bundled corpus'!r}"
    longest = max(sizes, default=0)
    reached = [n for n in lengths if n <= longest]
    if given and len(reached) < len(lengths):
        raise RopeExtendError(
            f"no text of {where} reaches {max(lengths)} tokens (the longest has {longest}): pass --text with longer ones"
        )
    for n in lengths[len(reached) :]:
        left.append(
            f"perplexity at {n}: no text of {where} reaches {n} tokens (the longest has {longest}); "
            "--text canterbury (rope-extend fetch canterbury) holds longer ones"
        )
    top = max(reached, default=0)
    return reached, [t for t, s in zip(source, sizes, strict=True) if reached and s >= top]


def _ruler(tok, lengths: list[int], given: bool, options: CardOptions, left: list[str], budgets: dict[str, int]):
    """``(RULER lengths, tasks)``: RULER from the shortest length where a task fits (the first given length), with
    the tasks that fit there; each task's prompt built at that length for every sample and at the longest for
    the essay haystack (``build_prompt``'s refusals: too short a length, too small a haystack)."""
    chosen = options.tasks is not None
    candidates = check_tasks(options.tasks)
    fmt = PromptFormat(tok, options.chat_template)
    hay = Haystack(None)

    def problem(task: str, n: int, samples: range) -> str | None:
        for sample in samples:
            try:
                prompt = build_prompt(
                    tok,
                    task,
                    n,
                    seed=options.seed,
                    sample=sample,
                    haystack=hay,
                    chat_template=fmt,
                    max_new_tokens=budgets[task],
                )
            except RopeExtendError as exc:
                return str(exc)
            # a budget capped below RULER's must still hold the answer (else a right answer is cut and scored wrong)
            need = len(encode(tok, ", ".join(prompt.answers), special=False))
            if budgets[task] < GENERATE[task] and options.answer_tokens is None and need > budgets[task]:
                return (
                    f"the answers of RULER task {task} take {need} tokens of this tokenizer, more than the {budgets[task]} it may generate "
                    f"(RULER's {GENERATE[task]}, capped at L/{ANSWER_SHARE} on this model)"
                )
        return None

    for i, start in enumerate(lengths[:1] if given else lengths):
        why = {t: problem(t, start, range(options.samples)) for t in candidates}
        fits = [t for t in candidates if why[t] is None]
        if fits and (not chosen or len(fits) == len(candidates)):
            break
        if given or (chosen and i == len(lengths) - 1):
            raise RopeExtendError(next(w for w in why.values() if w is not None))
        first = next(w for w in why.values() if w is not None)
        left.append(f"RULER at {start}: no {'given ' if chosen else ''}task fits ({first})")
    else:
        return [], []
    for t in candidates:
        if why[t] is not None:
            left.append(f"RULER task {t}: {why[t]}")
    ruler_lengths = [n for n in lengths if n >= start]
    tasks = []
    for t in fits:
        too_long = problem(t, max(ruler_lengths), range(1)) if t in ESSAY and len(ruler_lengths) > 1 else None
        if too_long is not None and (given or chosen):
            raise RopeExtendError(too_long)
        if too_long is not None:
            left.append(f"RULER task {t}: {too_long}")
        else:
            tasks.append(t)
    return (ruler_lengths, tasks) if tasks else ([], [])
