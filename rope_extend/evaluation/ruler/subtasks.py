"""RULER's own sub-tasks (``subtasks``, not to be read as rope-extend's evaluation tasks, ``evaluation.tasks``):
their specs and templates, and each one's draft: a sample as text (the user's turn, the answer prefix, the expected
strings), drawn from an RNG and a haystack size. The protocol is in ``evaluation.ruler``'s docstring."""

from __future__ import annotations

import math
import random
import string
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ...errors import RopeExtendError, closest
from .. import ruler_words
from ..prompts import split_sentences

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
    answers = [v for i in chosen for v in values[i]]
    return niah_question(context, spec.value, [keys[i] for i in chosen], answers)


def niah_question(context: str, kind: str, queries: Sequence[str], answers: list[str]) -> Draft:
    """RULER's niah question about ``context``: the ``kind`` (``"numbers"``, ...) for the keys ``queries``, in
    their order ("a, b, and c"), worded in the singular when one key has one value."""
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, prefix = NIAH_TEMPLATE, NIAH_PREFIX
    if len(answers) == 1:
        template, prefix, kind = _singular(template), _singular(prefix), kind[:-1]
    user = template.replace("{context}", "\0").format(kind=kind, query=query).replace("\0", context)
    return Draft(user, prefix.format(kind=kind, query=query), answers)


def niah_draft(task: str, rng: random.Random, n: int, words: Sequence[str] = ()) -> Draft:
    """One sample of the niah task ``task`` with ``n`` haystack units (noise lines, needle lines or essay words
    from ``words``), as the harness draws it: what the bundled model's RULER-format training examples use."""
    if task not in NIAH:
        raise RopeExtendError(f"unknown niah task {task!r}{closest(task, NIAH)}; allowed: {', '.join(NIAH)}")
    if n < 1:
        raise RopeExtendError(f"a niah sample needs at least 1 haystack unit, got {n}")
    return _niah(NIAH[task], rng, n, words)


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
