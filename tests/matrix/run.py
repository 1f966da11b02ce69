"""Run one cell of the matrix: exact against the reference, refused before anything runs, or failed.

``outcome(cell)`` (memoized) is one of

- ``exact``: every step's token is the reference's argmax (a token within the tolerance of the argmax counts as
  equal: the two cannot be told apart at that precision) and every logit is within ``tolerance(cell)`` of the
  largest reference logit; and the patch changes the model: the patched model's logits differ from the unpatched
  model's (``no_op``), unless the variant is the control;
- ``refused``: a ``RopeExtendBaseError`` before anything of that call ran (no decoder forward completed since the
  call began: ``patch``, making a cache, or a ``generate`` or forward call), whose message is one line and names
  the cache or the mode, and the method unless the control is refused the same way;
- ``not applicable`` / ``not run``: a rule of ``cells`` (with its reason), or ``cells.CONTROL_RULE``;
- ``failed``, with the cause (``mismatch``, ``no-op``, ``crash``, ``late refusal``, ``refusal message``) and
  the observed numbers; anything else.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import multiprocessing
import os
import time
import traceback
import unittest.mock
import warnings
from dataclasses import dataclass, field

import torch
import transformers
from transformers import CompileConfig, DynamicCache, StaticCache

import rope_extend
from rope_extend import RopeExtendBaseError
from rope_extend.hf.layout import PROBE_NAME
from tests.matrix import cells as C
from tests.matrix import reference as R

TOLERANCE = 1e-4  # of the largest reference logit; measured on transformers 5.24: <= 1.2e-6 in every exact cell
NO_OP = 1e-5  # a patch whose logits stay within this of the unpatched model's changed nothing (measured: >= 1.2e-3)


@dataclass
class Outcome:
    status: str  # exact, refused, not applicable, not run, failed
    detail: str = ""  # the reason, the refusal, or what failed with its numbers
    cause: str = ""  # failed: mismatch, no-op, crash, late refusal, refusal message
    transformers_error: bool = False  # the control failed inside transformers (for CONTROL_RULE)
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    numbers: dict = field(default_factory=dict)


class Refused(Exception):
    """A rope-extend refusal, with whether any forward had completed in the call that raised it."""

    def __init__(self, error: RopeExtendBaseError, late: bool):
        super().__init__(str(error))
        self.error, self.late = error, late


class Counter:
    """Completed decoder forwards (a forward hook): a refusal is "before anything runs" when none completed."""

    def __init__(self, m):
        self.calls = 0
        m.get_decoder().register_forward_hook(self)

    def __call__(self, module, args, output):
        # rope-extend's probe (``hf.layout.probe``: 12 tokens, its own attention function, outputs discarded) is
        # how a refusal finds what the model does; it computes nothing the user asked for
        if getattr(getattr(module, "config", None), "_attn_implementation", None) != PROBE_NAME:
            self.calls += 1

    def guard(self, fn, *args, **kwargs):
        start = self.calls
        try:
            return fn(*args, **kwargs)
        except RopeExtendBaseError as exc:
            raise Refused(exc, self.calls > start) from exc


class Matrix:
    """Models, patches, references and outcomes, kept across cells."""

    def __init__(self):
        self.references = R.References()
        self.outcomes: dict[C.Cell, Outcome] = {}
        self.counters: dict[int, Counter] = {}
        self.patch_errors: dict[tuple, RopeExtendBaseError] = {}
        self.unpatched: dict[tuple, torch.Tensor] = {}
        self.changed: dict[tuple, float] = {}
        torch.manual_seed(1)
        self.prompt = torch.randint(3, 200, (1, C.PROMPT))
        self.sequence = torch.cat([self.prompt, torch.randint(3, 200, (1, C.FORWARD - C.PROMPT))], 1)
        self.extra = torch.randint(3, 200, (1, C.EXTRA))

    # ------------------------------------------------------------------------------------------- models
    def model(self, cell: C.Cell):
        """The cell's model, patched with its variant (raises ``Refused`` when the patch is refused)."""
        m = R.model(cell.shape, cell.implementation)
        if id(m) not in self.counters:
            self.counters[id(m)] = Counter(m)
            with torch.no_grad():
                self.unpatched[cell.shape, cell.implementation] = m(input_ids=self.sequence).logits.float()
        key = (cell.shape, cell.implementation, cell.variant)
        if key in self.patch_errors:
            raise Refused(self.patch_errors[key], False)
        state = rope_extend.patched(m)
        current = m.__dict__.get("_matrix_variant") if state is not None else "none"
        if current != cell.variant:
            if state is not None:
                rope_extend.unpatch(m)
            m.__dict__["_matrix_variant"] = "none"
            if cell.method is not None:
                try:
                    rope_extend.patch(m, cell.method, **R.patch_arguments(cell.variant, m))
                except RopeExtendBaseError as exc:
                    self.patch_errors[key] = exc
                    raise Refused(exc, False) from exc
                m.__dict__["_matrix_variant"] = cell.variant
        for attr in ("_previous_max_cache_length", "_compiled_call", "_last_compile_config"):
            m.__dict__.pop(attr, None)  # static cache sizes and compiled calls of earlier cells
        return m

    def no_op(self, m, cell: C.Cell) -> float:
        """How far the patched model's logits are from the unpatched model's (relative to the largest)."""
        key = (cell.shape, cell.implementation, cell.variant)
        if key not in self.changed:
            with torch.no_grad():
                patched = m(input_ids=self.sequence).logits.float()
            plain = self.unpatched[cell.shape, cell.implementation]
            self.changed[key] = float((patched - plain).abs().max() / plain.abs().max())
        return self.changed[key]

    # ------------------------------------------------------------------------------------------- caches
    def new_cache(self, m, cell: C.Cell):
        if cell.cache == C.USER_DYNAMIC:
            return DynamicCache()
        if cell.cache == C.USER_STATIC:
            return StaticCache(config=m.config, max_cache_len=C.MAX_CACHE)
        if cell.cache in (C.SINK_ROOMY, C.SINK_EVICTING):
            window = C.ROOMY if cell.cache == C.SINK_ROOMY else C.EVICTING
            return self.counters[id(m)].guard(rope_extend.SinkCache, m, sink_tokens=C.SINKS, window=window)
        return None

    def generate(self, m, cell: C.Cell, ids, new: int, cache=None, **extra):
        kwargs = dict(
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
            attention_mask=torch.ones_like(ids),
            **extra,
        )
        if cell.cache == "none":
            kwargs["use_cache"] = False
        elif cache is not None:
            kwargs[R.CACHE_ARG] = cache
        else:
            kwargs["cache_implementation"] = cell.cache
            if C.is_static(cell.cache):
                kwargs["max_cache_len"] = C.MAX_CACHE  # a continuation grows past the first call's length
        with torch.no_grad():
            out = self.counters[id(m)].guard(m.generate, ids, **kwargs)
        self.beam_indices = out.get("beam_indices")
        returned = out.get("cache", out.get("past_key_values"))
        return out.sequences, [step.float() for step in out.logits], returned

    # ------------------------------------------------------------------------------------------- checks
    def compare(self, m, cell: C.Cell, got: torch.Tensor, want: torch.Tensor, tokens: torch.Tensor, what: str):
        """``got`` and ``want`` [steps, vocab], ``tokens`` [steps] the tokens taken; a failure message or None."""
        scale = float(want.abs().max())
        error = float((got - want).abs().max()) / scale
        tol = tolerance(cell)
        held = want.clone()
        if what != "forward":
            held[:, R.eos_ids(m)] = float("-inf")  # generate's min_new_tokens holds EOS back
        margin = held.max(-1).values - held.gather(1, tokens[:, None])[:, 0]
        agree = int((margin <= tol * scale).sum()) if what != "beam" else len(tokens)  # beams are not argmaxes
        numbers = {"error": error, "agree": agree, "steps": len(tokens)}
        if agree < len(tokens) or error > tol:
            return numbers, (
                f"{what}: {agree}/{len(tokens)} tokens are the reference's argmax; logits off by {error:.2g} of "
                f"the largest (tolerance {tol:g})"
            )
        return numbers, None

    # ------------------------------------------------------------------------------------------- modes
    def run_forward(self, m, cell):
        cache = self.new_cache(m, cell)
        x = self.sequence
        with torch.no_grad():
            kwargs = {R.CACHE_ARG: cache, "use_cache": True} if cache is not None else {"use_cache": False}
            got = self.counters[id(m)].guard(m, input_ids=x, **kwargs).logits[0].float()
        if cell.cache == C.SINK_EVICTING:  # longer than the window: refused above
            raise AssertionError("a forward longer than the SinkCache window was not refused")
        want = self.references.whole(m, cell, x)
        return self.compare(m, cell, got, want, got.argmax(-1), "forward")

    def run_greedy(self, m, cell, new=C.NEW, **extra):
        seq, logits, _ = self.generate(m, cell, self.prompt, new, self.new_cache(m, cell), **extra)
        positions = list(range(C.PROMPT, C.PROMPT + new))
        if cell.cache == C.SINK_EVICTING:
            want = R.sink_steps(m, seq, C.EVICTING, [C.PROMPT] + [1] * (new - 1))
        else:
            want = self.references.steps(m, cell, seq, positions)
        return self.compare(m, cell, torch.cat(logits), want, seq[0, positions], cell.mode)

    def run_continue(self, m, cell):
        first, logits, cache = self.generate(m, cell, self.prompt, C.FIRST, self.new_cache(m, cell))
        if cache is None:
            raise AssertionError("generate returned no cache to continue from")
        start = first.shape[1] + C.EXTRA
        seq, more, _ = self.generate(m, cell, torch.cat([first, self.extra], 1), C.SECOND, cache)
        positions = list(range(C.PROMPT, C.PROMPT + C.FIRST)) + list(range(start, start + C.SECOND))
        if cell.cache == C.SINK_EVICTING:
            chunks = [C.PROMPT] + [1] * (C.FIRST - 1) + [1 + C.EXTRA] + [1] * (C.SECOND - 1)
            want = R.sink_steps(m, seq, C.EVICTING, chunks)
        else:
            want = self.references.steps(m, cell, seq, positions)
        return self.compare(m, cell, torch.cat(logits + more), want, seq[0, positions], "continue")

    def run_beam(self, m, cell):
        seqs, logits, _ = self.generate(m, cell, self.prompt, C.BEAM_NEW, self.new_cache(m, cell), num_beams=C.BEAMS)
        best = seqs[:1]
        want_best = self.references.beam(m, cell, self.prompt, C.BEAMS, C.BEAM_NEW)
        if not torch.equal(best[0], want_best):
            first = int((best[0] != want_best).nonzero()[0]) - C.PROMPT
            return {}, f"beam: the best sequence leaves the reference beam search's at new token {first}"
        # the best beam's logits at each step: the row it came from (generate's beam_indices)
        rows = self.beam_indices[0].tolist()
        positions = list(range(C.PROMPT, C.PROMPT + C.BEAM_NEW))
        got = torch.stack([step[row] for step, row in zip(logits, rows, strict=True)])
        want = self.references.steps(m, cell, best, positions)
        return self.compare(m, cell, got, want, best[0, positions], "beam")

    def run_compile(self, m, cell):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        config = CompileConfig(mode="default")
        config._compile_all_devices = True  # transformers compiles on the CPU too when asked
        # inductor compiles in this process: its time is counted in the cell's cpu_seconds, and the matrix's
        # workers already hold the cores
        with unittest.mock.patch.object(torch._inductor.config, "compile_threads", 1):
            numbers, failure = self.run_greedy(m, cell, new=C.COMPILE_NEW, compile_config=config)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        numbers["graphs"] = graphs
        if failure is None and not graphs:
            failure = "compile: generate compiled nothing"
        return numbers, failure

    # ------------------------------------------------------------------------------------------- outcomes
    def outcome(self, cell: C.Cell) -> Outcome:
        if cell not in self.outcomes:
            self.outcomes[cell] = self._outcome(cell)
        return self.outcomes[cell]

    def _outcome(self, cell: C.Cell) -> Outcome:
        why = C.not_applicable(cell)
        if why:
            return Outcome("not applicable", why)
        why = C.not_run(cell)
        if why:
            return Outcome("not run", why)
        control = C.control(cell)
        if control != cell:
            base = self.outcome(control)
            if base.transformers_error:
                return Outcome("not applicable", base.detail)
        started, cpu = time.perf_counter(), time.process_time()
        result = self._run(cell)
        result.seconds, result.cpu_seconds = time.perf_counter() - started, time.process_time() - cpu
        if control == cell and result.status == "failed" and result.cause == "mismatch":
            # no rope-extend code ran: transformers itself is off the reference (the numbers stay in ``numbers``)
            result.transformers_error = True
            result.numbers["control"] = result.detail
            result.detail = f"off the uncached reference ({cell.mode}, {cell.cache}, {cell.implementation})"
        if control == cell and result.transformers_error:
            result.status, result.detail = "not applicable", f"{C.CONTROL_RULE}: {result.detail}"
        return result

    def _run(self, cell: C.Cell) -> Outcome:
        m = None
        try:
            m = self.model(cell)
            numbers, failure = getattr(self, f"run_{cell.mode}")(m, cell)
        except Refused as refusal:
            return self._refused(cell, refusal)
        except Exception as exc:  # noqa: BLE001 - every other exception is the cell's failure
            inside = "rope_extend" in "".join(traceback.format_tb(exc.__traceback__))
            line = (str(exc).splitlines() or [""])[0][:200]
            return Outcome("failed", f"{type(exc).__name__}: {line}", "crash", transformers_error=not inside)
        if failure:
            return Outcome("failed", failure, "mismatch", numbers=numbers)
        if cell.variant != "none":
            change = self.no_op(m, cell)
            numbers["change"] = change
            if change < NO_OP:
                return Outcome(
                    "failed",
                    f"no-op: the patched logits are within {change:.2g} of the unpatched model's",
                    "no-op",
                    numbers=numbers,
                )
        return Outcome("exact", numbers=numbers)

    def _refused(self, cell: C.Cell, refusal: Refused) -> Outcome:
        message = str(refusal)
        if refusal.late:
            return Outcome("failed", f"refused after a forward had run: {message}", "late refusal")
        if "\n" in message:
            return Outcome("failed", f"a refusal of several lines: {message!r}", "refusal message")
        method = cell.method is not None
        if (cell.shape, cell.implementation, cell.variant) not in self.patch_errors:
            # a refusal of the combination names the cache or the mode, and the method unless the cell without a
            # method is refused the same way (the cache or mode is refused whatever the method)
            if not any(word.lower() in message.lower() for word in names_of(cell)):
                why = f"the refusal names neither the cache nor the mode: {message}"
                return Outcome("failed", why, "refusal message")
            plain = self.outcome(cell.replace(variant="none")) if method else None
            method = method and not (plain.status == "refused" and plain.detail == message)
        if method and cell.method not in message:
            return Outcome("failed", f"the refusal does not name {cell.method}: {message}", "refusal message")
        return Outcome("refused", message)


