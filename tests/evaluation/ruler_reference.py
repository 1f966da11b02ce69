"""Runs NVIDIA/RULER's own synthetic-data generators (a checkout's ``scripts/data``) and returns the prompt lengths
they make, for comparison with rope-extend's (tests/evaluation/test_ruler_lengths.py).

RULER's generators need its dependencies (wonderwords, nltk, tenacity, numpy, scipy, pyyaml, transformers); its
essay tasks also need Paul Graham's essays downloaded and nltk's punkt data, so only the tasks with no download
are run: niah_single_1, niah_multikey_2, niah_multikey_3, vt, cwe, fwe. Each generator is called as RULER's
``prepare.py`` calls it (its ``base`` template plus the answer prefix, its per-task arguments from
``synthetic.yaml``, ``--tokenizer_type hf``), in a copy of ``scripts/data``: its cwe script reads
``english_words.json`` when it loads, which a checkout without Git LFS holds only as a pointer; the copy gets an
empty list there (RULER uses it only past 8,166 words, far beyond 8k tokens).

A length RULER reports is ``len(tokenizer.tokenize(prompt)) + tokens_to_generate``; the prompt's is that less
the tokens to generate (no special tokens: RULER's HF tokenizer counts none).

Usage: ``python tests/evaluation/ruler_reference.py RULER_DIR TOKENIZER_DIR OUT.json TASKS LENGTHS SAMPLES``.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe")
SEED = 42  # RULER's default random_seed


def available(ruler_dir: str | Path) -> str | None:
    """None when RULER's generators can run here, else why not."""
    data = Path(ruler_dir) / "scripts" / "data" / "synthetic" / "niah.py"
    if not data.is_file():
        return f"no RULER checkout at {ruler_dir}"
    for module in ("wonderwords", "nltk", "tenacity", "scipy", "yaml"):
        if importlib.util.find_spec(module) is None:
            return f"RULER's dependency {module} is not installed"
    return None


def prompt_lengths(ruler_dir: str | Path, tokenizer_dir: str | Path, tasks, lengths, samples: int) -> dict:
    """``{"task@length": [prompt tokens of each sample]}`` from RULER's own generators."""
    import yaml

    root = Path(ruler_dir) / "scripts"
    config = yaml.safe_load((root / "synthetic.yaml").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        shutil.copytree(root / "data", data)
        words = data / "synthetic" / "json" / "english_words.json"
        if not words.exists() or words.read_text(errors="replace").startswith("version https://git-lfs"):
            words.write_text("{}")
        spec = importlib.util.spec_from_file_location("ruler_constants", data / "synthetic" / "constants.py")
        constants = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(constants)
        out: dict[str, list[int]] = {}
        for task in tasks:
            conf = config[task]
            base = constants.TASKS[conf["task"]]
            generate = base["tokens_to_generate"]
            for length in lengths:
                name = f"{task}_{length}"
                cmd = [sys.executable, str(data / "synthetic" / f"{conf['task']}.py")]
                cmd += [
                    "--save_dir",
                    str(Path(tmp) / "out"),
                    "--save_name",
                    name,
                    "--tokenizer_path",
                    str(tokenizer_dir),
                ]
                cmd += [
                    "--tokenizer_type",
                    "hf",
                    "--max_seq_length",
                    str(length),
                    "--tokens_to_generate",
                    str(generate),
                ]
                cmd += ["--num_samples", str(samples), "--random_seed", str(SEED)]
                cmd += ["--template", base["template"] + base.get("answer_prefix", "")]
                for key, value in conf["args"].items():
                    cmd += [f"--{key}", str(value)]
                # RULER's cwe loops for ever when even its smallest list is too long: the timeout ends it
                subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
                rows = (Path(tmp) / "out" / name / "validation.jsonl").read_text().splitlines()
                out[f"{task}@{length}"] = [json.loads(r)["length"] - generate for r in rows]
    return out


if __name__ == "__main__":
    ruler_dir, tokenizer_dir, dest, tasks, lengths, samples = sys.argv[1:7]
    result = prompt_lengths(
        ruler_dir, tokenizer_dir, tasks.split(","), [int(x) for x in lengths.split(",")], int(samples)
    )
    Path(dest).write_text(json.dumps(result, indent=1) + "\n")
