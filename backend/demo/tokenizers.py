"""In-memory tokenizers for the demo models.

Real checkpoints ship their tokenizers; the demo models cannot download them, so we
build small ones with the same transformers classes (Qwen2Tokenizer, CLIPTokenizer,
T5Tokenizer): the trained demo:qwen-image's from the prompt grammar (one token a word),
the others from a sorted byte-level alphabet. Sorting matters: the alphabet comes
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


QWEN_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
                 "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                 "<|im_start|>assistant\n")  # QwenImagePipeline.prompt_template_encode (it drops the first 34 tokens)


def qwen_grammar_tokenizer() -> Qwen2Tokenizer:
    """A Qwen2Tokenizer whose byte-level BPE makes each word of the prompt grammar one token.

    The merges are learned (``tokenizers``' BPE trainer) from the chat template and every prompt
    of the grammar, so the template's prefix is exactly the 34 tokens QwenImagePipeline drops and
    a grammar prompt reaches the text encoder as ~9 tokens. Anything else still tokenizes, byte
    by byte: an unknown word works, it is just not drawn faithfully.
    """
    import json

    from tokenizers import Tokenizer, models, trainers

    from .data import SHAPES, colour_pairs, prompt_for

    base = Qwen2Tokenizer(vocab={ch: i for i, ch in enumerate(_alphabet())}, merges=[])
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = base.backend_tokenizer.pre_tokenizer  # Qwen's own split, so words match
    prompts = [prompt_for("digit", d, c, b) for d in range(10) for c, b in colour_pairs()]
    prompts += [prompt_for("shape", s, c, b) for s in SHAPES for c, b in colour_pairs()]
    prompts += [f"a {c} digit {d} moving {m} on a {b} background" for m in ("left", "right", "up", "down")
                for c, b in colour_pairs()[:1] for d in range(1)]
    prompts += ["", " ", "grayscale", "inverted colours", "outline"]  # the demo LoRAs' trigger words
    bpe.train_from_iterator([QWEN_TEMPLATE.format(p) for p in prompts], trainers.BpeTrainer(
        vocab_size=4096, min_frequency=1, initial_alphabet=_alphabet(), special_tokens=QWEN_SPECIALS,
        show_progress=False))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" "))
              for m in json.loads(bpe.to_str())["model"]["merges"]]
    tok = Qwen2Tokenizer(vocab=bpe.get_vocab(), merges=merges)
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS[1:]})
    tok.model_max_length = 1024
    prefix = tok(QWEN_TEMPLATE.split("{}")[0])["input_ids"]
    if len(prefix) != 34:  # the pipeline's prompt_template_encode_start_idx
        raise AssertionError(f"the chat-template prefix is {len(prefix)} tokens, the pipeline drops 34")
    return tok


def t5_grammar_tokenizer() -> T5Tokenizer:
    """A T5Tokenizer (the class Wan's UMT5 ships with) whose unigram pieces make each word of the prompt
    grammar one token (``▁red``, ``▁moving``, ``▁4``): a video prompt reaches the text encoder as ~11 tokens.
    Pieces: T5's specials first (pad 0, eos 1, unk 2), the grammar's words, then single characters, so
    anything else still tokenizes, character by character (not drawn faithfully, but not refused)."""
    from .data import GRAMMAR_WORDS

    words = sorted({*GRAMMAR_WORDS, *(str(d) for d in range(10))})
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [("\u2581" + w, 0.0) for w in words]
    pieces += [(chr(c), -10.0) for c in range(32, 127)]
    tok = T5Tokenizer(vocab=pieces, extra_ids=0)
    tok.model_max_length = 512
    return tok