def names_of(cell: C.Cell) -> list[str]:
    """Words that name the cell's cache or mode in a refusal."""
    words = {
        "forward": ["forward"],
        "greedy": ["generat"],
        "continue": ["continu"],
        "beam": ["beam"],
        "compile": ["compile"],
    }[cell.mode]
    if cell.cache in (C.SINK_ROOMY, C.SINK_EVICTING):
        words += ["SinkCache", "sink"]
    elif cell.cache != "none":
        words += [cell.cache, "StaticCache" if C.is_static(cell.cache) else "DynamicCache", "cache"]
    return words


def tolerance(cell: C.Cell) -> float:
    return TOLERANCE


@contextlib.contextmanager
def quiet():
    """One thread (tiny models: threads cost more than they give), no warnings or logs from transformers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)
        transformers.logging.set_verbosity(verbosity)
        torch.set_num_threads(threads)


_MATRIX: Matrix | None = None


def _run_group(group: list[C.Cell]) -> list[tuple[C.Cell, Outcome]]:
    """One worker's share: the cells of one model (shape, implementation), compiled cells last."""
    global _MATRIX  # one Matrix per worker process, kept across its groups
    if _MATRIX is None:
        _MATRIX = Matrix()
    with quiet():
        return [(cell, _MATRIX.outcome(cell)) for cell in sorted(group, key=lambda c: c.mode == "compile")]


