"""The cells of the combination matrix, generated from the registries, and every rule for a cell that is not run.

A cell is (shape, attention implementation, variant, cache, mode):

- shapes (``SHAPES``): a plain Llama, a Gemma 3 (local sliding layers and global layers), Cohere 2 (a NoPE hybrid:
  sliding RoPE layers and global NoPE layers) and DeepSeek-V3 (MLA: a compressed cache, keys [nope | rope]), tiny
  (64 wide, head_dim 16, 2-4 layers), trained length ``L`` = 32, sliding windows 16, fixed seed;
- implementations: eager, sdpa, flex_attention (a sample of caches: ``FLEX_RULE``);
- variants (``variants()``): ``none`` (the unpatched model, the control), every method of rope-extend's registry
  (a method registered later joins by itself), and log-n (``logn=True``) on the registry's first attention method
  and on its first static frequency method;
- caches (``caches()``): none, every ``cache_implementation`` of transformers' ``ALL_CACHE_IMPLEMENTATIONS``, a
  ``DynamicCache()`` and a ``StaticCache(config, max_cache_len=64)`` made by the caller, and rope-extend's
  ``SinkCache`` twice: roomy (4 sinks + 96, never evicts here) and evicting (4 sinks + 40);
- modes: ``forward`` (one forward over 56 tokens), ``greedy`` (12 tokens after a 40-token prompt), ``continue``
  (8 tokens, then ``generate`` again on the output plus 4 new tokens with the returned cache, 8 more), ``beam``
  (2 beams, 8 tokens), ``compile`` (greedy, 8 tokens, ``generate(cache_implementation="static",
  compile_config=...)``: transformers compiles the decoding forward with inductor, on the CPU too; a sample of
  cells: ``COMPILE_RULE``).

The parameters put every method's special positions inside these lengths: the sequences pass ``L`` (dynamic
methods change frequencies on the way, log-n scales queries past it), the sliding windows and the sinks' capacity;
Self-Extend's window 8, ReRoPE's 8, Dual Chunk's chunks of 20 (three kinds of chunk), STRING's offset 12
(``tests.test_attention.METHODS``); the frequency methods at factor 4.

``not_applicable`` and ``not_run`` hold every rule for a cell that is not run, each with its reason, in this one
place; the table reports those cells with the reason (none is dropped). One more rule is applied when the matrix
runs (``run.outcome``): ``CONTROL_RULE``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS, ALL_STATIC_CACHE_IMPLEMENTATIONS

import rope_extend
from tests.test_attention import METHODS as ATTENTION_PARAMS

SHAPES = ("llama", "gemma3", "cohere2", "deepseek_v3")
IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention")
MODES = ("forward", "greedy", "continue", "beam", "compile")
L = 32  # every shape's trained length (max_position_embeddings)
WINDOW = 16  # the sliding window of the shapes that have one
FACTOR = 4  # the frequency methods'

PROMPT, NEW = 40, 12  # greedy: 40 + 12 tokens
FORWARD = 56  # one forward
FIRST, EXTRA, SECOND = 8, 4, 8  # continue: 40 + 8, then 4 new tokens, then 8 more (60 tokens)
BEAMS, BEAM_NEW = 2, 8
COMPILE_NEW = 8
MAX_CACHE = 64  # the static caches' length: every sequence above fits
SINKS, ROOMY, EVICTING = 4, 96, 40  # SinkCache windows: 100 slots hold every sequence; 44 evict in every mode

USER_DYNAMIC, USER_STATIC = "DynamicCache()", "StaticCache()"
SINK_ROOMY, SINK_EVICTING = f"SinkCache({SINKS}+{ROOMY})", f"SinkCache({SINKS}+{EVICTING})"


@dataclass(frozen=True)
class Cell:
    shape: str
    implementation: str
    variant: str
    cache: str
    mode: str

    @property
    def id(self) -> str:
        return f"{self.shape}-{self.implementation}-{self.variant}-{self.cache}-{self.mode}"

    @property
    def method(self) -> str | None:
        """The registry method (None for the control)."""
        name = self.variant.removesuffix("+logn")
        return None if name == "none" else name

    @property
    def logn(self) -> bool:
        return self.variant.endswith("+logn")

    def replace(self, **changes) -> Cell:
        return Cell(**{**self.__dict__, **changes})


def kind(variant: str) -> str:
    """``none``, ``static`` or ``dynamic`` (frequency methods), ``attention`` (attention methods, and log-n on any
    method: both change attention itself, and their reference is the explicit one)."""
    name = variant.removesuffix("+logn")
    if name == "none":
        return "none"
    method = rope_extend.get_method(name)
    if method.attention or variant.endswith("+logn"):
        return "attention"
    return "dynamic" if method.dynamic else "static"


def _first(of_kind: str) -> str:
    return next(name for name in rope_extend.method_names() if kind(name) == of_kind)


def variants() -> list[str]:
    names = rope_extend.method_names()
    return ["none", *names, f"{_first('attention')}+logn", f"{_first('static')}+logn"]


def caches() -> list[str]:
    return ["none", *ALL_CACHE_IMPLEMENTATIONS, USER_DYNAMIC, USER_STATIC, SINK_ROOMY, SINK_EVICTING]


def params(variant: str) -> dict:
    """The patch arguments of a variant (``run.patch_arguments`` adds LongRoPE's per-frequency factors, which
    depend on the shape's rotary dimension)."""
    name = variant.removesuffix("+logn")
    extra = {"logn": True} if variant.endswith("+logn") else {}
    if kind(name) == "attention":
        return {**ATTENTION_PARAMS.get(name, {}), **extra}  # a new attention method: its defaults
    return {"factor": FACTOR, **extra}


def _quantized_backend() -> str | None:
    for module in ("optimum.quanto", "hqq"):
        try:
            if importlib.util.find_spec(module) is not None:
                return module
        except ModuleNotFoundError:  # optimum itself is missing
            continue
    return None


# ------------------------------------------------------------------------------------------------------ the rules
# (applies, reason): a cell that one of these matches is "not applicable" with the first matching reason
NOT_APPLICABLE = (
    (
        lambda c: c.mode == "forward" and c.cache in ALL_CACHE_IMPLEMENTATIONS,
        (
            "cache_implementation is an argument of generate; a forward is given a cache object (the "
            "DynamicCache() and StaticCache() columns)"
        ),
    ),
    (lambda c: c.mode == "continue" and c.cache == "none", "continuing needs the cache the first generate returns"),
    (
        lambda c: c.mode == "compile" and c.cache != "static",
        (
            'compiled decoding is generate(cache_implementation="static", compile_config=...): the static cache, '
            "the one transformers compiles with"
        ),
    ),
    (
        lambda c: c.cache == "quantized" and _quantized_backend() is None,
        "the quantized cache needs optimum-quanto or hqq, and the matrix installs no extra package",
    ),
    (
        lambda c: c.mode == "beam" and c.cache == SINK_EVICTING,
        (
            "an evicting SinkCache has no uncached reference (its kept keys were computed while the dropped "
            "tokens were visible); its reference here is its own token-by-token forwards, which do not reorder "
            "beams; the roomy SinkCache column checks beam search"
        ),
    ),
)

# The compiled cells (10-40 s of inductor each on the CPU, and an attention method's decode steps recompile until
# torch._dynamo's recompile limit) are a sample, stated here: on sdpa, the control and the registry's first method
# of each kind on the plain Llama, and the first attention method on every other shape.
COMPILE_RULE = (
    "compiled cells: sdpa; every variant on llama; the first static, dynamic and attention method of the registry "
    "on the other shapes"
)


def _compiled(cell: Cell) -> bool:
    if cell.implementation != "sdpa":
        return False
    if cell.shape == SHAPES[0]:
        return True
    return cell.variant in (_first("static"), _first("dynamic"), _first("attention"))


# Applied at run time (run.outcome): when the same cell with no method and a transformers cache (``control``) crashes
# inside transformers or is off the reference (no rope-extend code runs there), the cell is "not applicable" too: a
# combination transformers itself cannot run, or runs wrong.
CONTROL_RULE = "transformers fails here without rope-extend"


def control(cell: Cell) -> Cell:
    """The control of a cell: no method; a SinkCache (rope-extend's) stands for the DynamicCache it extends."""
    cache = USER_DYNAMIC if cell.cache in (SINK_ROOMY, SINK_EVICTING) else cell.cache
    return cell.replace(variant="none", cache=cache)


def not_applicable(cell: Cell) -> str | None:
    return next((why for applies, why in NOT_APPLICABLE if applies(cell)), None)


# transformers compiles FlexAttention (torch.compile) on its first calls with each new shape, 5-20 s each on the CPU,
# and runs it uncompiled past torch._dynamo's recompile limit, 5x slower than sdpa: its column is a sample too.
FLEX_CACHES = ("none", USER_DYNAMIC, USER_STATIC)
FLEX_RULE = (
    "flex_attention cells: every variant and mode with no cache, a DynamicCache() and a StaticCache() (the dynamic "
    "and the static key length, what FlexAttention's block mask depends on); the other caches run on eager and sdpa"
)


def not_run(cell: Cell) -> str | None:
    """Cells left out for cost, by ``COMPILE_RULE`` and ``FLEX_RULE``."""
    if cell.mode == "compile" and not _compiled(cell):
        return COMPILE_RULE
    if cell.implementation == "flex_attention" and cell.cache not in FLEX_CACHES:
        return FLEX_RULE
    return None


def is_static(cache: str) -> bool:
    """A cache of preallocated length (``max_cache_len``)."""
    return cache in ALL_STATIC_CACHE_IMPLEMENTATIONS or cache == USER_STATIC


def all_cells() -> list[Cell]:
    """Every cell, grouped so that a model (shape, implementation) is built once and a variant patched once."""
    return [
        Cell(shape, implementation, variant, cache, mode)
        for shape in SHAPES
        for implementation in IMPLEMENTATIONS
        for variant in variants()
        for cache in caches()
        for mode in MODES
    ]
