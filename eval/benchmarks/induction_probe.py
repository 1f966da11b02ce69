"""Does a model copy from its context? Induction diagnostics for the bundled testbed (or any causal LM).

    python eval/benchmarks/induction_probe.py [MODEL ...]            # default: the bundled model
    python eval/benchmarks/induction_probe.py --train-steps 3000       # the formation experiment

Passkey retrieval is copying: at "The pass key is" the model must find the earlier "The pass key is",
read the digits after it, and copy them one by one. Transformers do this with induction heads (Olsson et
al. 2022, "In-context Learning and Induction Heads"): a previous-token head writes each token's
predecessor into its residual stream, and a later head matches the current token against those to attend
to "the token after my earlier twin". This script measures, for each model:

1. the repeated-random-words test: 60 random word tokens, then the same 60 again. A model with induction
   heads predicts the second copy far better than the first (``copy_gain``, nats per token, first copy
   minus second; ~0 without induction, several nats with it);
2. per head, the mean attention to the previous token (``prev_token``) and, in the second copy, to the
   token after the current token's first occurrence (``induction``): ~1/position for a head that
   does neither, near 1 for a clean previous-token or induction head;
3. passkey digits with the correct prefix given (teacher forcing), at the trained context: the fraction
   of answers whose k-th digit is the model's top choice, for k = 1, 2, ...

``--train-steps N`` runs the formation experiment instead: a fresh model of the bundled model's
architecture (random weights) trained on the plainest copy task (random tokens; a random span is
repeated later at a random distance, so only content can say where to look), logging the loss on the
repeated tokens against the loss elsewhere. Induction has formed when the repeated tokens' loss falls
well below the rest (``formed_at``: first log step where it is under half of it).

Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time


def word_tokens(tokenizer) -> list[int]:
    """Whole-word tokens (a leading space, then letters)."""
    out = []
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        if len(text) > 2 and text[0] == " " and text[1:].isalpha():
            out.append(i)
    return out


def repeated_words(model, tokenizer, *, sequences: int, length: int, seed: int) -> dict:
    import torch

    words = word_tokens(tokenizer)
    rng = random.Random(seed)
    first, second = [], []
    layers = None
    for _ in range(sequences):
        seq = [rng.choice(words) for _ in range(length)]
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        ids = torch.tensor([bos + seq + seq])
        offset = len(bos)
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True)
        losses = torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, 1:], reduction="none")
        # loss at index t predicts token t+1: first copy = tokens offset+1 .. offset+length-1
        first.append(losses[offset : offset + length - 1].mean().item())
        second.append(losses[offset + length : offset + 2 * length - 1].mean().item())
        scores = []
        for att in out.attentions:
            att = att[0].float()  # heads x query x key
            q = torch.arange(offset + 1, offset + 2 * length)
            prev = att[:, q, q - 1].mean(-1)
            q2 = torch.arange(offset + length + 1, offset + 2 * length)  # second copy, after its first token
            ind = att[:, q2, q2 - length + 1].mean(-1)  # the token after the first occurrence
            scores.append((prev, ind))
        layers = scores if layers is None else [(a + p, b + i) for (a, b), (p, i) in zip(layers, scores, strict=True)]
    heads = [
        {
            "layer": n,
            "prev_token": [round(v / sequences, 3) for v in p.tolist()],
            "induction": [round(v / sequences, 3) for v in i.tolist()],
        }
        for n, (p, i) in enumerate(layers)
    ]
    return {
        "loss_first_copy": sum(first) / sequences,
        "loss_second_copy": sum(second) / sequences,
        "copy_gain": (sum(first) - sum(second)) / sequences,
        "heads": heads,
        "max_prev_token": max(max(h["prev_token"]) for h in heads),
        "max_induction": max(max(h["induction"]) for h in heads),
    }


def passkey_digits(model, tokenizer, *, length: int, trials: int, seed: int) -> list[float]:
    """Teacher-forced accuracy of each answer digit on training-format passkey examples of ~``length``
    tokens (keys of five digits)."""
    import torch

    from rope_extend.bundled.corpus import passkey_example

    rng = random.Random(seed)
    hits = [0] * 5
    done = 0
    while done < trials:
        text = passkey_example(rng, rng.randint(3, 60), max_key=99999)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer = text.rsplit(" ", 1)[1].rstrip(".")
        if len(ids) > length or len(answer) != 5:
            continue
        digits = tokenizer(answer, add_special_tokens=False)["input_ids"]
        if len(digits) != 5:
            raise SystemExit(
                f"the passkey-digit probe needs one token per digit; this tokenizer splits "
                f"{answer} into {len(digits)} tokens"
            )
        start = len(ids) - 1 - len(digits)  # ids end with the digits, then "."
        if ids[start : start + len(digits)] != digits:
            continue
        with torch.no_grad():
            pred = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
        for k in range(5):
            hits[k] += int(pred[start + k - 1].item() == digits[k])
        done += 1
    return [h / trials for h in hits]


def probe(name: str, args) -> dict:
    from rope_extend.loading import load_model, load_tokenizer

    model = load_model(name, attn_implementation="eager")  # attention weights are read
    tokenizer = load_tokenizer(name)
    L = model.config.max_position_embeddings  # the trained context (the bundled model's trained_length())
    result = {"model": name}
    result.update(repeated_words(model, tokenizer, sequences=args.sequences, length=args.length, seed=args.seed))
    result["passkey_digit_accuracy"] = passkey_digits(model, tokenizer, length=L, trials=args.trials, seed=args.seed)
    return result


def formation(args) -> dict:
    """Train a fresh bundled-architecture model on random-token copying; log when copying appears."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rope_extend import bundled

    config = AutoConfig.from_pretrained(bundled.MODEL_DIR)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    rng = random.Random(args.seed)
    batch, seq, vocab = args.batch, args.seq, args.vocab
    log, formed_at, start = [], None, time.perf_counter()
    for step in range(1, args.train_steps + 1):
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, step / 50)
        x = torch.randint(10, 10 + vocab, (batch, seq), generator=gen)
        copied = torch.zeros(batch, seq - 1, dtype=torch.bool)
        for i in range(batch):
            n = rng.randint(seq // 20, seq // 5)
            a = rng.randint(1, seq - 1 - 2 * n)
            b = rng.randint(a + n, seq - n)
            x[i, b : b + n] = x[i, a : a + n]
            copied[i, b : b + n - 1] = True  # predicting the 2nd..n-th repeated token
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none"
        ).view(batch, -1)
        loss.mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % args.log_every == 0:
            row = {
                "step": step,
                "copied": loss[copied].mean().item(),
                "other": loss[~copied].mean().item(),
                "seconds": round(time.perf_counter() - start, 1),
            }
            log.append(row)
            print(
                f"step {step:6d}  loss on repeated tokens {row['copied']:.3f}  elsewhere {row['other']:.3f}"
                f"  (uniform {math.log(vocab):.3f})  {row['seconds']:.0f}s",
                flush=True,
            )
            if formed_at is None and row["copied"] < 0.5 * row["other"]:
                formed_at = step
    return {
        "experiment": "formation",
        "steps": args.train_steps,
        "batch": batch,
        "seq": seq,
        "vocab": vocab,
        "lr": args.lr,
        "formed_at": formed_at,
        "log": log,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["bundled"], help="model folders (default: bundled)")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--length", type=int, default=60, help="random words per copy")
    parser.add_argument("--trials", type=int, default=60, help="passkey examples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-steps", type=int, help="run the formation experiment for this many steps")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=192)
    parser.add_argument("--vocab", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--threads", type=int, help="torch threads")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.train_steps:
        print(json.dumps({"benchmark": "induction_probe", **formation(args)}))
        return
    results = []
    for name in args.models:
        r = probe(name, args)
        results.append(r)
        print(
            f"{name}: copy gain {r['copy_gain']:.2f} nats/token (first copy {r['loss_first_copy']:.2f}, "
            f"second {r['loss_second_copy']:.2f}); best previous-token head {r['max_prev_token']:.2f}, "
            f"best induction head {r['max_induction']:.2f}; passkey digits (teacher-forced) "
            + " ".join(f"{a:.2f}" for a in r["passkey_digit_accuracy"])
        )
    print(json.dumps({"benchmark": "induction_probe", "results": results}))


if __name__ == "__main__":
    main()
