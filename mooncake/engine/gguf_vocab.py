"""Rebuilding a Hugging Face tokenizer from a GGUF file's ``tokenizer.*`` metadata.

A GGUF file carries no ``tokenizer.json``: llama.cpp stores the vocabulary
(``tokenizer.ggml.tokens``), the BPE merges, a type per token (normal, control,
user-defined, ...), the special token ids and a name for the pre-tokenizer
(``tokenizer.ggml.pre``). This module turns those back into a ``tokenizers.Tokenizer``
that splits text the way llama.cpp does for that pre-tokenizer name, plus the
``tokenizer_config.json`` / ``generation_config.json`` values.

Two kinds of vocabulary are supported:

- byte-level BPE (``tokenizer.ggml.model == "gpt2"``: Llama 3, Qwen 2/3, SmolLM,
  StarCoder, ...), with its merges stored in the file;
- SentencePiece (``"llama"``: Llama 2, Mistral, Gemma, ...): tokens with scores and no
  merges. llama.cpp tokenizes it as SentencePiece's BPE does: spaces become ``▁``,
  the text starts as single characters, and the adjacent pair whose joined text is the
  highest-scoring token is merged first, until none is a token; a character that is
  no token falls back to its UTF-8 bytes (``<0x41>`` tokens). That is a
  ``tokenizers`` BPE model whose merges are every split of every normal token into
  two tokens, ranked by the joined token's score, with ``byte_fallback``.

In both, control and user-defined tokens are matched whole in the raw text first, as
llama.cpp's special-token partition does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from mooncake.engine.tokenizer import bos_eos_post_processor

logger = logging.getLogger(__name__)

# llama.cpp token types (llama_token_type / gguf.TokenType).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6

SPM_SPACE = "\u2581"  # SentencePiece's visible space, "▁"
# End-of-turn tokens llama.cpp stops on besides EOS even when the file names no eot_token_id
# (llama-vocab.cpp's automatic EOT detection), as those models' generation_config lists them.
_AUTO_EOT_TOKENS = ("<end_of_turn>",)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> how llama.cpp splits text before BPE (llama-vocab.cpp).
_SPLIT_REGEX_PRE = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), QWEN2_SPLIT_REGEX),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}
# These split off every digit first, then apply the GPT-2 regex to what is left.
_DIGITS_THEN_GPT2_PRE = frozenset(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva"))
_GPT2_PRE = frozenset(("default", "gpt2", "gpt-2", "olmo", "mpt", "jais"))
# Qwen2's own tokenizer.json NFC-normalises text; llama.cpp does not, the model was
# trained with it, so we keep it (and transformers' Qwen2Tokenizer adds it too).
_NFC_PRE = frozenset(("qwen2",))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The ``tokenizers`` pre-tokenizer equivalent to llama.cpp's for ``tokenizer.ggml.pre``.

    Unknown names fall back to the GPT-2 split (what transformers does too), with a warning.
    """
    if pre in _SPLIT_REGEX_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_REGEX_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    if pre is not None and pre not in _GPT2_PRE:
        logger.warning("unknown tokenizer.ggml.pre %r; splitting text with the GPT-2 regex", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _token_at(tokens: list[str], metadata: Mapping[str, Any], key: str) -> tuple[str, int] | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    if token_id is None:
        return None
    token_id = int(token_id)
    if not 0 <= token_id < len(tokens):
        raise ValueError(f"tokenizer.ggml.{key} = {token_id} is outside the vocabulary of {len(tokens)} tokens")
    return tokens[token_id], token_id


def build_gguf_tokenizer(metadata: Mapping[str, Any]) -> Tokenizer:
    """Build a ``tokenizers.Tokenizer`` from GGUF tokenizer metadata.

    Control tokens become special added tokens (matched whole, skipped when decoding
    with ``skip_special_tokens``), user-defined tokens become plain added tokens, and a
    BOS / EOS post-processor is set from ``tokenizer.ggml.add_bos_token`` /
    ``add_eos_token``. Raises ``ValueError`` for a vocabulary that is neither byte-level
    BPE (``gpt2``) nor SentencePiece (``llama``), or lacks tokens, merges or scores.
    """
    model_type = metadata.get("tokenizer.ggml.model")
    if model_type == "llama":
        tokenizer = _sentencepiece_tokenizer(metadata)
    elif model_type == "gpt2":
        tokenizer = _byte_level_tokenizer(metadata)
    else:
        raise ValueError(
            f"unsupported GGUF tokenizer model {model_type!r}: supported are byte-level BPE ('gpt2') "
            "and SentencePiece ('llama') vocabularies"
        )
    tokens = metadata["tokenizer.ggml.tokens"]
    tokenizer.post_processor = bos_eos_post_processor(
        _token_at(tokens, metadata, "bos_token_id"),
        _token_at(tokens, metadata, "eos_token_id"),
        bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
    )
    return tokenizer


def _token_types(metadata: Mapping[str, Any], tokens: list[str]) -> list[int]:
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens))
    if len(token_types) != len(tokens):
        raise ValueError(f"{len(token_types)} token types for {len(tokens)} tokens in GGUF tokenizer metadata")
    return token_types


