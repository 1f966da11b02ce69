"""The example lm-eval task (examples/lm_eval_tasks/rope_extend_passkey) on the bundled model, through the
``rope-extend`` lm-eval model type: unpatched vs YaRN 4x vs the attention methods.

    PYTHONPATH=. python eval/benchmarks/lmeval_passkey.py            # needs lm_eval (rope-extend[lm_eval])
    PYTHONPATH=. python eval/benchmarks/lmeval_passkey.py --limit 4  # a quick look

The bundled model was trained at L = 256 tokens; the task has 10 prompts at each of 240, 500, 750 and 1000
tokens. ``none-1024`` (``max_length=1024``) is the unpatched model reading the whole prompt (extrapolation);
``none`` is what lm-eval does by default with it: inputs cut from the left to L (the key is often lost).
Prints a markdown table (exact match per length, the group mean, seconds); the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

TASKS = Path(__file__).resolve().parents[2] / "examples" / "lm_eval_tasks"
LENGTHS = (240, 500, 750, 1000)
VARIANTS = {  # name: extra model_args
    "none": "",
    "none-1024": "max_length=1024",
    "yarn": "method=yarn,factor=4",
    "self_extend": "method=self_extend,factor=4",
    "dual_chunk": "method=dual_chunk,factor=4",  # temperature 0.05, the authors' code
    "dual_chunk-t0": "method=dual_chunk,factor=4,temperature=0",  # the paper's DCA
    "rerope": "method=rerope,factor=4",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="prompts per length (default: all 10)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from VARIANTS")
    args = parser.parse_args()
    logging.getLogger("lm-eval").setLevel(logging.WARNING)

    from lm_eval.tasks import TaskManager

    from rope_extend import lmeval

    manager = TaskManager(include_path=str(TASKS))
    table = {}
    for name in args.variants.split(","):
        extra = VARIANTS[name]
        model_args = "pretrained=bundled,device=cpu" + (f",{extra}" if extra else "")
        start = time.perf_counter()
        out = lmeval.evaluate(model_args, ["rope_extend_passkey"], task_manager=manager, limit=args.limit)
        seconds = time.perf_counter() - start
        res = out["results"]
        row = {str(n): float(res[f"rope_extend_passkey_{n}"]["exact_match,first_integer"]) for n in LENGTHS}
        row["mean"] = float(out["groups"]["rope_extend_passkey"]["exact_match,first_integer"])
        row["seconds"] = round(seconds, 1)
        table[name] = row
        print(name, row, flush=True)
    print()
    print("| model_args | " + " | ".join(str(n) for n in LENGTHS) + " | mean | seconds |")
    print("|---|" + "---:|" * (len(LENGTHS) + 2))
    for name, row in table.items():
        cells = [f"{row[str(n)]:.2f}" for n in LENGTHS] + [f"{row['mean']:.3f}", f"{row['seconds']}"]
        print(f"| {name}: `{VARIANTS[name] or '(defaults)'}` | " + " | ".join(cells) + " |")
    print(json.dumps({"limit": args.limit, "results": table}))


if __name__ == "__main__":
    main()
