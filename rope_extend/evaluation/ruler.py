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
``adjective-noun`` words, 7-digit numbers or UUIDs, as RULER draws them; needles go at depths drawn from 40
evenly spaced ones (essay) or at random lines (noise, needles). With one key and one value the template is
put in the singular, as RULER does. The prompt ends with the task's answer prefix (RULER's ``base`` model
template: no chat markup), and greedy decoding continues it for RULER's ``tokens_to_generate`` (niah 128,
vt 30, cwe 120, fwe 50).

**Length.** A prompt is built to exactly ``length`` tokens of the model's tokenizer: the number of haystack
units (sentences, needles, words) is the largest that fits (found by doubling then bisection on the
tokenized prompt, as RULER's binary search), and the few tokens still missing are filled with the task's
neutral filler (the noise sentence, the essay's next words, or fwe's dots) right after the context. RULER
counts the generated tokens into its ``max_seq_length``; here the length is the prompt's, as for passkey.
cwe uses RULER's short-context counts (common words 6 times, others once; the example 3 and 1) below 4096
tokens and 30 / 3 from 4096 on; fwe's coded vocabulary has ``length // 50`` words. vt's worked example is
built to 500 tokens (RULER's) or a quarter of the length when that is shorter.

**Scoring.** RULER's ``string_match_all``: the share of the expected strings found (case-insensitive) in
the output, control characters turned into newlines and the output stripped. A task's accuracy at a length
is the mean over samples; the average is the mean over tasks.

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
from . import retrieval, runner
from .data import default_texts, parse_lengths
from .prompts import encode, split_sentences
from .records import short_hash
from .ruler_words import ADJECTIVES, NOUNS, VERBS

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER: np.linspace(0, 100, 40), rounded

NIAH_TEMPLATE = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the {kind} afterwards.\n{context}\nWhat are all the special magic {kind} for {query} mentioned in the "
    "provided text?"
    " The special magic {kind} for {query} mentioned in the provided text are"
)
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assigned the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
    " Answer: The top 10 words that appear most often in the list are:"
)
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
    " Answer: According to the coded text above, the three most frequently appeared words are:"
)


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
GENERATE = {**{t: 128 for t in NIAH}, "vt": 30, "cwe": 120, "fwe": 50}  # RULER's tokens_to_generate
ESSAY = tuple(t for t, spec in NIAH.items() if spec.haystack == "essay")


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


def string_match_all(output: str, answers: Sequence[str]) -> float:
    """The share of ``answers`` that occur in ``output`` (case-insensitive): RULER's ``string_match_all``."""
    if not answers:
        raise RopeExtendError("string_match_all needs at least one expected string")
    pred = postprocess(output).lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


# ------------------------------------------------------------------------------------------ samples
@dataclass
class Draft:
    """A sample as text: ``head`` (instructions, examples, the context), ``tail`` (question and answer
    prefix), the expected strings, and the neutral text that fills the last few tokens."""

    head: str
    tail: str
    answers: list[str]
    pad: str


def _split(template: str, **values) -> tuple[str, str]:
    before, after = template.split("{context}")
    return before.format(**values), after.format(**values)


def _singular(template: str) -> str:
    """RULER's edits for one key with one value: 'Some ... are' -> 'A ... is'."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        template = template.replace(old, new)
    return template


def _draw(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
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
        pad = " " + " ".join(words[n : n + 256])
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
        pad = " " + NOISE
    chosen = rng.sample(range(n_keys), spec.queries)
    queries = [keys[i] for i in chosen]
    answers = [v for i in chosen for v in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, kind = NIAH_TEMPLATE, spec.value
    if spec.queries * spec.values == 1:
        template, kind = _singular(template), kind[:-1]
    head, tail = _split(template, kind=kind, query=query)
    return Draft(head + context, tail, answers, pad)


def _names(rng: random.Random, count: int, letters: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    return names


def _vt_text(rng: random.Random, n: int, *, hops: int = 4, letters: int = 5) -> tuple[str, list[str]]:
    """One chain of ``hops`` assignments hidden among ``n`` noise sentences: the full prompt text (answer
    prefix included) and the chain's variables."""
    names = _names(rng, hops + 1, letters)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    lines = [NOISE] * n
    for j, at in enumerate(sorted(rng.sample(range(n), len(chain)))):
        lines.insert(at + j, chain[j])
    context = "\n".join(lines).replace(". \n", ".\n")
    return VT_TEMPLATE.format(context=context, query=value, num_v=hops + 1), names


def _vt(rng: random.Random, n: int, example_units: int) -> Draft:
    example, names = _vt_text(rng, example_units, letters=3)  # RULER's worked example: 3-letter names
    text, answers = _vt_text(rng, n)
    cut = text.index("\nQuestion: Find all")
    head, tail = text[:cut], text[cut:]
    return Draft(example + " " + " ".join(names) + "\n" + head, tail, answers, " " + NOISE)


