"""From a draft to a prompt of a length: the prompt format (RULER's ``base`` or the chat template), the essay
haystack, one RNG per sample, and RULER's sizing of the haystack (``build_prompt``)."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...errors import RopeExtendError
from .. import ruler_words
from ..data import default_texts
from ..prompts import encode
from ..records import short_hash
from .subtasks import GENERATE, NIAH, Draft, _cwe, _fwe, _niah, _vt, _vt_parts, fwe_counts, fwe_vocab


class PromptFormat:
    """How a draft becomes token ids: RULER's ``base`` template (the text as is, the tokenizer's special tokens
    added) or the model's chat template (the worked examples as earlier turns, the task as the user's turn, the
    answer prefix opening the assistant's turn, as RULER's chat templates put it after the end of the user's
    turn; the template writes its own special tokens).

    ``chat``: use the tokenizer's chat template when it has one (True), or never (False)."""

    def __init__(self, tokenizer, chat: bool = True):
        if not isinstance(chat, bool):
            raise RopeExtendError(f"chat_template must be true or false, got {chat!r}")
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.template = template if chat and isinstance(template, str) and template else None
        self.name = "chat" if self.template else "base"

    def setting(self) -> str:
        """``base``, or ``chat:`` and the template's digest (records of another template are not reused)."""
        return f"chat:{short_hash(self.template)}" if self.template else "base"

    def text(self, draft: Draft) -> str:
        if self.template is None:
            shots = "".join(f"{u}{a}\n" for u, a in draft.shots)
            return shots + draft.user + draft.prefix
        turns: list[dict[str, str]] = []
        for u, a in draft.shots:
            turns += [{"role": "user", "content": u}, {"role": "assistant", "content": a.lstrip()}]
        turns.append({"role": "user", "content": draft.user})
        rendered = self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        return rendered + draft.prefix

    def ids(self, draft: Draft) -> list[int]:
        return encode(self.tokenizer, self.text(draft), special=self.template is None)


@dataclass(frozen=True)
class RulerPrompt:
    task: str
    input_ids: list[int]
    answers: list[str]
    units: int  # haystack units (sentences, needles, list words, coded words)
    budget: int  # the most prompt tokens: the length less the tokens to generate
    sized: int = 0  # the units this task and length were sized to (``units`` is less when this sample dropped steps)

    def __len__(self) -> int:
        return len(self.input_ids)


def sample_rng(task: str, seed: int, length: int, sample: int) -> Callable[[], random.Random]:
    """One RNG per sample, from its coordinates only (a resumed run or a subset of tasks draws the same)."""
    return lambda: random.Random(f"ruler:{task}:{seed}:{length}:{sample}")


class Haystack:
    """The essay tasks' words: the texts joined into one run of words, as RULER joins its essays."""

    def __init__(self, texts: Sequence[str] | None):
        self.texts = texts
        self._words: list[str] | None = None

    @property
    def words(self) -> list[str]:
        if self._words is None:
            texts = list(self.texts) if self.texts is not None else default_texts()
            self._words = [w for w in re.sub(r"\s+", " ", " ".join(texts)).split(" ") if w]
            if not self._words:
                raise RopeExtendError("the essay haystack holds no words: give texts with words in them")
        return self._words

    def digest(self) -> str:
        return short_hash(" ".join(self.words))


def _vt_example_units(tokenizer, budget: int) -> int:
    """Noise sentences in vt's worked example: the most that keep it within ``budget`` tokens (RULER builds it
    to 500; at least 5, RULER's smallest step)."""

    def tokens(m: int) -> int:
        user, prefix, _ = _vt_parts(random.Random("ruler-vt-example"), m, letters=3)
        return len(encode(tokenizer, user + prefix))

    fit = largest_fitting(tokens, budget, 5, None)
    return fit if fit is not None else 5


