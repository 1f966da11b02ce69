"""RULER's synthetic tasks, offline (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?"; task definitions from NVIDIA/RULER ``scripts/synthetic.yaml``, templates
and answer prefixes from its ``scripts/data/synthetic/constants.py``).

======================  =========================================================================
task                    what the prompt holds
======================  =========================================================================
``niah_single_1``       one ``word -> 7-digit number`` needle in the noise sentences
``niah_single_2``       the same needle in an essay haystack
``niah_single_3``       one ``word -> UUID`` needle in an essay haystack
``niah_multikey_1``     four needles of different keys in an essay haystack; one key asked for
``niah_multikey_2``     one needle among needles of other keys (the haystack is needles)
``niah_multikey_3``     the same with UUID keys and values
``niah_multivalue``     four values for one key, in an essay haystack; all four asked for
``niah_multiquery``     four keys in an essay haystack, all four asked for
``vt``                  variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A`` ... (4 hops) hidden in
                        noise; the answer is every variable that holds the value (one worked example first)
``cwe``                 common words extraction: a numbered list of words; the 10 most common are asked
                        for (one worked example first)
``fwe``                 frequent words extraction: coded words with Zipf (alpha 2) frequencies; the 3 most
                        frequent are asked for ('...' ranks first and is noise)
======================  =========================================================================

The needle is RULER's ``One of the special magic {numbers} for {key} is: {value}.``; keys are
``adjective-noun`` words (RULER's wonderwords pairs, ``ruler_words``), 7-digit numbers or UUIDs, as RULER draws
them; needles go at depths drawn from 40 evenly spaced ones (essay) or at random lines (noise, needles). With one
key and one value the template is put in the singular, as RULER does. The prompt ends with the task's answer
prefix; with the tokenizer's chat template (``PromptFormat``; RULER wraps instruct models' prompts in theirs) the
task is the user's turn and the prefix opens the assistant's, else it is RULER's ``base`` template.

**Length, as RULER counts it.** A length holds the prompt and the task's tokens to generate (RULER's
``tokens_to_generate``: niah 128, vt 30, cwe 120, fwe 50): the number of haystack units (sentences, needles,
words) is sized as RULER sizes it: once per task and length, on one draw, the largest whose whole prompt fits
in ``length - tokens_to_generate`` (doubling then bisection, as RULER's binary search; fwe grows by RULER's own
step of budget // 32 words and steps back once); then each sample takes that size and drops RULER's step
(``incremental``: 500 essay words, 25 needles or noise sentences, 5 of them below 4096 tokens; 10 vt noise
sentences, 5 below 4096; 10 cwe words; fwe's budget // 32; halved where it would leave no haystack, where RULER
loops forever) while its own draw overflows. So a sample can be a
step short of the budget, as in RULER (its niah_multikey_2 at 4096 holds 3015-3967 prompt tokens). cwe uses RULER's
short-context counts (common words 6 times, others once; the example 3 and 1) below 4096 tokens and 30 / 3 from
4096 on, from RULER's 8,166 wonderwords words (a length needing more is refused); fwe's coded vocabulary has
``(length - 50) // 50`` words. vt's worked example is built to 500 tokens (RULER's) or a quarter of the length
when that is shorter.

**Scoring.** RULER's ``string_match_all`` (the share of the expected strings found, case-insensitive, in the
output with control characters turned into newlines and stripped) for every task here; ``string_match_part``
(any one found) is RULER's qa metric. A task's score at a length is RULER's: the mean in percent rounded to 2
decimals; empty answers are counted; the average is over the tasks measured (11 at most; RULER's is over 13, so
the two are never comparable).

**Haystack.** The essay tasks read the texts given (``haystack``; by default the bundled held-out corpus),
joined into one run of words as RULER joins Paul Graham's essays. A length the words cannot fill is an
error, not a repeated text.
"""

from __future__ import annotations

import math
import os
import random
import re
import string
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import RopeExtendError, closest
from . import retrieval, ruler_words, runner
from .data import default_texts, parse_lengths
from .effective import KEEP, RULER_THRESHOLD, EffectiveLength, check_effective_options, effective_lengths
from .prompts import encode, split_sentences
from .records import short_hash

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER: np.linspace(0, 100, 40), rounded

