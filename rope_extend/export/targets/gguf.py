"""llama.cpp: one GGUF file, weights, tokenizer and the scaling in llama.cpp's own metadata keys (``llamacpp``;
the families it writes, each as its llama.cpp architecture, in ``gguf_families``)."""

from __future__ import annotations

from ...errors import RopeExtendError
from ...hf.reading import nested_layer_types
from ...io import normal_permissions, writing
from ...loading import load_model, load_tokenizer
from ...methods._common import rope_frequencies
from ...methods.engine_form import DEFAULT, Form
from ...methods.resolved import Scaling
from .. import llamacpp
from ..gguf_families import FAMILIES, rope_layer
from .base import APPROXIMATE, Decision, ExportJob, ExportOptions, ExportResult, ExportTarget, longrope_switch


class GgufTarget(ExportTarget):
    name = "gguf"
    engine = llamacpp.LLAMACPP_VERSION
    writes = "a GGUF file: weights (f32, f16, bf16 or q8_0), tokenizer, the scaling in llama.cpp's rope keys"

    def check(self, options: ExportOptions) -> None:
        llamacpp.check_dtype(options.dtype)

    def rope_layer(self, config) -> str | None:
        """The global layers of a family whose sliding layers llama.cpp keeps at their own base, unscaled
        (Gemma 3: ``gguf_families``); None for one flat dict."""
        kind = getattr(config, "model_type", None)
        fam = FAMILIES.get(kind) if isinstance(kind, str) else None
        return rope_layer(fam) if fam is not None and nested_layer_types(config) else None

    def decide(self, scaling: Scaling | None, form: Form | None, base: float) -> Decision | None:
        if scaling is not None and scaling.method.name == "self_extend":
            return Decision(
                APPROXIMATE,
                Form(DEFAULT, float(base)),
                "llama.cpp runs its own group attention (--grp-attn-n G --grp-attn-w W, accepted by "
                "llama-completion only; llama-cli and llama-server reject them), which groups the cache in blocks "
                "of W instead of Self-Extend's per-query neighbour window, so positions differ from rope-extend's",
            )
        return longrope_switch(self.engine, form)

    def write(self, job: ExportJob) -> ExportResult:
        form, scaling = job.decision.served, job.scaling
        extend = scaling if scaling is not None and job.method == "self_extend" else None
        llamacpp.check_context(  # before anything is read or written: the writer would fail in struct.pack
            job.length,
            scaling.factor if scaling is not None else None,
            scaling.original_max_position_embeddings if scaling is not None else None,
        )
        fam = llamacpp.check_family(job.config, form, job.length)  # before any weight is read
        model, tokenizer = job.model, job.tokenizer
        if model is None:
            trust = job.options.trust_remote_code
            model = load_model(str(job.source), trust_remote_code=trust)
            tokenizer = tokenizer or load_tokenizer(str(job.source), trust_remote_code=trust)
        if tokenizer is None:
            raise RopeExtendError("a GGUF file carries the tokenizer: pass tokenizer= with the model")
        plain = rope_frequencies(job.dim, job.base)
        scaled = (
            scaling.compute(job.dim, job.base, job.length)[0] if scaling is not None and form.kind != DEFAULT else plain
        )
        keys, tensors, how = llamacpp.rope_metadata(form, plain, scaled, fam.divisors)
        extra: list[str] = []
        tool = "llama-server"
        if extend is not None:
            rules = extend.rules()
            extra, tool = llamacpp.self_extend_flags(rules.group_size, rules.window), "llama-completion"
            how = f"plain RoPE; {' '.join(extra)} on the command line"
        # the file's context_length is what llama.cpp serves without flags: for self_extend that is plain RoPE,
        # which holds only to L, so the file says L (and llama.cpp warns past it); the command asks for the target
        # length together with the group-attention flags
        context = extend.original_max_position_embeddings if extend is not None else job.length
        with writing(job.out) as tmp:
            tokenizer_notes = llamacpp.write(
                tmp,
                model,
                tokenizer,
                keys,
                tensors,
                context=context,
                dtype=job.options.dtype,
                tokenizer_pre=job.options.tokenizer_pre,
            )
            normal_permissions(tmp)
        command = llamacpp.serve_command(job.out, job.length, extra, tool)
        return ExportResult(
            out=job.out,
            target=self.name,
            engine=self.engine,
            method=job.method,
            how=how,
            command=command,
            notes=job.notes + tokenizer_notes,
        )


TARGET = GgufTarget()
