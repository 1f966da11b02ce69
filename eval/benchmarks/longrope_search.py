"""LongRoPE factor search on the bundled testbed, judged on texts the search never saw (issue: LongRoPE search).

    python eval/benchmarks/longrope_search.py [--factors 4 8] [--evals 160] [--out eval/reports/longrope]

For each factor s: ``rope_extend.search`` on the held-out chronicles 0-3 at s x L tokens (fitness: their
perplexity), then the perplexity of chronicles 4-7, which the search never saw, at s x L tokens (one truncated
window per document, token-weighted) for the searched factors against linear (PI), ntk, yarn and dynamic_yarn
zero-shot at the same factor, and the unscaled model. Target: searched below yarn, ntk and linear at 4x and 8x.

Copies each search's report (report.md, search.png, longrope.json) to --out/x<s>/. Prints a table, then the
last line as JSON (per factor: every method's held-out perplexity, searched / best other, pass).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

METHODS = ("none", "linear", "ntk", "yarn", "dynamic_yarn")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factors", type=float, nargs="+", default=[4.0, 8.0])
    parser.add_argument("--evals", type=int, default=160, help="search budget in evaluations per factor")
    parser.add_argument("--population", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="eval/reports/longrope")
    args = parser.parse_args()

    import rope_extend
    from rope_extend import bundled
    from rope_extend.evaluation import perplexity
    from rope_extend.io import atomic_path

    L = bundled.trained_length()
    texts = bundled.eval_texts()
    search_texts, held_out = texts[:4], texts[4:]
    model, tok = bundled.load()
    summary = {}
    for s in args.factors:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            result = rope_extend.search(
                model, tok, s, search_texts, max_evaluations=args.evals, population=args.population,
                seed=args.seed, out=Path(tmp) / "search", progress=False,
            )  # fmt: skip
            seconds = time.monotonic() - t0
            target = Path(args.out) / f"x{s:g}"  # the report files only (not the resumable state)
            for name in ("longrope.json", "report.md", "search.png"):
                with atomic_path(target / name) as part:
                    shutil.copyfile(Path(tmp) / "search" / name, part)
        length = round(s * L)
        row = {}
        for name in (*METHODS, "searched"):
            if name == "searched":
                rope_extend.patch(model, "longrope", **result.patch_kwargs())
            elif name != "none":
                rope_extend.patch(model, name, factor=s)
            try:
                row[name] = perplexity(model, tok, held_out, [length], progress=False).perplexity[length]
            finally:
                if name != "none":
                    rope_extend.unpatch(model)
        others = min(row[m] for m in ("linear", "ntk", "yarn"))
        summary[f"x{s:g}"] = {
            "length": length,
            "held_out": row,
            "search_fitness": result.fitness,
            "search_seeds": result.seeds,
            "evaluations": result.evaluations,
            "search_seconds": round(seconds, 1),
            "searched_over_best_of_linear_ntk_yarn": row["searched"] / others,
            "pass": row["searched"] < others,
        }
    print(f"{'factor':>6} {'length':>6} " + " ".join(f"{m:>12}" for m in (*METHODS, "searched")) + "  search s")
    for key, v in summary.items():
        cells = " ".join(f"{v['held_out'][m]:12.4f}" for m in (*METHODS, "searched"))
        print(f"{key:>6} {v['length']:>6} {cells}  {v['search_seconds']:8.1f}")
    print(json.dumps({"factors": summary, "pass": all(v["pass"] for v in summary.values())}))


if __name__ == "__main__":
    main()
