"""A `tokenizers` Tokenizer rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF carries no tokenizer.json: it stores the vocabulary, the merges, each token's type
and the special token ids, and names the pre-tokenizer (`tokenizer.ggml.pre`) by the regex
family llama.cpp splits text with. The same pieces are assembled here into the Rust
library's BPE, so encoding runs at its speed and matches what the checkpoint was trained
with. Byte-level BPE (`tokenizer.ggml.model` = gpt2: GPT-2, SmolLM, Llama 3, StarCoder...)
is supported; SentencePiece vocabularies are a start-up error saying so.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from model_service.errors import ModelLoadError
from model_service.loading.gguf_file import GGUFFile
from model_service.text.tokenizer import HFTokenizer

# llama.cpp's token types (gguf.TokenType).
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_split():
    # GPT-2's own regex, which ByteLevel applies itself.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_split():
    # llama.cpp's "\p{N}" first, then GPT-2's regex: every digit its own word (as in these
    # models' own tokenizer.json: Digits(individual_digits) before ByteLevel).
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


def _llama3_split():
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# tokenizer.ggml.pre -> (pre-tokenizer, ignore_merges), grouped as llama-vocab.cpp groups them.
_PRE_TOKENIZERS = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "mpt", "olmo", "jais"), (_gpt2_split, False)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
                    (_digits_then_gpt2_split, False)),
    # Llama 3's tokenizer takes a whole word that is in the vocabulary before any merge.
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"), (_llama3_split, True)),
}
SUPPORTED_TOKENIZER_MODELS = ("gpt2",)


def tokenizer_from_gguf(file: GGUFFile, eos_token_ids: tuple[int, ...], bos_token_id: int | None) -> HFTokenizer:
    kind = file.value("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise ModelLoadError(
            f"{file.path}: tokenizer.ggml.model {kind!r} is unsupported; supported: "
            f"{', '.join(SUPPORTED_TOKENIZER_MODELS)} (byte-level BPE)"
        )
    pre = file.value("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{file.path}: tokenizer.ggml.pre {pre!r} is unsupported; supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    tokens: list[str] = file.require("tokenizer.ggml.tokens")
    merges: list[str] = file.require("tokenizer.ggml.merges")
    token_types: list[int] = file.value("tokenizer.ggml.token_type") or []
    split, ignore_merges = _PRE_TOKENIZERS[pre]

    tokenizer = Tokenizer(models.BPE(
        vocab={token: index for index, token in enumerate(tokens)},
        merges=[tuple(merge.split(" ", 1)) for merge in merges],
        ignore_merges=ignore_merges,
    ))
    tokenizer.pre_tokenizer = split()
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>) are matched whole in text and skipped when decoding with
    # skip_special_tokens; user-defined ones (<think>) are matched whole and kept.
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    typed = list(zip(tokens, token_types))
    tokenizer.add_special_tokens([
        AddedToken(token, special=True, normalized=False)
        for token, kind in typed if kind == _CONTROL and set(token) <= alphabet
    ])
    tokenizer.add_tokens([
        AddedToken(token, special=False, normalized=False) for token, kind in typed if kind == _USER_DEFINED
    ])
    tokenizer.post_processor = _post_processor(file, tokens, bos_token_id, eos_token_ids)
    return HFTokenizer(tokenizer, eos_token_ids, bos_token_id)


def _post_processor(file: GGUFFile, tokens: list[str], bos_token_id: int | None, eos_token_ids: tuple[int, ...]):
    """BOS (and EOS) around every encoding that adds special tokens, as the file's add_bos_token
    and add_eos_token flags say (byte-level files default to neither, as llama.cpp does)."""
    add_bos = bool(file.value("tokenizer.ggml.add_bos_token", False)) and bos_token_id is not None
    add_eos = bool(file.value("tokenizer.ggml.add_eos_token", False)) and bool(eos_token_ids)
    if not (add_bos or add_eos):
        return None
    specials, single = [], ["$A"]
    if add_bos:
        specials.append((tokens[bos_token_id], bos_token_id))
        single.insert(0, tokens[bos_token_id])
    if add_eos:
        eos = eos_token_ids[0]
        specials.append((tokens[eos], eos))
        single.append(tokens[eos])
    pair = [*single, *[piece if piece != "$A" else "$B" for piece in single]]
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair), special_tokens=specials)