# RULER's task templates (the user's turn) and answer prefixes (what the answer starts with), kept apart as
# RULER keeps them: with a chat template the prefix opens the assistant's turn.
NIAH_TEMPLATE = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the {kind} afterwards.\n{context}\nWhat are all the special magic {kind} for {query} mentioned in the "
    "provided text?"
)
NIAH_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assigned the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
)
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


@dataclass(frozen=True)
class Niah:
    """A needle-in-a-haystack variant (RULER's ``niah.py`` arguments)."""

    haystack: str  # noise | essay | needle
    key: str  # words | numbers | uuids
    value: str
    keys: int = 1
    values: int = 1
    queries: int = 1


NIAH = {
    "niah_single_1": Niah("noise", "words", "numbers"),
    "niah_single_2": Niah("essay", "words", "numbers"),
    "niah_single_3": Niah("essay", "words", "uuids"),
    "niah_multikey_1": Niah("essay", "words", "numbers", keys=4),
    "niah_multikey_2": Niah("needle", "words", "numbers"),
    "niah_multikey_3": Niah("needle", "uuids", "uuids"),
    "niah_multivalue": Niah("essay", "words", "numbers", values=4),
    "niah_multiquery": Niah("essay", "words", "numbers", queries=4),
}
TASKS = (*NIAH, "vt", "cwe", "fwe")
RULER_TASKS = 13  # RULER's own average also holds qa_1 (SQuAD) and qa_2 (HotpotQA), which need data sets
GENERATE = {**{t: 128 for t in NIAH}, "vt": 30, "cwe": 120, "fwe": 50}  # RULER's tokens_to_generate
# RULER's metric per task (scripts/eval/synthetic/constants.py): string_match_all for every synthetic task;
# string_match_part is its qa tasks' (any one of the references counts)
METRIC = dict.fromkeys(TASKS, "all")
ESSAY = tuple(t for t, spec in NIAH.items() if spec.haystack == "essay")
VERSION = 3  # the protocol: 3 = RULER's sizing (once per task and length, a step dropped per sample on overflow);
# 2 = each sample fitted on its own; 1 = exact-length pad


def check_tasks(tasks: str | Iterable[str] | None) -> list[str]:
    """Task names (a list or ``"vt,cwe"``; None = all eleven), checked; an unknown one names the allowed."""
    if tasks is None:
        return list(TASKS)
    items = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else [str(t).strip() for t in tasks]
    items = [t for t in items if t]
    if not items:
        raise RopeExtendError(f"no RULER task given; allowed: {', '.join(TASKS)}")
    for t in items:
        if t not in TASKS:
            raise RopeExtendError(f"unknown RULER task {t!r}{closest(t, TASKS)}; allowed: {', '.join(TASKS)}")
    return list(dict.fromkeys(items))


# ------------------------------------------------------------------------------------------ scoring
def postprocess(output: str) -> str:
    """RULER's ``postprocess_pred``: strip, control characters to newlines, strip again."""
    return re.sub(r"[\x00-\x1f]", "\n", output.strip()).strip()


def _check_answers(answers: Sequence[str], name: str) -> None:
    if not answers:
        raise RopeExtendError(f"{name} needs at least one expected string")


def string_match_all(output: str, answers: Sequence[str]) -> float:
    """The share of ``answers`` that occur in ``output`` (case-insensitive): RULER's ``string_match_all``."""
    _check_answers(answers, "string_match_all")
    pred = postprocess(output).lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def string_match_part(output: str, answers: Sequence[str]) -> float:
    """1 if any one of ``answers`` occurs in ``output`` (case-insensitive), else 0: RULER's ``string_match_part``
    (its qa tasks', where each reference is an acceptable answer)."""
    _check_answers(answers, "string_match_part")
    pred = postprocess(output).lower()
    return float(any(a.lower() in pred for a in answers))


def score(task: str, output: str, answers: Sequence[str]) -> float:
    """A sample's score in [0, 1] by the task's RULER metric (``METRIC``)."""
    return (string_match_part if METRIC.get(task) == "part" else string_match_all)(output, answers)


def is_empty(output: str) -> bool:
    """RULER's null prediction: nothing left after ``postprocess``."""
    return not postprocess(output)


def task_score(scores: Sequence[float]) -> float:
    """RULER's score of a task at a length: the mean sample score in percent, rounded to 2 decimals."""
    if not scores:
        raise RopeExtendError("task_score needs at least one sample score")
    return round(100 * sum(scores) / len(scores), 2)


