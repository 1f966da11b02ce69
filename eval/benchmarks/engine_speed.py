"""Evaluation through llama.cpp against transformers on the CPU: the same harness, prompts and windows, two backends.

    python eval/benchmarks/engine_speed.py                                    # SmolLM2-135M yarn x4: 4k, 8k
    python eval/benchmarks/engine_speed.py --lengths 8k,16k --variants default,kv_f32 --repeats 2 \\
        --builds portable=/tmp/llama-portable,native=/tmp/llama-native

SmolLM2-135M-Instruct (float32) is patched with ``--method`` (yarn x4 by default, so 32k is inside its target)
and exported as an f32 GGUF (f16 and bf16 too for the variants that name them); then, length by length, passkey
(``--trials`` trials) and perplexity (one window of the first Canterbury text that reaches the length) are
measured with ``rope_extend.evaluation`` on the transformers model (sdpa) and on the file in llama.cpp, once per
``--builds`` x ``--variants`` setting (``evaluation.engines.LlamaCppModel``), the backends alternating within each
repeat so that all see the same load on the machine. ``before`` is the backend as it was before issue 68
(512-token batches and micro-batches, no flash attention, every position's logits kept for a perplexity window
and reduced at the end), ``default`` what ``LlamaCppModel`` does now; the others change one setting of
``default``.

Builds: llama-cpp-python cannot be imported twice in one process (one module name, one set of libraries), so
each build runs in a process of its own, with its folder (``pip install --target``) first on ``sys.path``; an
empty folder (the default, ``installed=``) is the llama-cpp-python this Python has. ``eval/benchmarks/
llama_builds.sh`` makes the two builds: CI's portable wheel (``GGML_NATIVE=OFF``: AVX2, what every runner can
run, so the only one CI caches and tests) and the native one (``GGML_NATIVE=ON``: this machine's instructions,
AVX-512 and AVX-512 BF16 here), which CI cannot use; each build's ``llama_print_system_info`` is printed.

Per length, task and backend it prints the best wall and CPU seconds over the repeats, the ratio transformers /
llama.cpp (above 1, llama.cpp is faster), the load average (1 minute) around the measurements, and whether the
numbers agree: passkey outputs equal to transformers' and to ``before``'s (of the same build); perplexity's
relative difference to both. CPU seconds count every thread of the process (llama.cpp's threads wait for each
other spinning, so on busy cores its CPU seconds grow with the load too). The last line is JSON; ``--out`` writes
it when complete.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import rope_extend
from rope_extend.documents import read_documents
from rope_extend.evaluation import passkey, perplexity
from rope_extend.evaluation.data import parse_lengths
from rope_extend.evaluation.engines import LlamaCppModel
from rope_extend.export import export
from rope_extend.io import write_json

BEFORE = {"n_batch": 512, "n_ubatch": 512, "flash_attn": False}  # LlamaCppModel's settings before issue 68
VARIANTS = {
    "before": BEFORE,
    "default": {},
    "threads1": {"threads": 1},
    "no_flash": {"flash_attn": False},
    "batch512": {"n_batch": 512, "n_ubatch": 512},
    "batch2048": {"n_batch": 2048, "n_ubatch": 2048},
    "ubatch512": {"n_ubatch": 512},
    "kv_f16": {"kv_type": "f16"},
    "kv_f32": {"kv_type": "f32"},
    # other files: their weights are not the f32 file's, so neither are their answers exactly
    "f16": {"dtype": "f16"},
    "bf16": {"dtype": "bf16"},
}


class Before(LlamaCppModel):
    """The perplexity path before issue 68: every position's logits requested, copied and concatenated into one
    ``n x vocab`` float32 array (1.6 GB at 8k tokens of a 49k vocabulary), then converted to float64 whole."""

    def nll(self, ids, score_from):
        n = len(ids)
        if n - score_from <= 0:
            return 0.0, 0
        self.check_reachable(n)
        llm, rows = self._llm, []
        llm._ctx.kv_cache_clear()
        for i in range(0, n, self.n_batch):
            chunk = list(ids[i : i + self.n_batch])
            llm._batch.set_batch(batch=chunk, n_past=i, logits_all=True)
            llm._ctx.decode(llm._batch)
            flat = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(len(chunk) * self.vocab,))
            rows.append(flat.reshape(len(chunk), self.vocab).copy())
        logits = np.concatenate(rows)[score_from - 1 : n - 1].astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        log_z = np.log(np.exp(logits).sum(-1))
        targets = np.asarray(ids[score_from:])
        return float((log_z - logits[np.arange(len(targets)), targets]).sum()), len(targets)


def value(task, result, n):
    if task == "passkey":
        return [r["output"] for r in result.records], result.accuracy_by_length[n]
    return result.perplexity[n], result.perplexity[n]


def timed_task(model, job, task, n):
    """``(value, wall s, CPU s of this process)`` of one harness call (``job``: tokenizer, text, trials)."""
    wall, cpu = time.perf_counter(), time.process_time()
    if task == "passkey":
        result = passkey(model, job["tok"], [n], trials=job["trials"], progress=False)
    else:
        result = perplexity(model, job["tok"], [job["text"]], [n], progress=False)
    return value(task, result, n), time.perf_counter() - wall, time.process_time() - cpu


def agree(task, a, b):
    """Passkey: the outputs are the same strings; perplexity: the relative difference."""
    if a is None or b is None:
        return None
    return a == b if task == "passkey" else abs(a - b) / a


def serve(conn, folder, files, variants, job):
    """A build's process: open every variant's file with that build's llama-cpp-python, then answer
    ``(variant, task, length)`` with ``timed_task``'s triple until sent ``None``."""
    if folder:
        sys.path.insert(0, folder)
    torch.set_num_threads(job["threads"])
    try:
        import llama_cpp  # after the build's folder is on the path

        opened = {}
        for v in variants:
            settings = dict(VARIANTS[v])
            path = files[settings.pop("dtype", "f32")]
            settings.setdefault("threads", job["threads"])
            kind = Before if v == "before" else LlamaCppModel
            opened[v] = kind(path, n_ctx=job["n_ctx"], method=job["method"], factor=job["factor"], **settings)
        info = llama_cpp.llama_print_system_info().decode().strip()
        conn.send(
            (
                f"llama-cpp-python {llama_cpp.__version__} from {llama_cpp.__file__}: {info}",
                {v: m.settings for v, m in opened.items()},
            )
        )
    except Exception as exc:  # noqa: BLE001 - one line to the parent, which stops
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    while (request := conn.recv()) is not None:
        variant, task, n = request
        conn.send(timed_task(opened[variant], job, task, n))
    for m in opened.values():
        m.close()


