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

# The package's parts: ``subtasks`` (specs, templates, drafts), ``sizing`` (prompt format, haystack, RULER's sizing),
# ``scoring`` (metrics and tables) and ``harness`` (the ``ruler`` task: ``RulerOptions``, ``ruler()``, ``TASK``); every
# name is importable from here.
from ...errors import RopeExtendError
from .harness import RulerOptions, RulerResult, ruler
from .scoring import (
    average_label,
    is_empty,
    postprocess,
    score,
    string_match_all,
    string_match_part,
    tables,
    task_score,
)
from .sizing import (
    Haystack,
    PromptFormat,
    RulerPrompt,
    _draft_fn,  # noqa: F401 (private: the tests reach it here)
    _fit_fwe,  # noqa: F401 (private: the tests reach it here)
    build_prompt,
    largest_fitting,
    ruler_step,
    sample_rng,
)
from .subtasks import (
    CWE_PREFIX,
    CWE_TEMPLATE,
    DEPTHS,
    ESSAY,
    FWE_PREFIX,
    FWE_TEMPLATE,
    GENERATE,
    METRIC,
    NEEDLE,
    NIAH,
    NIAH_PREFIX,
    NIAH_TEMPLATE,
    NOISE,
    RULER_TASKS,
    TASKS,
    VERSION,
    VT_PREFIX,
    VT_TEMPLATE,
    ZETA2,
    Draft,
    Niah,
    check_tasks,
    fwe_counts,
    fwe_vocab,
)

__all__ = [
    "CWE_PREFIX",
    "CWE_TEMPLATE",
    "DEPTHS",
    "ESSAY",
    "FWE_PREFIX",
    "FWE_TEMPLATE",
    "GENERATE",
    "METRIC",
    "NEEDLE",
    "NIAH",
    "NIAH_PREFIX",
    "NIAH_TEMPLATE",
    "NOISE",
    "RULER_TASKS",
    "TASKS",
    "VERSION",
    "VT_PREFIX",
    "VT_TEMPLATE",
    "ZETA2",
    "Draft",
    "Haystack",
    "Niah",
    "PromptFormat",
    "RopeExtendError",
    "RulerOptions",
    "RulerPrompt",
    "RulerResult",
    "average_label",
    "build_prompt",
    "check_tasks",
    "fwe_counts",
    "fwe_vocab",
    "is_empty",
    "largest_fitting",
    "postprocess",
    "ruler",
    "ruler_step",
    "sample_rng",
    "score",
    "string_match_all",
    "string_match_part",
    "tables",
    "task_score",
]