def spm_merges(tokens: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    """The BPE merges equivalent to SentencePiece-BPE merging by score.

    Every normal token of two or more characters yields one merge per way of cutting it
    into two tokens; merges are ranked by the joined token's score, best first (ties by
    id). Called once per conversion; about a second for Gemma's 262k tokens.
    """
    ids: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        ids.setdefault(token, token_id)
    ranked: list[tuple[float, int, int, str, str]] = []
    for token_id, (token, score, token_type) in enumerate(zip(tokens, scores, token_types)):
        if token_type != TOKEN_TYPE_NORMAL or len(token) < 2 or ids[token] != token_id:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-float(score), token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _sentencepiece_tokenizer(metadata: Mapping[str, Any]) -> Tokenizer:
    tokens = metadata.get("tokenizer.ggml.tokens")
    scores = metadata.get("tokenizer.ggml.scores")
    if not tokens or not scores or len(scores) != len(tokens):
        raise ValueError("GGUF SentencePiece metadata lacks tokenizer.ggml.tokens or a score for every token")
    token_types = _token_types(metadata, tokens)
    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    for token_id, (token, token_type) in enumerate(zip(tokens, token_types)):
        if token_type in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED):
            # llama.cpp matches these in the raw text, before spaces become "▁".
            added.append(AddedToken(token, special=token_type == TOKEN_TYPE_CONTROL, normalized=False))
        vocab.setdefault(token, token_id)
    unk = _token_at(tokens, metadata, "unknown_token_id")
    model = models.BPE(
        vocab=vocab,
        merges=spm_merges(tokens, scores, token_types),
        unk_token=unk[0] if unk else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    # llama.cpp prefixes a space to the text and to every piece after a special token
    # when add_space_prefix (SentencePiece's default); Gemma's files turn it off.
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", SPM_SPACE)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPM_SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    if added:
        tokenizer.add_tokens(added)
    return tokenizer


def _byte_level_tokenizer(metadata: Mapping[str, Any]) -> Tokenizer:
    tokens = metadata.get("tokenizer.ggml.tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ValueError("GGUF tokenizer metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    token_types = _token_types(metadata, tokens)

    alphabet = set(bytes_to_unicode().values())
    spelling = bytes_to_unicode()
    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    for token_id, (token, token_type) in enumerate(zip(tokens, token_types)):
        if token_type in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED):
            # Matched whole in the raw text, so its spelling stays as written.
            added.append(AddedToken(token, special=token_type == TOKEN_TYPE_CONTROL, normalized=False))
        elif not set(token) <= alphabet:
            # A few converters write plain text for a byte-level token; respell it as bytes.
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, token_id)
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ValueError(f"malformed BPE merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((left, right))

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    pre = metadata.get("tokenizer.ggml.pre")
    if pre in _NFC_PRE:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    if added:
        tokenizer.add_tokens(added)
    return tokenizer


def gguf_tokenizer_config(metadata: Mapping[str, Any], model_max_length: int | None) -> dict[str, Any]:
    """The ``tokenizer_config.json`` values a GGUF's tokenizer metadata implies.

    Special tokens are given by content (``bos_token`` etc.), ``add_bos_token`` /
    ``add_eos_token`` as the file states them (default False), and the chat template
    from ``tokenizer.chat_template`` when present.
    """
    tokens = list(metadata.get("tokenizer.ggml.tokens") or [])
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        found = _token_at(tokens, metadata, key)
        config[name] = found[0] if found else None
    config["add_bos_token"] = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    config["add_eos_token"] = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    config["clean_up_tokenization_spaces"] = False
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    template = metadata.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def gguf_generation_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """``generation_config.json`` values: BOS, and every end-of-generation id the file names.

    llama.cpp stops on EOS and also on the end-of-turn / end-of-message tokens
    (``eot_token_id``, ``eom_token_id``, and a control token named ``<end_of_turn>``
    that it recognises by name), so all of them are listed as EOS ids.
    """
    config: dict[str, Any] = {}
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    token_types = metadata.get("tokenizer.ggml.token_type") or []
    for name in _AUTO_EOT_TOKENS:
        if name in tokens:
            token_id = tokens.index(name)
            if token_id < len(token_types) and token_types[token_id] == TOKEN_TYPE_CONTROL and token_id not in eos_ids:
                eos_ids.append(token_id)
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    pad = metadata.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        config["pad_token_id"] = int(pad)
    return config
