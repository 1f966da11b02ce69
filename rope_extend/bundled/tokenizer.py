"""The bundled model's tokenizer: a byte-level BPE trained on the synthetic corpus.

Digits are split one per token (as in Llama and Mistral), so a passkey of any length is spelled the
same way wherever it appears and numbers never merge with the words around them. Byte-level, so any
text encodes. Training is deterministic for a given corpus.
"""

from __future__ import annotations

from typing import Iterable

SPECIAL = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024):
    """A ``PreTrainedTokenizerFast`` (BOS added in front of every encoded text, EOS known for packing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   model_max_length=1 << 20)
