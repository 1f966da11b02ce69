"""A tour of rope-extend's core on a tiny random Llama (offline, a few seconds).

    python examples/quickstart.py

1. How each method rescales Llama-2's rotary frequencies for 4x its 4096-token context.
2. The two-line patch on a model, what it writes into the config, and that it equals a model built
   from the configured config.
3. Save and reload with the scaling kept; unpatch restores the original bit for bit.
"""

import tempfile

import torch
import transformers as T

import rope_extend


def spectrum_table():
    print("1. Llama-2 geometry (head_dim 128, base 10000, L 4096), factor 4")
    print(f"   {'method':14}{'highest freq x':>16}{'median freq x':>16}{'lowest freq x':>16}{'attn scale':>12}")
    plain, _ = rope_extend.inv_freq("linear", 128, 10000.0, 1.0, 4096)
    for method in rope_extend.method_names():
        params = (
            {"short_factor": [1.0] * 64, "long_factor": [1.0 + 3.0 * i / 63 for i in range(64)]}
            if method == "longrope"
            else {}
        )
        seq_len = 4 * 4096 if rope_extend.get_method(method).dynamic else None
        freqs, scale = rope_extend.inv_freq(method, 128, 10000.0, 4.0, 4096, seq_len=seq_len, **params)
        ratio = freqs / plain
        print(f"   {method:14}{ratio[0].item():>16.4f}{ratio[32].item():>16.4f}{ratio[-1].item():>16.4f}{scale:>12.4f}")
    print("   (dynamic methods shown at 16384 tokens; longrope with illustrative factors)\n")


def main():
    spectrum_table()
    config = T.LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 1000, (1, 1500))
    with torch.no_grad():
        original = model(ids).logits

    print("2. rope_extend.patch(model, 'yarn', factor=4)")
    rope_extend.patch(model, "yarn", factor=4)
    print(f"   rope_parameters: {model.config.rope_parameters}")
    print(
        f"   max_position_embeddings: {model.config.max_position_embeddings} "
        f"(original {model.config.original_max_position_embeddings})"
    )
    configured = rope_extend.configure(T.LlamaConfig(**config.to_dict()), "yarn", factor=4)
    twin = T.LlamaForCausalLM(configured).eval()
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        patched = model(ids).logits
        same = torch.equal(patched, twin(ids).logits)
    print(f"   logits equal to a model built from the configured config: {same}\n")

    print("3. save, reload, unpatch")
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        reloaded = T.AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            print(f"   reloaded logits identical: {torch.equal(reloaded(ids).logits, patched)}")
    rope_extend.unpatch(model)
    with torch.no_grad():
        print(f"   unpatched logits bit-identical to the original: {torch.equal(model(ids).logits, original)}")


if __name__ == "__main__":
    main()