_POOL: list[str] = []


def word_pool(size: int) -> list[str]:
    """RULER's cwe words: the plain word list, extended (past its length) by pronounceable made-up words, as
    RULER falls back to a larger dictionary; deterministic."""
    if not _POOL:
        _POOL.extend(sorted(set(NOUNS + ADJECTIVES + VERBS)))
        random.Random("ruler-cwe-words").shuffle(_POOL)
    if size > len(_POOL):
        rng = random.Random(f"ruler-cwe-words:{len(_POOL)}")
        seen = set(_POOL)
        while len(_POOL) < size:
            word = "".join(rng.choice("bcdfghjklmnprstvz") + rng.choice("aeiou") for _ in range(3))
            if word not in seen:
                seen.add(word)
                _POOL.append(word)
    return _POOL


def _cwe_list(rng: random.Random, n: int, common: int, rare: int) -> tuple[str, list[str]]:
    pool = word_pool(n)
    plain = len(set(NOUNS + ADJECTIVES + VERBS))  # the pool starts with the plain words
    chosen = rng.sample(pool[:plain] if n <= plain else pool, n)
    top = chosen[:10]
    items = top * common + chosen[10:] * rare
    rng.shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), top


def _cwe(rng: random.Random, n: int, length: int) -> Draft:
    short = length < 4096
    example, top = _cwe_list(rng, 20, 3, 1) if short else _cwe_list(rng, 40, 10, 3)
    shot = CWE_TEMPLATE.format(context=example) + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(top))
    context, answers = _cwe_list(rng, n, 6, 1) if short else _cwe_list(rng, n, 30, 3)
    head, tail = _split(CWE_TEMPLATE)
    return Draft(shot + "\n" + head + context, tail, answers, " ...." * 64)


ZETA2 = math.pi**2 / 6  # RULER's zeta(alpha) at its alpha = 2


def fwe_counts(n: int, vocab: int) -> list[int]:
    """How often the k-th coded word occurs (k = 1..vocab): ``int(n * k**-2 / zeta(2))``."""
    return [int(n * k**-2 / ZETA2) for k in range(1, vocab + 1)]


