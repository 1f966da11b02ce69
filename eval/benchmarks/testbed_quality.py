"""Quality targets of the bundled testbed model, measured (issue: the bundled long-context testbed).

    python eval/benchmarks/testbed_quality.py [--trials 50] [--finetuned runs/demo/finetune/model]

1. The bundled model as shipped: passkey accuracy at its trained context L (target >= 95%), and the same
   with filler it never saw in training (target >= 80%): sentences of original prose shipped in the
   package (rope_extend/bundled/data/unseen_prose.txt, not in the training corpus), each trial reading
   them from a random sentence on. Retrieval must come from reading the key, not from knowing the filler.
2. After the demo's fine-tune (recipe bundled-yarn-4x, YaRN 4x; run here unless --finetuned names
   a finished one): passkey accuracy at 4L (target >= 90%) and perplexity on the held-out corpus at 4L
   over perplexity at L (target <= 1.10), one truncated window per document, token-weighted.

Prints a table, then the last line as JSON (passkey_1x, passkey_1x_unseen_filler, passkey_4x, ppl_1x,
ppl_4x, ppl_ratio_4x_1x, targets, pass).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50, help="passkey trials per length")
    parser.add_argument("--finetuned", help="a fine-tuned model folder (default: run the demo's fine-tune)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="fine-tuning steps (default: the demo's)")
    args = parser.parse_args()

    from rope_extend import bundled
    from rope_extend.demo import Effort, finetune
    from rope_extend.evaluation import passkey, perplexity
    from rope_extend.loading import load_model, load_tokenizer

    L = bundled.trained_length()
    texts = bundled.eval_texts()
    model, tok = bundled.load()
    base_pk = passkey(model, tok, [L], trials=args.trials, seed=args.seed + 1000).accuracy[L]
    unseen_pk = passkey(
        model, tok, [L], trials=args.trials, seed=args.seed + 1000, filler=bundled.unseen_filler()
    ).accuracy[L]
    base_ppl = perplexity(model, tok, texts, [L]).perplexity[L]

    if args.finetuned:
        tuned_dir = Path(args.finetuned)
    else:
        effort = Effort.of(quick=False)
        if args.steps:
            effort.steps = args.steps
        tuned_dir = finetune(Path(tempfile.mkdtemp(prefix="testbed-quality-")), L, effort, args.seed)
    tuned, tuned_tok = load_model(str(tuned_dir)), load_tokenizer(str(tuned_dir))
    pk = passkey(tuned, tuned_tok, [L, 4 * L], trials=args.trials, seed=args.seed + 1000).accuracy
    ppl = perplexity(tuned, tuned_tok, texts, [L, 4 * L]).perplexity

    print(f"{'':28}{'passkey':>10}{'perplexity':>12}")
    print(f"{'bundled, L=' + str(L):28}{100 * base_pk:>9.0f}%{base_ppl:>12.3f}")
    print(f"{'bundled, L, unseen filler':28}{100 * unseen_pk:>9.0f}%{'':>12}")
    print(f"{'fine-tuned, L':28}{100 * pk[L]:>9.0f}%{ppl[L]:>12.3f}")
    print(f"{'fine-tuned, 4L=' + str(4 * L):28}{100 * pk[4 * L]:>9.0f}%{ppl[4 * L]:>12.3f}")
    result = {
        "benchmark": "testbed_quality",
        "trials": args.trials,
        "passkey_1x": base_pk,
        "passkey_1x_unseen_filler": unseen_pk,
        "passkey_4x": pk[4 * L],
        "passkey_1x_finetuned": pk[L],
        "ppl_1x": ppl[L],
        "ppl_4x": ppl[4 * L],
        "ppl_1x_pretrained": base_ppl,
        "ppl_ratio_4x_1x": ppl[4 * L] / ppl[L],
        "targets": {"passkey_1x": 0.95, "passkey_1x_unseen_filler": 0.80, "passkey_4x": 0.90, "ppl_ratio_4x_1x": 1.10},
        "finetuned": str(tuned_dir),
    }
    result["pass"] = base_pk >= 0.95 and unseen_pk >= 0.80 and pk[4 * L] >= 0.90 and result["ppl_ratio_4x_1x"] <= 1.10
    print(json.dumps(result))


if __name__ == "__main__":
    main()
