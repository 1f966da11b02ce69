"""The bundled model's text: synthetic, license-clean, reproducible offline from a seed.

Five kinds of document, all made here from word lists and templates:

- **Chronicles** with long-range structure: a town's ledger introduces people with facts (job, street,
  lucky number, a possession), then runs on with everyday narrative, and every so often *recalls* a
  fact stated earlier ("Mira Talbot, the baker from Elm Row, counted to 4821 again"). The recalled
  words can only be predicted by looking back, so a model that reads further predicts them better:
  perplexity on long chronicles measures whether the context is really used.
- **Passkey examples** in the evaluation protocol's exact words (rope_extend.evaluation.prompts), with
  the key at a uniform random depth and the answer after the question. The filler varies (the
  protocol's own, chronicle sentences with their names and numbers, random corpus words, random
  non-words), so retrieval has to come from reading the key, not from knowing the filler.
- **Associative recall**: several "The code of NAME is NUMBER." lines in filler, then questions about
  some of them: the answer is found only by matching the name.
- **Needle questions**: a chronicle with one odd sentence ("The secret word of Oakridge is lantern.")
  and a question about it at the end.
- **Copy drills**: a list of words, non-words or numbers, then the list again; short ones, in a short
  window, are what first forms the induction heads (recipes/bundled-pretrain.yaml).

``bundled.mix.training_documents(seed, n)`` mixes them (and RULER's needle tasks) for pretraining;
``evaluation_documents(seed, n, words)`` makes long held-out chronicles (a different seed stream). Same
seed, same text, on any machine: only Python's ``random.Random`` with an explicit seed is used.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from ..evaluation.prompts import FILLER, KEY_LINE, QUESTION, TASK

FIRST = [
    "Mira",
    "Tomas",
    "Ada",
    "Bruno",
    "Celia",
    "Dario",
    "Elena",
    "Felix",
    "Greta",
    "Hugo",
    "Ines",
    "Jonas",
    "Karla",
    "Leon",
    "Maya",
    "Nico",
    "Olga",
    "Pavel",
    "Rosa",
    "Stefan",
    "Tilda",
    "Ugo",
    "Vera",
    "Walter",
    "Yara",
    "Zeno",
    "Alma",
    "Boris",
    "Clara",
    "Emil",
    "Frida",
    "Gustav",
    "Hanna",
    "Ivo",
    "Julia",
    "Kasper",
]
LAST = [
    "Talbot",
    "Reyes",
    "Holm",
    "Varga",
    "Lindqvist",
    "Moreau",
    "Okafor",
    "Petrov",
    "Quint",
    "Santos",
    "Ueda",
    "Weber",
    "Novak",
    "Castell",
    "Brandt",
    "Fischer",
    "Ivers",
    "Kowal",
    "Marsh",
    "Oyelaran",
]
TOWNS = [
    "Oakridge",
    "Millbrook",
    "Stonehaven",
    "Larkfield",
    "Westmere",
    "Ashby",
    "Fernvale",
    "Redcliff",
    "Brightwater",
    "Hollowmere",
    "Kingsford",
    "Dunmore",
]
JOBS = [
    "baker",
    "smith",
    "weaver",
    "miller",
    "potter",
    "carpenter",
    "fisher",
    "tailor",
    "cooper",
    "mason",
    "glassblower",
    "bookbinder",
    "gardener",
    "clockmaker",
    "shepherd",
    "brewer",
]
STREETS = [
    "Elm Row",
    "Mill Lane",
    "Harbour Street",
    "Chapel Hill",
    "Orchard Way",
    "Bridge Street",
    "Wheel Yard",
    "Kiln Road",
    "Market Square",
    "Willow Walk",
    "Gate Street",
    "Fern Close",
]
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "silver", "golden", "brown", "grey"]
THINGS = [
    "lantern",
    "kettle",
    "violin",
    "compass",
    "ladder",
    "wagon",
    "bell",
    "map",
    "clock",
    "boat",
    "hammer",
    "basket",
    "mirror",
    "drum",
    "key",
    "coat",
]
PLACES = [
    "market",
    "river",
    "mill",
    "chapel",
    "harbour",
    "bakery",
    "orchard",
    "square",
    "bridge",
    "forest",
    "library",
    "workshop",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
WEATHER = ["cold", "warm", "windy", "grey", "bright", "wet", "foggy", "still"]
WORDS = [
    "lantern",
    "harvest",
    "meadow",
    "thimble",
    "anchor",
    "saffron",
    "pebble",
    "cinder",
    "velvet",
    "quill",
    "marble",
    "juniper",
    "copper",
    "ember",
    "walnut",
    "tundra",
]

NARRATIVE = [
    "On {day} the weather in {town} was {weather}.",
    "{a} walked to the {place} with {b}.",
    "{a} and {b} talked for a long time near the {place}.",
    "The {place} was busy, and {a} waited by the door.",
    "Later that day {a} mended a {thing} for a neighbour.",
    "{a} bought bread at the market and went home early.",
    "Nobody in {town} remembered a {weather} day like that one.",
    "{a} wrote a letter to {b} and sent it before noon.",
    "Children ran along {street} while the bells rang.",
    "{a} spent the evening reading by the fire.",
]
RECALL = [
    "{name}, the {job} from {street}, passed by the {place}.",
    "{name} still lives on {street}.",
    "{name} counted to {number} again, as always.",
    "Everyone knows that the lucky number of {name} is {number}.",
    "{name} carried the {colour} {thing} through {town}.",
    "The {job} {name} was seen near the {place}.",
]


@dataclass(frozen=True)
class Person:
    name: str
    job: str
    street: str
    number: int
    colour: str
    thing: str

    def introduction(self) -> str:
        return (
            f"{self.name} is a {self.job} who lives on {self.street}. The lucky number of {self.name} is "
            f"{self.number}. {self.name} owns a {self.colour} {self.thing}."
        )


def _people(rng: random.Random, count: int) -> list[Person]:
    names = rng.sample([f"{f} {l}" for f in FIRST for l in LAST], count)
    return [
        Person(n, rng.choice(JOBS), rng.choice(STREETS), rng.randint(10, 9999), rng.choice(COLOURS), rng.choice(THINGS))
        for n in names
    ]


def chronicle(rng: random.Random, words: int, *, recall_rate: float = 0.35) -> str:
    """A chronicle of about ``words`` words: introductions first, then narrative with recalled facts.

    New people are introduced along the way too, so facts are recalled from every distance."""
    town = rng.choice(TOWNS)
    people = _people(rng, rng.randint(3, 6))
    parts = [f"This is the chronicle of {town}."] + [p.introduction() for p in people]
    count = sum(len(p.split()) for p in parts)
    while count < words:
        if rng.random() < 0.04 and len(people) < 40:
            person = _people(rng, 1)[0]
            if all(person.name != p.name for p in people):
                people.append(person)
                sentence = person.introduction()
            else:
                continue
        elif rng.random() < recall_rate:
            p = rng.choice(people)
            sentence = rng.choice(RECALL).format(
                name=p.name,
                job=p.job,
                street=p.street,
                number=p.number,
                colour=p.colour,
                thing=p.thing,
                town=town,
                place=rng.choice(PLACES),
            )
        else:
            a, b = rng.sample(people, 2)
            sentence = rng.choice(NARRATIVE).format(
                day=rng.choice(DAYS),
                town=town,
                weather=rng.choice(WEATHER),
                a=a.name,
                b=b.name,
                place=rng.choice(PLACES),
                thing=rng.choice(THINGS),
                street=rng.choice(STREETS),
            )
        parts.append(sentence)
        count += len(sentence.split())
    return " ".join(parts)


CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"


def pseudo_word(rng: random.Random) -> str:
    """A pronounceable non-word of one to three syllables (``"kemirad"``): text the model cannot know, whose
    tokens split into fragments the way words outside its corpus do."""
    syllables = [rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(rng.randint(1, 3))]
    return "".join(syllables) + (rng.choice(CONSONANTS) if rng.random() < 0.5 else "")


def _sentence(words: list[str]) -> str:
    return " ".join([words[0].capitalize()] + words[1:]) + "."


FILLERS = ("standard", "chronicle", "words", "pseudo")
# rough tokens per filler sentence of each kind in the bundled tokenizer, to size examples to a window
FILLER_TOKENS = {"standard": 5, "chronicle": 13, "words": 8, "pseudo": 17}


def haystack_sentences(rng: random.Random, kind: str, n: int) -> list[str]:
    """``n`` sentences of haystack of one kind: ``standard`` (the protocol's filler, from a random sentence
    on), ``chronicle`` (a run of chronicle sentences, with their names and numbers as distractors),
    ``words`` (random corpus words) or ``pseudo`` (random non-words). Varied filler makes retrieval come
    from reading the key rather than from knowing the text around it."""
    if kind == "standard":
        sentences = [s if s.endswith(".") else s + "." for s in FILLER.split(". ")]
        start = rng.randrange(len(sentences))  # evaluation prompts cut the filler anywhere
        return [sentences[(start + i) % len(sentences)] for i in range(n)]
    if kind == "chronicle":
        text = chronicle(rng, 14 * n + 40).split(". ")
        start = rng.randint(0, max(0, len(text) - n))
        return [s if s.endswith(".") else s + "." for s in text[start : start + n]]
    if kind == "words":
        return [_sentence(rng.sample(VOCABULARY, rng.randint(3, 8))) for _ in range(n)]
    if kind == "pseudo":
        return [_sentence([pseudo_word(rng) for _ in range(rng.randint(3, 7))]) for _ in range(n)]
    raise ValueError(f"filler kind must be one of {FILLERS}, got {kind!r}")


def passkey_example(
    rng: random.Random, filler_sentences: int, *, max_key: int = 99999, filler: str = "standard"
) -> str:
    """The passkey protocol's prompt with ``filler_sentences`` filler sentences of kind ``filler`` (see
    ``haystack_sentences``), the key at a uniform random depth, and the answer:
    ``... What is the pass key? The pass key is 4821.``"""
    sentences = haystack_sentences(rng, filler, filler_sentences)
    cut = rng.randint(0, filler_sentences)
    key = rng.randint(1, max_key)
    parts = [TASK, " ".join(sentences[:cut]), KEY_LINE.format(key=key), " ".join(sentences[cut:]), f"{QUESTION} {key}."]
    return "\n".join(p for p in parts if p)


def recall_example(rng: random.Random, facts: int, filler_sentences: int, *, queries: int = 3) -> str:
    """Associative recall: ``facts`` lines "The code of NAME is NUMBER." scattered through filler, then
    ``queries`` questions about some of them, each answered. Several numbers stand in the text, so the
    answer is found only by matching the name: content lookup, which is what induction heads do."""
    people = rng.sample([f"{f} {l}" for f in FIRST for l in LAST], facts)
    codes = [rng.randint(1, 99999) for _ in people]
    sentences = haystack_sentences(rng, rng.choice(FILLERS), filler_sentences)
    slots = sorted(rng.choices(range(len(sentences) + 1), k=facts))
    parts, last = [], 0
    for slot, name, code in zip(slots, people, codes, strict=True):
        parts += sentences[last:slot] + [f"The code of {name} is {code}."]
        last = slot
    parts += sentences[last:]
    asked = rng.sample(range(facts), min(queries, facts))
    questions = [f"What is the code of {people[i]}? The code of {people[i]} is {codes[i]}." for i in asked]
    return " ".join(parts) + "\n" + " ".join(questions)


def needle_example(rng: random.Random, words: int) -> str:
    """A short chronicle with one secret-word sentence at a random point and a question about it."""
    town = rng.choice(TOWNS)
    word = rng.choice(WORDS)
    text = chronicle(rng, words).split(". ")
    at = rng.randint(1, max(1, len(text) - 1))
    text.insert(at, f"The secret word of {town} is {word}")
    return ". ".join(text) + f"\nWhat is the secret word of {town}? The secret word of {town} is {word}."


VOCABULARY = sorted(set(FIRST + LAST + TOWNS + JOBS + COLOURS + THINGS + PLACES + DAYS + WEATHER + WORDS))
DRILLS = ("words", "pseudo", "numbers", "fragments")
DRILL_TOKENS = {"words": 1.0, "pseudo": 3.2, "numbers": 6.0, "fragments": 1.6}  # rough tokens per item
# every word the templates use, for fragments: word starts the tokenizer knows, in orders it never saw
_TEMPLATE_TEXT = " ".join(
    NARRATIVE + RECALL + [TASK, FILLER, KEY_LINE, QUESTION, Person("", "", "", 0, "", "").introduction()]
)
_TEMPLATE_WORDS = sorted(set(re.findall(r"[A-Za-z]{2,}", _TEMPLATE_TEXT)))


def copy_drill(rng: random.Random, items: int, *, kind: str = "words") -> str:
    """A list of items, then the same list again: the plainest long-range copying. Items are corpus words,
    non-words (several tokens each, as unfamiliar words are), numbers (copied digit by digit, as a pass key
    is) or fragments (the first letters of corpus words: tokens the model knows, in an order that its
    knowledge of the text cannot predict, so only the copy can). Half the drills are cued ("Read this list:
    ... Now the list again: ..."), half are the bare repetition, so copying does not wait for a cue. Drills
    teach induction (find where the current token stood before and copy what followed) far faster than
    passkeys do, whose digits repeat: with repeated tokens a one-token look-back is ambiguous."""
    if kind == "words":
        items_ = rng.sample(VOCABULARY, min(items, len(VOCABULARY)))
    elif kind == "pseudo":
        items_ = [pseudo_word(rng) for _ in range(items)]
    elif kind == "numbers":
        items_ = [str(rng.randint(1, 99999)) for _ in range(items)]
    elif kind == "fragments":
        items_ = [w[: rng.randint(2, len(w))] for w in rng.choices(VOCABULARY + _TEMPLATE_WORDS, k=items)]
    else:
        raise ValueError(f"drill kind must be one of {DRILLS}, got {kind!r}")
    text = " ".join(items_)
    if rng.random() < 0.5:
        return f"Read this list: {text}. Now the list again: {text}."
    return f"{text} {text}"


def evaluation_documents(seed: int = 1_000_003, n: int = 8, words: int = 5000) -> list[str]:
    """Long held-out chronicles (a seed stream the training data does not use)."""
    rng = random.Random(seed)
    return [chronicle(rng, words) for _ in range(n)]