def _fwe(rng: random.Random, n: int, length: int) -> Draft:
    size = max(5, length // 50)
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    words = sorted(vocab)
    rng.shuffle(words)
    words[0] = "..."  # the most frequent is noise
    text = [w for w, c in zip(words, fwe_counts(n, size), strict=True) for _ in range(c)]
    rng.shuffle(text)
    head, tail = _split(FWE_TEMPLATE)
    return Draft(head + " ".join(text), tail, words[1:4], " ...." * 64)


# ------------------------------------------------------------------------------------------ prompts
@dataclass(frozen=True)
class RulerPrompt:
    task: str
    input_ids: list[int]
    answers: list[str]
    units: int  # haystack units (sentences, needles, list items, words)
    pad_tokens: int  # neutral filler tokens added to reach the exact length

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
    """Noise sentences in vt's worked example: the most that keep it within ``budget`` tokens (at least 5,
    RULER's smallest step)."""

    def tokens(m: int) -> int:
        return len(encode(tokenizer, _vt_text(random.Random("ruler-vt-example"), m, letters=3)[0]))

    fit = _fit(tokens, budget, 5, None)
    return fit if fit is not None else 5


def _draft_fn(task: str, length: int, haystack: Haystack, tokenizer) -> tuple[Callable[..., Draft], int, int | None]:
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
        return (lambda rng, n: _cwe(rng, n, length)), 10, None
    return (lambda rng, n: _fwe(rng, n, length)), 1, None


def _fit(measure: Callable[[int], int], budget: int, low: int, high: int | None) -> int | None:
    """The largest ``n`` in ``[low, high]`` with ``measure(n) <= budget`` (doubling, then bisection, as RULER's
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


def build_prompt(
    tokenizer, task: str, length: int, *, seed: int = 0, sample: int = 0, haystack: Haystack | None = None
) -> RulerPrompt:
    """The ``sample``-th prompt of ``task``, exactly ``length`` tokens of ``tokenizer``.

    The head (with the tokenizer's special tokens, a BOS if it adds one), the neutral filler and the tail are
    tokenized apart and joined, so the length is exact for any tokenizer."""
    haystack = haystack or Haystack(None)
    draft_fn, low, high = _draft_fn(task, length, haystack, tokenizer)
    fresh = sample_rng(task, seed, length, sample)

    def parts(n: int) -> tuple[list[int], list[int], Draft]:
        draft = draft_fn(fresh(), n)
        return encode(tokenizer, draft.head, special=True), encode(tokenizer, draft.tail), draft

    def measure(n: int) -> int:
        head, tail, _ = parts(n)
        return len(head) + len(tail)

    n = _fit(measure, length, low, high)
    if n is None:
        raise RopeExtendError(
            f"length {length} is too short for RULER task {task}: its smallest prompt already takes "
            f"{measure(low)} tokens of this tokenizer; use lengths >= {measure(low)}"
        )
    head, tail, draft = parts(n)
    gap = length - len(head) - len(tail)
    if high is not None and n == high and gap > 0:
        raise RopeExtendError(
            f"the essay haystack ({high} words) cannot reach length {length} for RULER task {task}: with all its "
            f"words the prompt has {length - gap} tokens; give longer texts (--data) or shorter lengths"
        )
    if task == "fwe":
        counts = fwe_counts(n, max(5, length // 50))
        if not counts[1] > counts[2] > counts[3] > counts[4]:
            raise RopeExtendError(
                f"length {length} is too short for RULER task fwe: {n} coded words give the three most frequent "
                f"counts {counts[1:4]} and the next {counts[4]}, so the answer is not unique; use a longer length"
            )
    pad: list[int] = []
    while len(pad) < gap:
        pad += encode(tokenizer, draft.pad)
    ids = head + pad[:gap] + tail
    if len(ids) != length:  # the construction guarantees it; a wrong length would make the table a lie
        raise RopeExtendError(f"internal error: built a {len(ids)}-token RULER prompt for length {length}")
    return RulerPrompt(task, ids, list(draft.answers), n, gap)


# ------------------------------------------------------------------------------------------ harness
@dataclass
class RulerResult:
    """Every sample's record; ``accuracy[task][length]`` (mean string_match_all) and ``average[length]``
    (the mean over tasks)."""

    records: list[dict]
    accuracy: dict[str, dict[int, float]] = field(default_factory=dict)
    average: dict[int, float] = field(default_factory=dict)


def tables(records: Sequence[dict]) -> tuple[dict[str, dict[int, float]], dict[int, float]]:
    scores: dict[str, dict[int, list[float]]] = {}
    for r in records:
        scores.setdefault(r["ruler_task"], {}).setdefault(r["length"], []).append(float(r["score"]))
    accuracy = {t: {n: sum(v) / len(v) for n, v in sorted(by.items())} for t, by in scores.items()}
    lengths = sorted({n for by in accuracy.values() for n in by})
    average = {
        n: sum(by[n] for by in accuracy.values() if n in by) / sum(1 for by in accuracy.values() if n in by)
        for n in lengths
    }
    return accuracy, average


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
    records: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool = True,
    run: dict[str, Any] | None = None,
    sliding_window: str = "auto",
) -> RulerResult:
    """RULER accuracy of ``model`` for each of ``tasks`` (default: all eleven) at each of ``lengths``.

    ``samples`` prompts per task and length, each drawn from ``(seed, task, length, sample)`` only.
    ``haystack``: texts for the essay tasks (default: the bundled held-out corpus). ``max_new_tokens``
    replaces RULER's per-task generation budget. ``records``/``resume``/``run``/``sliding_window`` are the
    evaluation runner's (see ``evaluation.runner``).
    """
    lengths = parse_lengths(lengths)
    names = check_tasks(tasks)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise RopeExtendError(f"samples must be a positive integer, got {samples!r}")
    if max_new_tokens is not None and (
        isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1
    ):
        raise RopeExtendError(f"max_new_tokens must be a positive integer or None, got {max_new_tokens!r}")
    retrieval.check_can_generate(model)
    budget = {t: max_new_tokens or GENERATE[t] for t in names}
    runner.check_reachable(model, max(lengths), cache=True, generated=max(budget.values()))
    hay = Haystack(haystack)
    built: dict[tuple[str, int, int], RulerPrompt] = {}

    def prompt(task: str, length: int, sample: int) -> RulerPrompt:
        key = (task, length, sample)
        if key not in built:
            built[key] = build_prompt(tokenizer, task, length, seed=seed, sample=sample, haystack=hay)
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
        p = prompt(job["ruler_task"], job["length"], job["sample"])
        built.pop((job["ruler_task"], job["length"], job["sample"]), None)
        output = retrieval.greedy(model, tokenizer, p.input_ids, job["max_new_tokens"])
        score = string_match_all(output, p.answers)
        return {
            "answers": p.answers,
            "output": output,
            "score": score,
            "correct": score == 1.0,
            "units": p.units,
            "pad_tokens": p.pad_tokens,
        }

    done = runner.run(
        model,
        tokenizer=tokenizer,
        task="ruler",
        setting={"seed": seed, "protocol": "ruler-synthetic"},
        jobs=jobs,
        measure=measure,
        longest=max(lengths),
        generated=max(budget.values()),
        records=records,
        resume=resume,
        progress=progress,
        run=run,
        sliding_window=sliding_window,
        cache=True,
        unit="sample",
    )
    accuracy, average = tables(done)
    return RulerResult(done, accuracy, average)