# ------------------------------------------------------------------------------------------ samples
@dataclass
class Draft:
    """A sample as text: the user's turn (instructions, context, question), the answer prefix, the expected
    strings, and worked examples as (user, assistant) turns before it (cwe's)."""

    user: str
    prefix: str
    answers: list[str]
    shots: list[tuple[str, str]] = field(default_factory=list)


def _singular(text: str) -> str:
    """RULER's edits for one key with one value: 'Some ... are' -> 'A ... is'."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(old, new)
    return text


def _draw(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return ruler_words.draw_key(rng)
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _niah(spec: Niah, rng: random.Random, n: int, words: Sequence[str]) -> Draft:
    n_keys = max(spec.keys, spec.queries)
    keys: list[str] = []
    values: list[list[str]] = []
    needles: list[str] = []
    while len(keys) < n_keys:
        key = _draw(rng, spec.key)
        if key in keys:
            continue
        keys.append(key)
        values.append([_draw(rng, spec.value) for _ in range(spec.values)])
        needles += [NEEDLE.format(kind=spec.value, key=key, value=v) for v in values[-1]]
    rng.shuffle(needles)
    if spec.haystack == "essay":
        sentences = split_sentences(" ".join(words[:n]))
        cuts = sorted(int(len(sentences) * d / 100) for d in rng.sample(DEPTHS, len(needles)))
        parts, last = [], 0
        for cut, needle in zip(cuts, needles, strict=True):
            parts += sentences[last:cut] + [needle]
            last = cut
        context = " ".join(parts + sentences[last:])
    else:
        if spec.haystack == "noise":
            lines = [NOISE] * n
        else:
            lines = []
            while len(lines) < n:
                key = _draw(rng, spec.key)
                if key not in keys:  # a distractor never carries an asked key
                    lines.append(NEEDLE.format(kind=spec.value, key=key, value=_draw(rng, spec.value)))
        for at, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles, strict=True):
            lines.insert(at, needle)
        context = "\n".join(lines)
    chosen = rng.sample(range(n_keys), spec.queries)
    queries = [keys[i] for i in chosen]
    answers = [v for i in chosen for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, prefix, kind = NIAH_TEMPLATE, NIAH_PREFIX, spec.value
    if spec.queries * spec.values == 1:
        template, prefix, kind = _singular(template), _singular(prefix), kind[:-1]
    user = template.replace("{context}", "\0").format(kind=kind, query=query).replace("\0", context)
    return Draft(user, prefix.format(kind=kind, query=query), answers)


def _names(rng: random.Random, count: int, letters: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    return names


def _vt_parts(rng: random.Random, n: int, *, hops: int = 4, letters: int = 5) -> tuple[str, str, list[str]]:
    """One chain of ``hops`` assignments hidden among ``n`` noise sentences: the user's text, the answer prefix
    and the chain's variables."""
    names = _names(rng, hops + 1, letters)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    lines = [NOISE] * n
    for j, at in enumerate(sorted(rng.sample(range(n), len(chain)))):
        lines.insert(at + j, chain[j])
    context = "\n".join(lines).replace(". \n", ".\n")
    user = VT_TEMPLATE.replace("{context}", "\0").format(query=value).replace("\0", context)
    return user, VT_PREFIX.format(query=value, num_v=hops + 1), names


def _vt(rng: random.Random, n: int, example_units: int) -> Draft:
    # RULER's worked example (3-letter names) is plain text inside the user's turn, answer included
    ex_user, ex_prefix, ex_names = _vt_parts(rng, example_units, letters=3)
    user, prefix, answers = _vt_parts(rng, n)
    return Draft(ex_user + ex_prefix + " " + " ".join(ex_names) + "\n" + user, prefix, answers)


def _cwe_list(rng: random.Random, n: int, common: int, rare: int) -> tuple[str, list[str]]:
    pool = ruler_words.common_words()
    if n > len(pool):  # the fit never asks for more (its upper bound); a direct call is told
        raise RopeExtendError(f"cwe needs {n} distinct words; RULER's wonderwords lists hold {len(pool)}")
    chosen = rng.sample(pool, n)
    top = chosen[:10]
    items = top * common + chosen[10:] * rare
    rng.shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), top


def _cwe(rng: random.Random, n: int, length: int) -> Draft:
    short = length < 4096  # RULER's switch, on the length asked for
    example, top = _cwe_list(rng, 20, 3, 1) if short else _cwe_list(rng, 40, 10, 3)
    answer = CWE_PREFIX + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(top))
    context, answers = _cwe_list(rng, n, 6, 1) if short else _cwe_list(rng, n, 30, 3)
    return Draft(
        CWE_TEMPLATE.format(context=context), CWE_PREFIX, answers, [(CWE_TEMPLATE.format(context=example), answer)]
    )


