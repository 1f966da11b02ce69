"""mkdocs hook: serve the measured plots in eval/reports/ with the site, at the same relative paths as in the
repository (eval/reports/...), so that the pages show the PNGs the benchmarks and suites wrote."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def on_files(files, config):
    for png in sorted((ROOT / "eval" / "reports").rglob("*.png")):
        uri = png.relative_to(ROOT).as_posix()
        files.append(File(uri, src_dir=str(ROOT), dest_dir=config["site_dir"], use_directory_urls=False))
    return files
