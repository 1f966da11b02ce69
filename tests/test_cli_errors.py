"""The command line as a new user meets it: bad input, odd folders, interrupted runs.

Every case runs ``rope-extend`` as a subprocess in a folder of its own and must end with exit code 2, a
one-line message naming the problem, no traceback, and every file that was there before unchanged.
Extend ``CASES`` whenever a new entry point appears.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.tiny import tiny_model, tiny_tokenizer

SUITE_BAD_TYPE = "model: bundled\nmethods: [{method: yarn, factor: four}]\npasskey: {lengths: [256]}\n"
SUITE_NONE_FACTOR = "model: bundled\nmethods: [{method: none, factor: 4}]\npasskey: {lengths: [256]}\n"


def _user_files(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("my notes")


# name: (arguments, {relative path: content} made first, folder the command runs in, pattern of the message)
CASES = {
    "train overwrite the working folder": (
        ["train", "tiny-cpu", "output_dir=.", "overwrite_output_dir=true"],
        {"notes.txt": "mine"},
        ".",
        "is the working folder",
    ),
    "train overwrite a folder holding its data": (
        ["train", "tiny-cpu", "output_dir=out", "overwrite_output_dir=true", "data.path=out/data.txt"],
        {"out/data.txt": "some text " * 50},
        ".",
        "inside output_dir",
    ),
    "train overwrite someone's folder": (
        ["train", "tiny-cpu", "output_dir=out", "overwrite_output_dir=true"],
        {"out/notes.txt": "mine"},
        ".",
        r"did not write \(notes.txt\)",
    ),
    "search overwrite someone's folder": (
        ["search", "--model", "bundled", "--factor", "2", "--evals", "4", "--out", "mine", "--overwrite"],
        {"mine/notes.txt": "x"},
        ".",
        r"did not write \(notes.txt\)",
    ),
    "search a factor that does not extend": (
        ["search", "--model", "bundled", "--factor", "1", "--out", "s"],
        {},
        ".",
        "extension factor > 1",
    ),
    "search a critical pair without the longrope2 space": (
        ["search", "--model", "bundled", "--factor", "2", "--critical-pair", "3", "--out", "s"],
        {},
        ".",
        "critical_pair sets where the longrope2 space splits; the longrope space has no split",
    ),
    "search a critical pair past the model's pairs": (
        [
            "search",
            "--model",
            "bundled",
            "--factor",
            "2",
            "--space",
            "longrope2",
            "--critical-pair",
            "32",
            "--out",
            "s",
        ],
        {},
        ".",
        r"critical_pair must be an integer >= 0 and < 32 \(the model's frequency pairs\), got 32",
    ),
    "search without texts": (["search", "--model", "m", "--factor", "2", "--out", "s"], {}, ".", "--data is required"),
    "demo overwrite the working folder": (
        ["demo", "--quick", "--out", ".", "--overwrite"],
        {"a.txt": "x"},
        ".",
        "is the working folder",
    ),
    "demo overwrite a parent": (["demo", "--quick", "--out", "..", "--overwrite"], {}, "sub", "parent of the working"),
    "demo overwrite someone's folder": (
        ["demo", "--quick", "--out", "mine", "--overwrite"],
        {"mine/notes.txt": "x"},
        ".",
        "did not write",
    ),
    "eval over a user's report": (
        ["eval", "passkey", "--model", "bundled", "--lengths", "256", "--trials", "1", "--out", "res", "--resume"],
        {"res/report.md": "# my report"},
        ".",
        r"did not write \(report.md\)",
    ),
    "model path missing": (
        ["eval", "passkey", "--model", "./nosuchdir", "--lengths", "256", "--out", "o"],
        {},
        ".",
        "nosuchdir.*no such folder",
    ),
    "model name offline": (
        ["eval", "passkey", "--model", "nosuchmodel", "--lengths", "256", "--out", "o"],
        {},
        ".",
        "cannot load the model 'nosuchmodel'.*offline",
    ),
    "model folder without tokenizer": (
        ["eval", "passkey", "--model", "{notok}", "--lengths", "128", "--out", "o"],
        {},
        ".",
        "cannot load the tokenizer",
    ),
    "dtype": (
        ["eval", "passkey", "--model", "bundled", "--dtype", "fp64", "--lengths", "256", "--out", "o"],
        {},
        ".",
        "unknown dtype 'fp64'",
    ),
    "param that is not YAML": (
        [
            "eval",
            "passkey",
            "--model",
            "bundled",
            "--method",
            "yarn",
            "--factor",
            "2",
            "--param",
            "beta_fast=[1",
            "--lengths",
            "256",
            "--out",
            "o",
        ],
        {},
        ".",
        "--param beta_fast: cannot read",
    ),
    "factor without method": (
        ["eval", "passkey", "--model", "bundled", "--factor", "4", "--lengths", "256", "--out", "o"],
        {},
        ".",
        "--factor given without a scaling method \\(--method is none\\)",
    ),
    "malformed JSONL": (
        ["eval", "perplexity", "--model", "bundled", "--lengths", "64", "--data", "d.jsonl", "--out", "o"],
        {"d.jsonl": '{"text": "a"}\n{"text": \n'},
        ".",
        "cannot read d.jsonl",
    ),
    "empty text file": (
        ["eval", "perplexity", "--model", "bundled", "--lengths", "64", "--data", "e.txt", "--out", "o"],
        {"e.txt": "  \n\n"},
        ".",
        "e.txt holds no non-empty text",
    ),
    "dataset name offline": (
        ["eval", "perplexity", "--model", "bundled", "--lengths", "64", "--data", "someone/dataset", "--out", "o"],
        {},
        ".",
        "hub is offline",
    ),
    "length the data cannot reach": (
        ["eval", "perplexity", "--model", "bundled", "--lengths", "1m", "--out", "o"],
        {},
        ".",
        "cannot be reached",
    ),
    "configure over a file": (
        ["configure", "{tiny}", "--method", "yarn", "--factor", "2", "--out", "f.txt"],
        {"f.txt": "x"},
        ".",
        "is a file",
    ),
    "configure inside the source": (
        ["configure", "{tiny}", "--method", "yarn", "--factor", "2", "--out", "{tiny}/scaled"],
        {},
        ".",
        "overlaps the source",
    ),
    "recipe that is not YAML": (["train", "r.yaml"], {"r.yaml": "model: [unclosed\n"}, ".", "not valid YAML"),
    "recipe with a python tag": (
        ["train", "r.yaml"],
        {"r.yaml": "model: !!python/object/apply:os.system ['echo hi']\n"},
        ".",
        "not valid YAML",
    ),
    "check: unknown method": (["train", "tiny-cpu", "--check", "rope.method=yarnn"], {}, ".", "unknown method 'yarnn'"),
    "check: nan factor": (["train", "tiny-cpu", "--check", "rope.factor=.nan"], {}, ".", "rope.factor.*finite"),
    "check: unknown method parameter": (
        ["train", "tiny-cpu", "--check", "rope.params.beta_fst=3"],
        {},
        ".",
        "unknown parameter 'beta_fst'.*beta_fast",
    ),
    "check: infinite learning rate": (
        ["train", "tiny-cpu", "--check", "learning_rate=.inf"],
        {},
        ".",
        "learning_rate.*finite",
    ),
    "suite value of the wrong type": (
        ["eval", "compare", "s.yaml"],
        {"s.yaml": SUITE_BAD_TYPE},
        ".",
        "methods\\[0\\].factor: got 'four'",
    ),
    "suite method none with a factor": (
        ["eval", "compare", "s.yaml"],
        {"s.yaml": SUITE_NONE_FACTOR},
        ".",
        "factor given without a scaling method \\(method is none\\)",
    ),
    "spectrum into a folder": (
        ["plot", "spectrum", "--out", "pics"],
        {"pics/keep.txt": "x"},
        ".",
        "must name a .png file",
    ),
    "spectrum factor below 1": (["plot", "spectrum", "--factor", "0.5"], {}, ".", "factor must be >= 1"),
    "unknown recipe": (["train", "tiny-cpuu"], {}, ".", "did you mean 'tiny-cpu'"),
    "train tiled MLP on a mixture of experts": (
        [
            "train",
            "tiny-cpu",
            "memory.tiled_mlp=true",
            "output_dir=out",
            "data.max_docs=20",
            "model.config.model_type=mixtral",
            "model.config.num_local_experts=2",
            "model.config.num_experts_per_tok=1",
        ],
        {"notes.txt": "mine"},
        ".",
        r"memory.tiled_mlp: decoder layer 0's MLP is a mixture of experts \(MixtralSparseMoeBlock\)",
    ),
    "check: mlp tiles without tiled MLP": (
        ["train", "tiny-cpu", "--check", "memory.mlp_tiles=4"],
        {},
        ".",
        "memory.mlp_tiles: got 4; expected null unless memory.tiled_mlp is true",
    ),
}


def _tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Run every case (three at a time) and keep (exit code, stderr, files before, files after)."""
    shared = tmp_path_factory.mktemp("models")
    tiny_model("llama").save_pretrained(shared / "tiny")
    tiny_tokenizer().save_pretrained(shared / "tiny")
    tiny_model("llama").save_pretrained(shared / "notok")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    subs = {"{tiny}": str(shared / "tiny"), "{notok}": str(shared / "notok")}

    def run(name):
        args, files, where, _ = CASES[name]
        root = tmp_path_factory.mktemp("case")
        for rel, content in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(content)
        cwd = root / where
        cwd.mkdir(parents=True, exist_ok=True)
        args = [subs.get(a, a) if "{" not in a else a.format(**{k[1:-1]: v for k, v in subs.items()}) for a in args]
        before = {**_tree(root), **{f"shared/{k}": v for k, v in _tree(shared).items()}}
        proc = subprocess.run(
            [sys.executable, "-m", "rope_extend", *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        after = {**_tree(root), **{f"shared/{k}": v for k, v in _tree(shared).items()}}
        return name, (proc.returncode, proc.stderr, before, after)

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(pool.map(run, CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_user_error_is_one_line_exit_2_and_nothing_changes(results, name):
    import re

    code, stderr, before, after = results[name]
    assert "Traceback" not in stderr, stderr[-2000:]
    assert code == 2, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if line.startswith("rope-extend: error:")]
    assert len(lines) == 1, stderr[-2000:]
    assert re.search(CASES[name][3], lines[0]), lines[0]
    changed = {k: v for k, v in before.items() if after.get(k) != v}
    assert not changed, f"files changed or removed: {sorted(changed)}"


def test_every_case_names_a_real_entry_point():
    from rope_extend.cli import build_parser

    commands = set(build_parser()._subparsers._group_actions[0].choices)
    assert {args[0] for args, *_ in CASES.values()} <= commands
    assert json.dumps(sorted(CASES))  # names are plain strings (test ids)


def test_truncated_weights_are_one_line_exit_2_naming_the_file(tmp_path, monkeypatch, capsys):
    from rope_extend import fetch
    from rope_extend.cli import main

    folder = tmp_path / "m"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    runs = {
        "eval": ["eval", "passkey", "--model", str(folder), "--lengths", "64", "--trials", "1", "--out", "r"],
        "export": ["export", str(folder), "--to", "vllm", "--out", str(tmp_path / "v")],
    }
    monkeypatch.chdir(tmp_path)
    for argv in runs.values():
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"the model file {weights} is damaged (truncated" in err, err
        assert "copy or save the model again" in err
    assert not (tmp_path / "v").exists()
    # a damaged cached SmolLM2 names the command that fetches it again
    monkeypatch.setenv("ROPE_EXTEND_CACHE", str(tmp_path / "cache"))
    cached = tmp_path / "cache" / "smollm2-135m"
    cached.parent.mkdir()
    folder.rename(cached)
    (cached / fetch.SOURCE_FILE).write_text(json.dumps({"name": "smollm2-135m"}))
    capsys.readouterr()
    assert main(["export", "smollm2-135m", "--to", "vllm", "--out", str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rope-extend fetch smollm2-135m --force" in err, err