class Build:
    """One llama-cpp-python build in a process of its own (``serve``)."""

    def __init__(self, name, folder, files, variants, job):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child, folder, files, variants, job), daemon=True)
        self.process.start()
        reply = self.conn.recv()
        if isinstance(reply, str):
            self.process.join()
            raise SystemExit(f"engine_speed.py: build {name} ({folder or 'installed'}): {reply}")
        self.info, self.settings = reply

    def run(self, variant, task, n):
        self.conn.send((variant, task, n))
        return self.conn.recv()

    def close(self):
        self.conn.send(None)
        self.process.join()


def parse_builds(text):
    """``NAME=FOLDER,...`` (an empty folder: the installed llama-cpp-python) -> ``{name: folder}``."""
    builds = {}
    for item in text.split(","):
        name, sep, folder = item.partition("=")
        if not sep or not name or name in builds or (folder and not Path(folder, "llama_cpp").is_dir()):
            raise SystemExit(f"engine_speed.py: --builds wants NAME=FOLDER (a pip --target folder), got {item!r}")
        builds[name] = folder
    return builds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="yarn")
    parser.add_argument("--factor", type=float, default=4.0)
    parser.add_argument("--lengths", default="4k,8k")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="each measurement this many times; the best is kept")
    parser.add_argument("--variants", default="before,default", help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--builds", default="installed=", help="NAME=FOLDER,... (pip --target folders)")
    parser.add_argument("--tasks", default="passkey,perplexity")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    lengths, tasks = parse_lengths(args.lengths), args.tasks.split(",")
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; allowed: {', '.join(VARIANTS)}")
    builds = parse_builds(args.builds)
    torch.set_num_threads(args.threads)

    model, tok = rope_extend.load(args.model, attn_implementation="sdpa")
    rope_extend.patch(model, args.method, factor=args.factor)
    text = next(t for t in read_documents("canterbury") if len(tok(t)["input_ids"]) >= max(lengths))
    job = {"tok": tok, "text": text, "trials": args.trials, "threads": args.threads, "n_ctx": max(lengths) + 16}
    job.update(method=args.method, factor=args.factor)
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for dtype in sorted({VARIANTS[v].get("dtype", "f32") for v in variants}):
            files[dtype] = export(model, "gguf", Path(tmp) / f"m-{dtype}.gguf", tokenizer=tok, dtype=dtype).out
        served = {name: Build(name, folder, files, variants, job) for name, folder in builds.items()}
        backends = {"transformers": lambda task, n: timed_task(model, job, task, n)}
        for name, build in served.items():
            print(f"# build {name}: {build.info}", flush=True)
            for v in variants:
                backends[f"{name}:{v}"] = lambda task, n, b=build, v=v: b.run(v, task, n)
        rows = measure(backends, lengths, tasks, args.repeats)
        for build in served.values():
            build.close()
    print_table(rows)
    summary = {
        "model": args.model,
        "method": args.method,
        "factor": args.factor,
        "threads": args.threads,
        "repeats": args.repeats,
        "builds": {
            name: {"folder": builds[name], "llama_cpp": b.info, "settings": b.settings} for name, b in served.items()
        },
        "rows": rows,
    }
    print(json.dumps(summary))
    if args.out:
        write_json(args.out, summary)
    return 0


def measure(backends, lengths, tasks, repeats):
    """One row per (length, task, llama.cpp backend): the best of ``repeats`` timings of each backend, the
    backends taking turns within a repeat, and whether each one's numbers agree with transformers' and with its
    build's ``before``."""
    rows = []
    for n in lengths:
        for task in tasks:
            best: dict[str, list[float]] = {b: [math.inf, math.inf] for b in backends}
            got, loads = {}, []
            for _ in range(repeats):
                for name, run in backends.items():
                    loads.append(os.getloadavg()[0])
                    got[name], wall, cpu = run(task, n)
                    best[name] = [min(best[name][0], wall), min(best[name][1], cpu)]
                    print(f"# {n} {task} {name}: {wall:.1f} s wall, {cpu:.1f} s CPU, load {loads[-1]:.1f}", flush=True)
            loads.append(os.getloadavg()[0])
            hf_wall, hf_cpu = best["transformers"]
            for name in backends:
                if name == "transformers":
                    continue
                wall, cpu = best[name]
                before = got.get(name.split(":")[0] + ":before", (None,))[0]
                row = {
                    "length": n,
                    "task": task,
                    "backend": name,
                    "settings": VARIANTS[name.split(":")[1]],
                    "transformers": got["transformers"][1],
                    "llama_cpp": got[name][1],
                    "agree_transformers": agree(task, got["transformers"][0], got[name][0]),
                    "agree_before": agree(task, before, got[name][0]),
                    "wall_transformers": round(hf_wall, 2),
                    "wall_llama_cpp": round(wall, 2),
                    "cpu_transformers": round(hf_cpu, 2),
                    "cpu_llama_cpp": round(cpu, 2),
                    "wall_ratio": round(hf_wall / wall, 2),
                    "cpu_ratio": round(hf_cpu / cpu, 2),
                    "load": [round(min(loads), 1), round(max(loads), 1)],
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def print_table(rows):
    def shown(r, key):
        a = r[key]
        if a is None:
            return "-"
        if r["task"] == "passkey":
            return "equal" if a else "differ"
        return f"{a:.1e}"

    print(
        "\n| length | task | llama.cpp build:variant | value (hf / cpp) | vs hf | vs before | wall s (hf / cpp) "
        "| ratio | CPU s (hf / cpp) | ratio | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['length']} | {r['task']} | {r['backend']} | {r['transformers']:.6g} / {r['llama_cpp']:.6g} | "
            f"{shown(r, 'agree_transformers')} | {shown(r, 'agree_before')} | "
            f"{r['wall_transformers']} / {r['wall_llama_cpp']} | {r['wall_ratio']}x | "
            f"{r['cpu_transformers']} / {r['cpu_llama_cpp']} | {r['cpu_ratio']}x | {r['load'][0]}-{r['load'][1]} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
