"""In-memory tokenizers for the demo models.

Real checkpoints ship their tokenizers; the demo models cannot download them, so we
build small ones with the same transformers classes (Qwen2Tokenizer, CLIPTokenizer,
T5Tokenizer) from a sorted byte-level alphabet. Sorting matters: the alphabet comes
back in a random order, and token ids (so outputs) would change between builds.
"""
from __future__ import annotations

from tokenizers import pre_tokenizers
from transformers import CLIPTokenizer, Qwen2Tokenizer, T5Tokenizer

QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]


def _alphabet() -> list[str]:
    return sorted(pre_tokenizers.ByteLevel.alphabet())


def qwen_tokenizer() -> Qwen2Tokenizer:
    vocab = {ch: i for i, ch in enumerate(_alphabet())}
    for tok in QWEN_SPECIALS:
        vocab[tok] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS[1:]})
    tok.model_max_length = 1024
    return tok


def clip_tokenizer() -> CLIPTokenizer:
    vocab = {}
    for ch in _alphabet():
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    for tok in ("<|startoftext|>", "<|endoftext|>"):
        vocab[tok] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tokenizer() -> T5Tokenizer:
    # Unigram pieces: specials first (pad=0, eos=1, unk=2 as in T5), then characters.
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(chr(c), -2.0) for c in range(32, 127)]
    tok = T5Tokenizer(vocab=pieces, extra_ids=0)
    tok.model_max_length = 512
    return tok


def vocab_size(tok) -> int:
    return len(tok)
