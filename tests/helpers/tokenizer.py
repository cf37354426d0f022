"""A tiny character-level tokenizer matching the tiny test models' vocabulary (64 ids)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,:?!#\n()-+*/=$QA'"


def tiny_tokenizer(add_bos: bool = True) -> PreTrainedTokenizerFast:
    """Ids: <pad>=0, </s>=1, <s>=2, <unk>=3, then one id per character of ``CHARS`` (all below 64)."""
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, "<unk>": 3}
    vocab.update({c: 4 + i for i, c in enumerate(CHARS)})
    assert len(vocab) <= 64
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                   unk_token="<unk>")
