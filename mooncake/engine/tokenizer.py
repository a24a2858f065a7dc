"""The serving-side tokenizer: text <-> token ids, chat templates, streaming detokenization.

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` (the Rust tokenizer behind transformers'
fast tokenizers) plus what ``tokenizer_config.json`` / ``generation_config.json`` add:
special tokens, BOS/EOS behaviour and the Jinja chat template. It is built to give the
same ids and the same rendered prompts as ``transformers.AutoTokenizer`` on the same
directory, without importing transformers. The gateway owns one per model and calls
it once per request (encode, render) and once per generated token (streaming).

``IncrementalDetokenizer`` turns a stream of generated ids into a stream of text
pieces whose concatenation equals ``decode()`` of all ids (after ``flush()``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from mooncake.engine.chat_template import render_chat_template
from mooncake.engine.weights import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    read_json_object,
)

CHAT_TEMPLATE_FILE = "chat_template.jinja"
_TEMPLATE_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def bos_eos_post_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None, add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """A post-processor adding BOS / EOS around a sequence, shaped as transformers shapes it."""
    use_bos = bos if add_bos else None
    use_eos = eos if add_eos else None
    single = (f"{use_bos[0]}:0 " if use_bos else "") + "$A:0" + (f" {use_eos[0]}:0" if use_eos else "")
    pair = single + (f" {use_bos[0]}:1" if use_bos else "") + " $B:1" + (f" {use_eos[0]}:1" if use_eos else "")
    special = [token for token in (use_bos, use_eos) if token is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"cannot read a special token from {value!r}")


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


def _pick_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, Mapping)}
        return named.get("default")
    raise ValueError(f"unreadable chat_template of type {type(value).__name__}")


class Tokenizer:
    """A model's tokenizer and chat template, as the serving path needs them.

    Build it with :meth:`from_dir` for a model directory, or directly from a
    ``tokenizers.Tokenizer`` (no files needed). Thread-safe for concurrent encode /
    decode (the Rust tokenizer is), and cheap to call per request.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        chat_template: str | None = None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        """Wrap ``backend``; ``special_tokens`` maps bos_token/eos_token/unk_token/pad_token
        to their text, and ``eos_token_ids`` lists the ids that end generation (the EOS
        token's id is always included)."""
        self._backend = backend
        tokens = dict(special_tokens or {})
        unknown = set(tokens) - set(_TEMPLATE_TOKEN_NAMES)
        if unknown:
            raise ValueError(f"unknown special token names {sorted(unknown)}; expected {_TEMPLATE_TOKEN_NAMES}")
        self._special_tokens = {name: text for name, text in tokens.items() if text is not None}
        # unk/pad only reach the template as text; BOS and EOS must also have ids.
        for name in ("bos_token", "eos_token"):
            text = self._special_tokens.get(name)
            if text is not None and backend.token_to_id(text) is None:
                raise ValueError(f"{name} {text!r} is not in the vocabulary")
        self._chat_template = chat_template
        eos = set(int(i) for i in eos_token_ids)
        if "eos_token" in self._special_tokens:
            eos.add(int(backend.token_to_id(self._special_tokens["eos_token"])))
        self._eos_token_ids = frozenset(eos)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> Tokenizer:
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` (+ generation/config ids).

        BOS/EOS insertion follows tokenizer.json's post-processor, as transformers 5 does;
        ``add_bos_token`` / ``add_eos_token`` from tokenizer_config only apply when
        tokenizer.json has none (the directories we write keep both in agreement). The
        chat template comes from ``chat_template.jinja`` if present,
        else from tokenizer_config. Raises ``FileNotFoundError`` if the directory or its
        ``tokenizer.json`` is missing, ``ValueError`` for unreadable files.
        """
        path = Path(model_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
        tokenizer_file = path / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{str(path)!r} has no {TOKENIZER_FILE}")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception for bad JSON
            raise ValueError(f"{str(tokenizer_file)!r} is not a valid tokenizers file: {exc}") from exc
        config = read_json_object(path / TOKENIZER_CONFIG_FILE)
        generation = read_json_object(path / GENERATION_CONFIG_FILE)
        special = {name: _token_content(config.get(name)) for name in _TEMPLATE_TOKEN_NAMES}

        if backend.post_processor is None:
            # tokenizer.json decides BOS/EOS insertion when it says anything (as in
            # transformers 5); only a file without a post-processor takes the flags.
            def entry(name: str) -> tuple[str, int] | None:
                text = special.get(name)
                token_id = backend.token_to_id(text) if text is not None else None
                return (text, token_id) if text is not None and token_id is not None else None

            backend.post_processor = bos_eos_post_processor(
                entry("bos_token"),
                entry("eos_token"),
                bool(config.get("add_bos_token", False)),
                bool(config.get("add_eos_token", False)),
            )

        template_file = path / CHAT_TEMPLATE_FILE
        template = (
            template_file.read_text(encoding="utf-8")
            if template_file.is_file()
            else _pick_template(config.get("chat_template"))
        )
        eos_ids = _ids(generation.get("eos_token_id"))
        if not eos_ids and special.get("eos_token") is None:
            eos_ids = _ids(read_json_object(path / CONFIG_FILE).get("eos_token_id"))
        return cls(backend, special_tokens=special, chat_template=template, eos_token_ids=eos_ids)

    @property
    def backend(self) -> BackendTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids the tokenizer can produce (added tokens included)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        """Id of the BOS token, or None if the tokenizer has none."""
        text = self._special_tokens.get("bos_token")
        return None if text is None else self._backend.token_to_id(text)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: generation_config's eos ids plus the EOS token."""
        return self._eos_token_ids

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template source, or None."""
        return self._chat_template

    def token_to_id(self, token: str) -> int | None:
        """The id of a token given in its vocabulary spelling, or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary spelling of an id, or None if out of range."""
        return self._backend.id_to_token(int(token_id))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS/EOS added per the tokenizer when ``add_special_tokens``.

        Special tokens written in the text (e.g. ``<|im_start|>``) become their ids.
        """
        if not isinstance(text, str):
            raise ValueError(f"encode() needs a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens (BOS, EOS, control tokens) dropped when asked."""
        vocab = self.vocab_size
        checked = [int(i) for i in ids]
        bad = [i for i in checked if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary of {vocab}")
        return self._backend.decode(checked, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Render ``messages`` with the model's chat template, exactly as transformers does.

        ``template_kwargs`` (e.g. ``tools``, ``enable_thinking``) are passed to the template.
        Raises ``ValueError`` if the model has no chat template or the template rejects the
        conversation (its ``raise_exception`` message is kept).
        """
        if self._chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        variables = {**self._special_tokens, **template_kwargs}
        return render_chat_template(self._chat_template, messages, add_generation_prompt, variables)

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered conversation.

        The template decides about BOS (templates that need one write ``{{ bos_token }}``),
        so no special tokens are added on top: BOS never appears twice. This is what
        transformers' ``apply_chat_template(tokenize=True)`` and vLLM's chat endpoint do.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


def tokenizer_or_none(model_dir: str | Path) -> Tokenizer | None:
    """The model's tokenizer, or None for a model shipped without one (a worker that samples a grammar's first token
    then refuses structured output)."""
    try:
        return Tokenizer.from_dir(model_dir)
    except (OSError, ValueError) as e:
        logging.getLogger(__name__).info("no tokenizer for %s (%s): structured output will be refused", model_dir, e)
        return None


class IncrementalDetokenizer:
    """Streams text for generated ids, holding back incomplete UTF-8.

    Keeps a small window of ids: ``prefix`` marks where the last emitted piece's
    context starts, ``read`` where unemitted ids start. Each push decodes the window
    twice (up to ``read``, and to the end) and emits the difference unless it ends in
    U+FFFD (a multi-byte character still cut in half), as vLLM's
    ``detokenize_incrementally`` does. Decoding from ``prefix`` rather than ``read``
    keeps tokenizers that drop a leading space of the first token (SentencePiece) right.

    ``"".join(pushes) + flush() == tokenizer.decode(all generated ids)``. One instance
    per request; ``push`` is called once per engine step.
    """

    _CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        """Start a stream after ``prompt_ids`` (their tail is used as decoding context only)."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = [int(i) for i in prompt_ids][-self._CONTEXT_TOKENS :]
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)
        self._emitted: list[str] = []

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def push(self, token_ids: Sequence[int] | int) -> str:
        """Add newly generated ids; return the text they complete (possibly "")."""
        new = [int(token_ids)] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        if not new:
            return ""
        self._ids.extend(new)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        piece = full_text[len(prefix_text) :]
        # Slide the window: the ids just emitted become the next piece's context.
        self._ids = self._ids[self._read :]
        self._prefix, self._read = 0, len(self._ids)
        self._emitted.append(piece)
        return piece

    def flush(self) -> str:
        """Emit whatever is held back (at the end of the stream), replacement chars included."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        piece = full_text[len(prefix_text) :]
        self._ids = self._ids[len(self._ids) :]
        self._prefix = self._read = 0
        if piece:
            self._emitted.append(piece)
        return piece

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)