ZETA2 = math.pi**2 / 6  # RULER's zeta(alpha) at its alpha = 2


def fwe_counts(n: int, vocab: int) -> list[int]:
    """How often the k-th coded word occurs (k = 1..vocab): ``int(n * k**-2 / zeta(2))``."""
    return [int(n * k**-2 / ZETA2) for k in range(1, vocab + 1)]


def fwe_vocab(budget: int) -> int:
    """fwe's coded vocabulary: RULER's ``(max_seq_length - tokens_to_generate) // 50`` (at least 5)."""
    return max(5, budget // 50)


def _fwe(rng: random.Random, n: int, budget: int) -> Draft:
    size = fwe_vocab(budget)
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    words = sorted(vocab)
    rng.shuffle(words)
    words[0] = "..."  # the most frequent is noise
    text = [w for w, c in zip(words, fwe_counts(n, size), strict=True) for _ in range(c)]
    rng.shuffle(text)
    return Draft(FWE_TEMPLATE.format(context=" ".join(text)), FWE_PREFIX, words[1:4])


# ------------------------------------------------------------------------------------------ prompts
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

    fit = _fit(tokens, budget, 5, None)
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


def _fit(measure: Callable[[int], int], budget: int, low: int, high: int | None) -> int | None:
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
    n = _fit_fwe(sizing, budget) if task == "fwe" else _fit(sizing, budget, low, high)
    fresh = sample_rng(task, seed, length, sample)
    measure = measuring(fresh)

    def too_short() -> RopeExtendError:
        return RopeExtendError(
            f"length {length} is too short for RULER task {task}: its smallest prompt already takes "
            f"{measure(low)} tokens of this tokenizer, and {generate} more are generated; use lengths >= "
            f"{measure(low) + generate}"
        )

    if n is None:
        raise too_short()
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
            raise too_short()
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


# ------------------------------------------------------------------------------------------ harness
@dataclass
class RulerResult:
    """Every sample's record and RULER's tables.

    ``accuracy[task][length]``: the mean sample score (a share); ``scores[task][length]``: RULER's number, that
    mean in percent rounded to 2 decimals; ``empty[task][length]``: the samples whose answer was empty after
    RULER's post-processing; ``average[length]``: the mean of ``scores`` over the tasks measured (percent; over
    ``tasks`` of them, never RULER's 13: see ``RULER_TASKS``); ``effective``: the effective lengths
    (``effective.EffectiveLength``) of ``average``."""

    records: list[dict]
    accuracy: dict[str, dict[int, float]] = field(default_factory=dict)
    scores: dict[str, dict[int, float]] = field(default_factory=dict)
    empty: dict[str, dict[int, int]] = field(default_factory=dict)
    average: dict[int, float] = field(default_factory=dict)
    tasks: int = 0
    effective: EffectiveLength | None = None


def tables(records: Sequence[dict]) -> dict[str, Any]:
    """From RULER records: ``accuracy``, ``scores``, ``empty`` (each task -> length -> value), ``average``
    (length -> the mean of the rounded task scores there, rounded to 2) and ``tasks`` (how many tasks there are).
    A length where some task was not measured gets no average: a mean over fewer tasks is another number."""
    by: dict[str, dict[int, list[dict]]] = {}
    for r in records:
        by.setdefault(r["ruler_task"], {}).setdefault(r["length"], []).append(r)
    accuracy, scores, empty = {}, {}, {}
    for task, lengths in by.items():
        rows = sorted(lengths.items())
        accuracy[task] = {n: sum(float(r["score"]) for r in rs) / len(rs) for n, rs in rows}
        scores[task] = {n: task_score([float(r["score"]) for r in rs]) for n, rs in rows}
        empty[task] = {n: sum(is_empty(r.get("output", "")) for r in rs) for n, rs in rows}
    lengths = sorted({n for t in scores.values() for n in t})
    average = {
        n: round(sum(t[n] for t in scores.values()) / len(scores), 2)
        for n in lengths
        if all(n in t for t in scores.values())
    }
    return {"accuracy": accuracy, "scores": scores, "empty": empty, "average": average, "tasks": len(scores)}


def average_label(tasks: int) -> str:
    """What an average is over: 'avg over 11 tasks; RULER's is over 13' (never comparable to RULER's own)."""
    word = "task" if tasks == 1 else "tasks"
    return f"avg over {tasks} {word}; RULER's is over {RULER_TASKS}"


def ruler(
    model,
    tokenizer,
    lengths: str | Iterable[Any],
    *,
    tasks: str | Iterable[str] | None = None,
    samples: int = 10,
    seed: int = 0,
    haystack: Sequence[str] | None = None,
    max_new_tokens: int | None = None,
    chat_template: bool = True,
    threshold: float = RULER_THRESHOLD,
    reference_length: int | None = None,
    keep: float = KEEP,
    records: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool = True,
    run: dict[str, Any] | None = None,
    sliding_window: str = "auto",
) -> RulerResult:
    """RULER accuracy of ``model`` for each of ``tasks`` (default: all eleven) at each of ``lengths``.

    ``samples`` prompts per task and length, each drawn from ``(seed, task, length, sample)`` only; a length
    counts the tokens to generate, as RULER's ``max_seq_length``. ``haystack``: texts for the essay tasks
    (default: the bundled held-out corpus). ``max_new_tokens`` replaces RULER's per-task generation budget (and
    so the prompt's share of the length). ``chat_template``: wrap the prompt in the tokenizer's chat template
    when it has one (RULER does for instruct models); False keeps RULER's ``base`` template.
    ``threshold``, ``reference_length`` and ``keep``: the effective lengths' (``effective.effective_lengths``).
    ``records``/``resume``/``run``/``sliding_window`` are the evaluation runner's (see ``evaluation.runner``).
    """
    lengths = parse_lengths(lengths)
    names = check_tasks(tasks)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise RopeExtendError(f"samples must be a positive integer, got {samples!r}")
    if max_new_tokens is not None and (
        isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1
    ):
        raise RopeExtendError(f"max_new_tokens must be a positive integer or None, got {max_new_tokens!r}")
    check_effective_options(threshold, reference_length, keep)
    retrieval.check_can_generate(model)
    fmt = PromptFormat(tokenizer, chat_template)
    budget = {t: max_new_tokens or GENERATE[t] for t in names}
    runner.check_reachable(model, max(lengths), cache=True)  # the length holds the generated tokens
    hay = Haystack(haystack)
    built: dict[tuple[str, int, int], RulerPrompt] = {}

    def prompt(task: str, length: int, sample: int) -> RulerPrompt:
        key = (task, length, sample)
        if key not in built:
            built[key] = build_prompt(
                tokenizer,
                task,
                length,
                seed=seed,
                sample=sample,
                haystack=hay,
                chat_template=fmt,
                max_new_tokens=budget[task],
            )
        return built[key]

    for task in names:  # a length a task cannot reach fails before any work
        for length in {min(lengths), max(lengths)}:
            prompt(task, length, 0)
    digest = hay.digest() if any(t in ESSAY for t in names) else None
    jobs = []
    for task in names:
        for length in lengths:
            for i in range(samples):
                job = {"ruler_task": task, "length": length, "sample": i, "max_new_tokens": budget[task]}
                if task in ESSAY:
                    job["haystack"] = digest
                jobs.append(job)

    def measure(job: dict) -> dict:
        task = job["ruler_task"]
        p = prompt(task, job["length"], job["sample"])
        built.pop((task, job["length"], job["sample"]), None)
        output = retrieval.greedy(model, tokenizer, p.input_ids, job["max_new_tokens"])
        got = score(task, output, p.answers)
        return {
            "answers": p.answers,
            "output": output,
            "score": got,
            "correct": got == 1.0,
            "units": p.units,
            "prompt_tokens": len(p),
        }

    setting = {"seed": seed, "protocol": "ruler-synthetic", "template": fmt.setting(), "words": ruler_words.digest()}
    done = runner.run(
        model,
        tokenizer=tokenizer,
        task="ruler",
        setting=setting,
        jobs=jobs,
        measure=measure,
        longest=max(lengths),
        records=records,
        resume=resume,
        progress=progress,
        run=run,
        sliding_window=sliding_window,
        cache=True,
        unit="sample",
        version=VERSION,
    )
    t = tables(done)
    eff = effective_lengths(t["average"], threshold=threshold, reference_length=reference_length, keep=keep)
    return RulerResult(done, t["accuracy"], t["scores"], t["empty"], t["average"], t["tasks"], eff)