def _draft_fn(task: str, length: int, budget: int, haystack: Haystack, tokenizer):
    """``(draft(rng, n), smallest n, largest n or None)`` for ``task`` at ``length``."""
    if task in NIAH:
        spec = NIAH[task]
        needles = max(spec.keys, spec.queries) * spec.values
        if spec.haystack == "essay":
            words = haystack.words
            return (lambda rng, n: _niah(spec, rng, n, words)), 1, len(words)
        return (lambda rng, n: _niah(spec, rng, n, ())), needles, None
    if task == "vt":
        units = _vt_example_units(tokenizer, min(500, length // 4))
        return (lambda rng, n: _vt(rng, n, units)), 5, None
    if task == "cwe":
        return (lambda rng, n: _cwe(rng, n, length)), 10, len(ruler_words.common_words())
    return (lambda rng, n: _fwe(rng, n, budget)), 1, None


def largest_fitting(measure: Callable[[int], int], budget: int, low: int, high: int | None) -> int | None:
    """The largest ``n`` in ``[low, high]`` with ``measure(n) <= budget`` (doubling, then bisection: RULER's
    binary search over haystack sizes), or None when even ``low`` is too long."""
    if measure(low) > budget:
        return None
    good, bad = low, None
    step = low
    while bad is None:
        step *= 2
        probe = step if high is None else min(step, high)
        if measure(probe) <= budget:
            good = probe
            if high is not None and probe >= high:
                return high
        else:
            bad = probe
    while bad - good > 1:
        mid = (good + bad) // 2
        if measure(mid) <= budget:
            good = mid
        else:
            bad = mid
    return good


def _fit_fwe(measure: Callable[[int], int], budget: int) -> int:
    """fwe's word count by RULER's own rule (``freq_words_extraction.py``): from ``budget // 6`` words, grow by
    ``budget // 32`` while the prompt is shorter than the budget, step back once, and shrink by the same step
    while it is longer. Its coarse step leaves fwe's prompts up to that step short of the budget."""
    step = max(1, budget // 32)
    n = max(1, budget // 6)
    while measure(n) < budget:
        n += step
    n -= step
    while n > 1 and measure(n) > budget:
        n = max(1, n - step)
    return n


def ruler_step(task: str, length: int, budget: int) -> int:
    """RULER's ``incremental`` for ``task`` at ``length``: the haystack units a sample that overflows drops
    (``niah.py``: 500 essay words, 25 noise sentences or needles, 5 below 4096 tokens; ``variable_tracking.py``:
    10 noise sentences, 5 below 4096; ``common_words_extraction.py``: 10 words; ``freq_words_extraction.py``:
    ``budget // 32`` coded words)."""
    if task == "fwe":
        return max(1, budget // 32)
    if task == "cwe":
        return 10
    if task == "vt":
        return 5 if length < 4096 else 10
    if NIAH[task].haystack == "essay":
        return 500
    return 5 if length < 4096 else 25


def build_prompt(
    tokenizer,
    task: str,
    length: int,
    *,
    seed: int = 0,
    sample: int = 0,
    haystack: Haystack | None = None,
    chat_template: bool | PromptFormat = True,
    max_new_tokens: int | None = None,
) -> RulerPrompt:
    """The ``sample``-th prompt of ``task`` at ``length``, as RULER counts it: the most haystack whose prompt
    (template and answer prefix included) plus the task's tokens to generate (``max_new_tokens``, default
    RULER's) fit in ``length`` tokens of ``tokenizer``."""
    haystack = haystack or Haystack(None)
    fmt = chat_template if isinstance(chat_template, PromptFormat) else PromptFormat(tokenizer, chat_template)
    generate = max_new_tokens or GENERATE[task]
    budget = length - generate
    if budget < 1:
        raise RopeExtendError(
            f"length {length} leaves no prompt for RULER task {task}: its {generate} tokens to generate count into "
            f"the length, as in RULER; use lengths > {generate}"
        )
    draft_fn, low, high = _draft_fn(task, length, budget, haystack, tokenizer)

    def measuring(rng: Callable[[], random.Random]) -> Callable[[int], int]:
        return lambda n: len(fmt.ids(draft_fn(rng(), n)))

    # RULER sizes the haystack once per task and length, on one draw (here the draw numbered -1) ...
    sizing = measuring(sample_rng(task, seed, length, -1))
    n = _fit_fwe(sizing, budget) if task == "fwe" else largest_fitting(sizing, budget, low, high)
    fresh = sample_rng(task, seed, length, sample)
    measure = measuring(fresh)

    def too_short(draw: Callable[[int], int]) -> RopeExtendError:
        return RopeExtendError(
            f"length {length} is too short for RULER task {task}: its smallest prompt already takes "
            f"{draw(low)} tokens of this tokenizer, and {generate} more are generated; use lengths >= "
            f"{draw(low) + generate}"
        )

    if n is None:  # the sizing draw's smallest prompt is too long (a sample's own may be shorter)
        raise too_short(sizing)
    if high is not None and n == high:
        what = "the essay haystack" if task in NIAH else "RULER's wonderwords list for cwe"
        raise RopeExtendError(
            f"{what} ({high} words) cannot fill length {length} for RULER task {task}: with all of them the prompt "
            f"has {sizing(high)} tokens of a {budget}-token budget; "
            + ("give longer texts (--data) or shorter lengths" if task in NIAH else "use shorter lengths")
        )
    # ... and a sample whose own draw overflows drops RULER's step until it fits
    step, sized = ruler_step(task, length, budget), n
    while measure(n) > budget:
        while n - step < low and step > 1:
            step //= 2  # RULER's step would leave no haystack (RULER loops forever there): a finer one
        if n - step < low:
            raise too_short(measure)
        n -= step
    if task == "fwe":
        counts = fwe_counts(n, fwe_vocab(budget))
        if not counts[1] > counts[2] > counts[3] > counts[4]:
            raise RopeExtendError(
                f"length {length} is too short for RULER task fwe: {n} coded words give the three most frequent "
                f"counts {counts[1:4]} and the next {counts[4]}, so the answer is not unique; use a longer length"
            )
    draft = draft_fn(fresh(), n)
    ids = fmt.ids(draft)
    return RulerPrompt(task, ids, list(draft.answers), n, budget, sized)