def workers() -> int:
    """Processes for the matrix: ``ROPE_EXTEND_MATRIX_WORKERS``, else one per core up to the 12 models."""
    return int(os.environ.get("ROPE_EXTEND_MATRIX_WORKERS", "0")) or min(os.cpu_count() or 1, 12)


def run_all(selected: list[C.Cell]) -> dict[C.Cell, Outcome]:
    """The outcomes of ``selected`` (and of the cells they depend on), one model per task, in ``workers()``
    processes (each builds the models of its groups once)."""
    groups: dict[tuple, list[C.Cell]] = {}
    for cell in selected:
        groups.setdefault((cell.shape, cell.implementation), []).append(cell)
    # the slowest first (FlexAttention compiles, then runs uncompiled; sdpa holds the compiled cells)
    order = sorted(groups.values(), key=lambda g: C.IMPLEMENTATIONS.index(g[0].implementation), reverse=True)
    if workers() == 1 or len(order) == 1:
        results = [_run_group(group) for group in order]
    else:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch threads
        with concurrent.futures.ProcessPoolExecutor(min(workers(), len(order)), mp_context=context) as pool:
            results = list(pool.map(_run_group, order))
    return {cell: outcome for group in results for cell, outcome in group}


@functools.cache
def flex_off_eager() -> str | None:
    """Why transformers' own FlexAttention cannot be a reference on this machine, or None when it can: the plain
    tiny Llama (no rope-extend) under ``flex_attention`` against ``eager``, one forward at each of the matrix's
    lengths. Measured on an AVX2-only CPU (AMD EPYC, torch 2.13.0's inductor CPU kernels), without rope-extend: off
    by 0.34 of the largest logit at 40 tokens and NaN at 56 in one process, within 3.2e-7 at 41, 48 and 64, and
    beam search crashing in FlexAttention's block mask in some orders; on the machines the page was made on, every
    flex_attention cell ran exact."""
    torch.manual_seed(0)
    for length in sorted({C.PROMPT, C.PROMPT + C.NEW, C.FORWARD, C.FORWARD + C.EXTRA}):
        ids = torch.randint(3, 200, (1, length))
        try:
            with torch.no_grad(), quiet():
                want = R.model("llama", "eager")(ids).logits
                got = R.model("llama", "flex_attention")(ids).logits
        except Exception as exc:  # noqa: BLE001 - any failure of transformers' FlexAttention here is the answer
            return (
                f"transformers' FlexAttention fails on this machine without rope-extend ({type(exc).__name__}: {exc})"
            )
        error = ((got - want).abs().max() / want.abs().max()).item()
        if not error <= TOLERANCE:
            return (
                f"transformers' FlexAttention is off eager on this machine without rope-extend ({error:.2g} of the "
                f"largest logit at {length} tokens, tolerance {TOLERANCE:g}): torch's CPU kernels, not rope-extend"
            )
    return None
