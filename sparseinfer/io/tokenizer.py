"""Tokenizers: text <-> token ids, for GGUF files and Hugging Face model folders.

Encoding runs on the Rust `tokenizers` library. For a GGUF file we assemble that tokenizer
ourselves from the metadata, following llama.cpp's reading of it:

* `tokenizer.ggml.model == "gpt2"`: byte-level BPE with the file's merges. Text is first split by
  the regex(es) that belong to `tokenizer.ggml.pre` (the same table llama.cpp keeps), then each
  piece is byte-level BPE encoded.
* `tokenizer.ggml.model == "llama"`: a SentencePiece BPE vocabulary. Merges are derived from the
  scores (a pair merges when the merged piece is in the vocabulary; higher score first), spaces are
  spelled `▁` with one prepended to every run of text (`add_space_prefix`), and characters outside
  the vocabulary fall back to `<0xNN>` byte tokens.
* Control tokens (type 3) are added as special tokens and user-defined tokens (type 4) as plain
  added tokens, so both are matched whole in the text. `parse_special=False` turns the first off.

Decoding does not use `tokenizers`: every token id maps to the exact bytes it stands for, and a
decode is the concatenation of those bytes (one leading space dropped for SentencePiece
vocabularies that prepend one). That makes streaming exact: `StreamDetokenizer` feeds the same
bytes through an incremental UTF-8 decoder, so it never emits half a character and the
concatenated pieces always equal `decode(all_ids)`.
"""
from __future__ import annotations

import codecs
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..errors import ModelFormatError, UnsupportedError
from .chat_template import ChatTemplate, NoChatTemplateError, select_template

log = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPIECE_SPACE = "\u2581"  # ▁
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

# --------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, keyed by `tokenizer.ggml.pre`. A list is applied in order, each regex
# splitting every piece the previous one produced (matches and the text between them both kept),
# which is how llama.cpp runs them. Where llama.cpp rewrote a regex for its own engine we use
# the model's original (tokenizer.json) spelling, which the onig engine of `tokenizers` runs.
# --------------------------------------------------------------------------------------------
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_V3 = [
    r"\p{N}{1,3}",
    r"[一-龥\u3040-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"]
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"

_PRE_SPLITS: dict[str, list[str]] = {}
for _names, _regexes in (
    (("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "jina-v1-en",
      "jina-v2-es", "jina-v2-de", "jina-v2-code", "roberta-bpe"), [_GPT2]),
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"), [r"\p{N}", _GPT2]),
    (("qwen2", "stablelm2", "deepseek-r1-qwen", "hunyuan", "megrez", "kormo"), [_QWEN2]),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "dbrx",
      "smaug-bpe", "chatglm-bpe", "bailingmoe"), [_LLAMA3]),
    (("tekken",), [_TEKKEN]),
    (("gpt-4o", "llama4", "minimax-m2", "kanana2"), [_GPT4O]),
    (("deepseek-v3",), _DEEPSEEK_V3),
    (("deepseek-coder",), _DEEPSEEK_CODER),
    (("falcon",), [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"]),
    (("poro-chat", "bloom", "gpt3-finnish"), [_BLOOM]),
    (("viking",), [_BLOOM, r"\p{N}"]),
    # llama.cpp's fallback for BPE vocabularies converted without a known pre-tokenizer
    (("default",), [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]),
):
    for _n in _names:
        _PRE_SPLITS[_n] = _regexes

# pre-tokenizer types for which llama.cpp takes a whole pre-token that is in the vocabulary as is
# (tokenizer.json's `ignore_merges`), and adds BOS unless the file says otherwise
_LLAMA3_LIKE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "tekken"}

# Token texts that end a turn / the text (llama.cpp's end-of-generation set)
EOG_TOKEN_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
)
# fill-in-the-middle pad / repo / file separators: llama.cpp also stops on these (control tokens only)
_FIM_EOG_TEXTS = ("<|fim_pad|>", "<fim_pad>", "<fim-pad>", "<|repo_name|>", "<reponame>", "<|file_sep|>", "<file_sep>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte gets a printable character (printable Latin-1 bytes
    keep their own character, the rest are moved to U+0100 and up, in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


_B2U = bytes_to_unicode()
_U2B = {c: b for b, c in _B2U.items()}
_ALPHABET = frozenset(_U2B)
_BYTELEVEL_TABLE = {ord(c): chr(b) for c, b in _U2B.items()}  # str.translate table: alphabet char -> latin-1 byte


def _bytelevel_to_bytes(token: str) -> bytes:
    """Bytes a byte-level token stands for; text outside the alphabet is taken as raw UTF-8 (as the
    `tokenizers` ByteLevel decoder does)."""
    if _ALPHABET.issuperset(token):
        return token.translate(_BYTELEVEL_TABLE).encode("latin-1")
    return token.encode("utf-8")


def _bytes_to_bytelevel(data: bytes) -> str:
    return "".join(_B2U[b] for b in data)


class Tokenizer:
    """Text <-> token ids for one model. Build with `from_gguf_metadata`, `from_gguf` or `from_folder`.

    Attributes: `bos_id` (int|None), `eos_id` (the model's EOS, int|None), `eos_ids` (every id that
    ends generation), `add_bos`, `add_eos`, `vocab_size`, `chat_template` (source or None),
    `backend` (the `tokenizers.Tokenizer` used for encoding).
    """

    def __init__(
        self,
        backend,
        *,
        tokens: Sequence[str],
        attrs: Sequence[int],
        pieces: Sequence[bytes] | None,
        strip_leading_space: bool = False,
        bos_id: int | None = None,
        eos_id: int | None = None,
        eos_ids: Iterable[int] = (),
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | Mapping[str, str] | None = None,
        kind: str = "",
    ):
        self.backend = backend
        self._backend_plain = None  # copy that encodes special tokens as text (parse_special=False)
        self._tokens = list(tokens)
        self._attrs = list(attrs)
        self._pieces = list(pieces) if pieces is not None else None  # None: decode with the backend
        self._special = [a in (CONTROL, UNKNOWN) for a in self._attrs]
        self.strip_leading_space = bool(strip_leading_space)
        self.vocab_size = len(self._tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eos_ids: set[int] = {int(i) for i in eos_ids if i is not None and 0 <= int(i) < self.vocab_size}
        if eos_id is not None:
            self.eos_ids.add(int(eos_id))
        self.add_bos = bool(add_bos) and bos_id is not None
        self.add_eos = bool(add_eos) and eos_id is not None
        self.kind = kind
        self._token_to_id: dict[str, int] | None = None
        if isinstance(chat_template, Mapping):
            self.chat_templates = dict(chat_template)
            self.chat_template = select_template(self.chat_templates)
        else:
            self.chat_templates = {"default": chat_template} if chat_template else {}
            self.chat_template = chat_template or None
        self._compiled_templates: dict[str | None, ChatTemplate] = {}

    # ------------------------------------------------------------------ construction: GGUF
    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        from .gguf import open_reader, read_metadata

        return cls.from_gguf_metadata(read_metadata(open_reader(path)))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if model is None or not tokens:
            raise ModelFormatError(
                "the GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing); "
                "re-convert the model with its tokenizer"
            )
        tokens = list(tokens)
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        attrs = [int(t) for t in types] if types is not None else [NORMAL] * n
        if len(attrs) != n:
            raise ModelFormatError(f"GGUF tokenizer: {n} tokens but {len(attrs)} token types")
        if model == "gpt2":
            return cls._from_gguf_bpe(meta, tokens, attrs)
        if model == "llama":
            return cls._from_gguf_spm(meta, tokens, attrs)
        raise UnsupportedError(
            f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece BPE)"
        )

    @staticmethod
    def _special_ids(meta: Mapping[str, Any], n: int) -> tuple[int | None, int | None, int | None]:
        def get(key):
            v = meta.get(f"tokenizer.ggml.{key}")
            return int(v) if v is not None and 0 <= int(v) < n else None

        return get("bos_token_id"), get("eos_token_id"), get("unknown_token_id")

    @staticmethod
    def _gguf_eog(meta: Mapping[str, Any], tokens: list[str], attrs: list[int], eos_id: int | None) -> set[int]:
        n = len(tokens)
        eog = {eos_id} if eos_id is not None else set()
        for key in ("eot_token_id", "eom_token_id"):
            v = meta.get(f"tokenizer.ggml.{key}")
            if v is not None and 0 <= int(v) < n:
                eog.add(int(v))
        wanted = set(EOG_TOKEN_TEXTS)
        fim = set(_FIM_EOG_TEXTS)
        for i, (t, a) in enumerate(zip(tokens, attrs)):
            if t in wanted or (t in fim and a == CONTROL):
                eog.add(i)
        return eog

    @staticmethod
    def _chat_templates_from_meta(meta: Mapping[str, Any]) -> dict[str, str]:
        out = {}
        if meta.get("tokenizer.chat_template"):
            out["default"] = meta["tokenizer.chat_template"]
        for k, v in meta.items():
            if k.startswith("tokenizer.chat_template.") and isinstance(v, str) and v:
                out[k[len("tokenizer.chat_template."):]] = v
        return out

    @classmethod
    def _add_added_tokens(cls, backend, tokens: list[str], attrs: list[int]) -> None:
        from tokenizers import AddedToken

        special = [AddedToken(t, special=True, normalized=False) for t, a in zip(tokens, attrs) if a == CONTROL and t]
        user = [AddedToken(t, special=False, normalized=False) for t, a in zip(tokens, attrs) if a == USER_DEFINED and t]
        if special:
            backend.add_special_tokens(special)
        if user:
            backend.add_tokens(user)

    @classmethod
    def _from_gguf_bpe(cls, meta, tokens: list[str], attrs: list[int]) -> "Tokenizer":
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        n = len(tokens)
        merges_raw = meta.get("tokenizer.ggml.merges")
        if not merges_raw:
            raise ModelFormatError("GGUF tokenizer 'gpt2' has no tokenizer.ggml.merges; re-convert the model")
        pre = meta.get("tokenizer.ggml.pre") or "default"

        vocab: dict[str, int] = {}
        pieces: list[bytes] = []
        for i, (t, a) in enumerate(zip(tokens, attrs)):
            key = t
            if a in (CONTROL, USER_DEFINED, UNKNOWN):
                piece = t.encode("utf-8")  # stored as plain text by llama.cpp's converter
                vocab[key] = i  # the added token must resolve to this id
                pieces.append(piece)
                continue
            if a == UNUSED:
                pieces.append(b"")
            elif a == BYTE and _BYTE_TOKEN.match(t):
                pieces.append(bytes([int(t[3:5], 16)]))
            elif _ALPHABET.issuperset(t):
                pieces.append(t.translate(_BYTELEVEL_TABLE).encode("latin-1"))
            else:  # a normal token stored as plain text: spell it in the byte alphabet
                pieces.append(t.encode("utf-8"))
                key = _bytes_to_bytelevel(pieces[-1])
            vocab.setdefault(key, i)

        merges = _parse_merges(merges_raw, vocab)
        ignore_merges = pre in _LLAMA3_LIKE
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges, fuse_unk=False)
        except Exception as e:
            raise ModelFormatError(f"GGUF tokenizer: cannot build the BPE model: {e}") from e
        backend = HFTokenizer(bpe)
        regexes = _PRE_SPLITS.get(pre)
        if regexes is None:
            log.warning("unknown tokenizer.ggml.pre %r; splitting text like GPT-2 (tokenization may differ)", pre)
            regexes = [_GPT2]
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        backend.decoder = decoders.ByteLevel()
        cls._add_added_tokens(backend, tokens, attrs)

        bos_id, eos_id, _ = cls._special_ids(meta, n)
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        if add_bos is None:
            add_bos = pre in _LLAMA3_LIKE
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        return cls(
            backend,
            tokens=tokens,
            attrs=attrs,
            pieces=pieces,
            strip_leading_space=False,
            bos_id=bos_id,
            eos_id=eos_id,
            eos_ids=cls._gguf_eog(meta, tokens, attrs, eos_id),
            add_bos=bool(add_bos),
            add_eos=add_eos,
            chat_template=cls._chat_templates_from_meta(meta) or None,
            kind=f"gguf-bpe:{pre}",
        )

    @classmethod
    def _from_gguf_spm(cls, meta, tokens: list[str], attrs: list[int]) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, normalizers

        n = len(tokens)
        arch = str(meta.get("general.architecture") or "")
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != n or arch.startswith("gemma"):
            # Gemma's scores do not follow its merge order; the position in the vocabulary does.
            scores = [-float(i) for i in range(n)]
        add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        bos_id, eos_id, unk_id = cls._special_ids(meta, n)
        if unk_id is None:
            unk_id = next((i for i, a in enumerate(attrs) if a == UNKNOWN), None)

        pieces: list[bytes] = []
        vocab: dict[str, int] = {}
        normal: dict[str, int] = {}
        for i, (t, a) in enumerate(zip(tokens, attrs)):
            if a == BYTE and _BYTE_TOKEN.match(t):
                pieces.append(bytes([int(t[3:5], 16)]))
            elif a == UNUSED:
                pieces.append(b"")
            elif a in (CONTROL, UNKNOWN):
                pieces.append(t.encode("utf-8"))
            else:  # NORMAL, USER_DEFINED
                if a == NORMAL and t and not t.strip(" "):
                    t = SPIECE_SPACE * len(t)  # runs of spaces stored as real spaces (Gemma)
                pieces.append(t.replace(SPIECE_SPACE, " ").encode("utf-8"))
            if a in (CONTROL, USER_DEFINED, UNKNOWN):
                vocab[t] = i
            else:
                vocab.setdefault(t, i)
            if a == NORMAL:
                normal.setdefault(t, i)

        merges = meta.get("tokenizer.ggml.merges")
        merges = _parse_merges(merges, vocab) if merges else _merges_from_scores(normal, scores)
        try:
            bpe = models.BPE(
                vocab=vocab,
                merges=merges,
                unk_token=tokens[unk_id] if unk_id is not None else None,
                byte_fallback=True,
                fuse_unk=True,
            )
        except Exception as e:
            raise ModelFormatError(f"GGUF tokenizer: cannot build the SentencePiece BPE model: {e}") from e
        backend = HFTokenizer(bpe)
        steps = [normalizers.Replace(" ", SPIECE_SPACE)]
        if add_space_prefix:
            # a normalizer runs on every stretch of text between added tokens: like llama.cpp,
            # each one gets its own leading space
            steps.insert(0, normalizers.Prepend(SPIECE_SPACE))
        backend.normalizer = normalizers.Sequence(steps)
        dec = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_space_prefix:
            dec.append(decoders.Strip(" ", 1, 0))
        backend.decoder = decoders.Sequence(dec)
        cls._add_added_tokens(backend, tokens, attrs)

        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        return cls(
            backend,
            tokens=tokens,
            attrs=attrs,
            pieces=pieces,
            strip_leading_space=add_space_prefix,
            bos_id=bos_id,
            eos_id=eos_id,
            eos_ids=cls._gguf_eog(meta, tokens, attrs, eos_id),
            add_bos=True if add_bos is None else bool(add_bos),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=cls._chat_templates_from_meta(meta) or None,
            kind="gguf-spm",
        )

    # ------------------------------------------------------------------ construction: HF folder
    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(path)
        if not folder.is_dir():
            raise ModelFormatError(f"{folder}: no such model folder")
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            hint = ""
            if (folder / "tokenizer.model").is_file() or (folder / "vocab.json").is_file():
                hint = " (it has a slow-tokenizer file, which this loader does not read)"
            raise ModelFormatError(
                f"no tokenizer.json in {folder}{hint}; save the model's fast tokenizer there "
                "(transformers: AutoTokenizer.from_pretrained(folder).save_pretrained(folder)) "
                "or run the GGUF file of the model, which carries its tokenizer"
            )
        try:
            spec = json.loads(tj.read_text(encoding="utf-8"))
            backend = HFTokenizer.from_str(json.dumps(spec))
        except Exception as e:
            raise ModelFormatError(f"{tj}: unreadable tokenizer.json ({type(e).__name__}: {e})") from e

        cfg = _read_json(folder / "tokenizer_config.json")
        gen_cfg = _read_json(folder / "generation_config.json")
        model_cfg = _read_json(folder / "config.json")

        vocab = backend.get_vocab(with_added_tokens=True)
        n = max(vocab.values(), default=-1) + 1
        tokens = [""] * n
        for t, i in vocab.items():
            tokens[i] = t
        attrs = [NORMAL] * n
        seen = [False] * n
        for t, i in vocab.items():
            seen[i] = True
        for i in range(n):
            if not seen[i]:
                attrs[i] = UNUSED
        for added in spec.get("added_tokens") or []:
            i = added.get("id")
            if isinstance(i, int) and 0 <= i < n:
                attrs[i] = CONTROL if added.get("special") else USER_DEFINED
        model_spec = spec.get("model") or {}
        unk = model_spec.get("unk_token") if isinstance(model_spec.get("unk_token"), str) else None
        if unk is None and model_spec.get("type") == "Unigram" and model_spec.get("unk_id") is not None:
            unk_i = model_spec["unk_id"]
            unk = tokens[unk_i] if 0 <= unk_i < n else None
        if unk is not None and unk in vocab and attrs[vocab[unk]] == NORMAL:
            attrs[vocab[unk]] = UNKNOWN

        # decoding: byte-level or SentencePiece-like vocabularies get exact per-token bytes
        dec_types = _component_types(spec.get("decoder"))
        pieces: list[bytes] | None
        strip = False
        if "ByteLevel" in dec_types:
            pieces = [b"" if a == UNUSED else _bytelevel_to_bytes(t) for t, a in zip(tokens, attrs)]
        elif model_spec.get("type") in ("BPE", "Unigram") and (
            "Metaspace" in dec_types or _has_replace(spec.get("decoder"), SPIECE_SPACE, " ")
        ):
            byte_fallback = "ByteFallback" in dec_types or bool(model_spec.get("byte_fallback"))
            pieces = []
            for i, (t, a) in enumerate(zip(tokens, attrs)):
                m = _BYTE_TOKEN.match(t) if byte_fallback and a == NORMAL else None
                if m:
                    pieces.append(bytes([int(m.group(1), 16)]))
                    attrs[i] = BYTE
                else:
                    pieces.append(b"" if a == UNUSED else t.replace(SPIECE_SPACE, " ").encode("utf-8"))
            strip = _strips_leading_space(spec.get("decoder"))
        else:
            pieces = None  # e.g. WordPiece: leave decoding to `tokenizers`

        # special tokens
        def tok_id(v) -> int | None:
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str):
                return vocab.get(v)
            return None

        bos_id = tok_id(cfg.get("bos_token"))
        eos_id = tok_id(cfg.get("eos_token"))
        tp_bos, tp_eos = _template_processing_ends(spec.get("post_processor"), vocab)
        if bos_id is None:
            bos_id = tp_bos if tp_bos is not None else _first_int(gen_cfg.get("bos_token_id"), model_cfg.get("bos_token_id"))
        eos_list: list[int] = []
        for src in (gen_cfg.get("eos_token_id"), model_cfg.get("eos_token_id")):
            if isinstance(src, int):
                eos_list.append(src)
            elif isinstance(src, list):
                eos_list.extend(int(x) for x in src if isinstance(x, int))
        if eos_id is None:
            eos_id = eos_list[0] if eos_list else None
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:
            add_bos = tp_bos is not None
        add_eos = cfg.get("add_eos_token")
        if add_eos is None:
            add_eos = tp_eos is not None
        eog = set(eos_list)
        wanted, fim = set(EOG_TOKEN_TEXTS), set(_FIM_EOG_TEXTS)
        for t, i in vocab.items():
            if (t in wanted and attrs[i] in (CONTROL, USER_DEFINED)) or (t in fim and attrs[i] == CONTROL):
                eog.add(i)

        templates: dict[str, str] = {}
        ct = cfg.get("chat_template")
        if isinstance(ct, str):
            templates["default"] = ct
        elif isinstance(ct, list):
            for entry in ct:
                if isinstance(entry, dict) and isinstance(entry.get("template"), str):
                    templates[str(entry.get("name", "default"))] = entry["template"]
        if "default" not in templates:
            jinja = folder / "chat_template.jinja"
            if jinja.is_file():
                templates["default"] = jinja.read_text(encoding="utf-8")
            else:
                ctj = _read_json(folder / "chat_template.json").get("chat_template")
                if isinstance(ctj, str):
                    templates["default"] = ctj

        return cls(
            backend,
            tokens=tokens,
            attrs=attrs,
            pieces=pieces,
            strip_leading_space=strip,
            bos_id=bos_id,
            eos_id=eos_id,
            eos_ids=eog,
            add_bos=bool(add_bos),
            add_eos=bool(add_eos),
            chat_template=templates or None,
            kind="tokenizer.json",
        )

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write `tokenizer.json` + `tokenizer_config.json` (readable by `from_folder` and transformers)."""
        from tokenizers import processors

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        spec = json.loads(self.backend.to_str())
        if self.add_bos or self.add_eos:
            single = ([self._tokens[self.bos_id]] if self.add_bos else []) + ["$A"]
            special = [(self._tokens[self.bos_id], self.bos_id)] if self.add_bos else []
            if self.add_eos:
                single.append(self._tokens[self.eos_id])
                special.append((self._tokens[self.eos_id], self.eos_id))
            proc = processors.TemplateProcessing(single=single, special_tokens=special)
            spec["post_processor"] = json.loads(proc.__getstate__())
        (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "bos_token": self._tokens[self.bos_id] if self.bos_id is not None else None,
            "eos_token": self._tokens[self.eos_id] if self.eos_id is not None else None,
        }
        if self.chat_templates:
            if set(self.chat_templates) == {"default"}:
                cfg["chat_template"] = self.chat_templates["default"]
            else:
                cfg["chat_template"] = [{"name": k, "template": v} for k, v in self.chat_templates.items()]
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=1), encoding="utf-8")
        gen = folder / "generation_config.json"
        if self.eos_ids and not gen.exists():  # never clobber a model's own generation settings
            gen.write_text(json.dumps({"eos_token_id": sorted(self.eos_ids)}), encoding="utf-8")

    # ------------------------------------------------------------------ encode / decode
    def _encoder(self, parse_special: bool):
        if parse_special:
            return self.backend
        if self._backend_plain is None:
            from tokenizers import Tokenizer as HFTokenizer

            plain = HFTokenizer.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self._backend_plain = plain
        return self._backend_plain

    def _wrap(self, ids: list[int], add_bos: bool | None, add_eos: bool | None) -> list[int]:
        if add_bos is None:
            add_bos = self.add_bos
        if add_eos is None:
            add_eos = self.add_eos
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if add_eos and self.eos_id is not None:
            ids = [*ids, self.eos_id]
        return ids

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True, add_eos: bool | None = None
    ) -> list[int]:
        """Token ids of `text`. `add_bos=None` follows the model (`self.add_bos`). With
        `parse_special=False` control tokens written in the text are tokenized as plain text
        (user-defined added tokens are still matched whole, as in llama.cpp)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() needs a str, got {type(text).__name__}")
        ids = self._encoder(parse_special).encode(text, add_special_tokens=False).ids if text else []
        return self._wrap(ids, add_bos, add_eos)

    def encode_batch(
        self, texts: Sequence[str], add_bos: bool | None = None, parse_special: bool = True, add_eos: bool | None = None
    ) -> list[list[int]]:
        encs = self._encoder(parse_special).encode_batch(list(texts), add_special_tokens=False)
        return [self._wrap(e.ids if t else [], add_bos, add_eos) for e, t in zip(encs, texts)]

    def _check_id(self, i: int) -> int:
        i = int(i)
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        return i

    def is_special(self, token_id: int) -> bool:
        """Control/unknown tokens: rendered as their text by default, left out with skip_special."""
        return self._special[self._check_id(token_id)]

    def token_to_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a SentencePiece piece keeps its leading space)."""
        i = self._check_id(token_id)
        if self._pieces is None:
            return self.backend.decode([i], skip_special_tokens=False).encode("utf-8")
        return self._pieces[i]

    def token_to_piece(self, token_id: int) -> str:
        """Text of one token (U+FFFD for a token that is only part of a UTF-8 character)."""
        return self.token_to_bytes(token_id).decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry as the model spells it (e.g. 'Ġthe', '▁the', '<0x0A>')."""
        return self._tokens[self._check_id(token_id)]

    def token_to_id(self, token: str) -> int | None:
        if self._token_to_id is None:
            m: dict[str, int] = {}
            for i, t in enumerate(self._tokens):
                m.setdefault(t, i)
            self._token_to_id = m
        return self._token_to_id.get(token)

    def _iter_bytes(self, ids: Iterable[int], skip_special: bool, first: bool):
        """Yield (bytes, still_first) for each id, applying skip_special and the leading-space rule."""
        pieces, special, strip = self._pieces, self._special, self.strip_leading_space
        for i in ids:
            i = self._check_id(i)
            if skip_special and special[i]:
                continue
            p = pieces[i]
            if not p:
                continue
            if first:
                first = False
                if strip and p[:1] == b" ":
                    p = p[1:]
            yield p

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`. Special (control) tokens are rendered as their text unless `skip_special`."""
        if self._pieces is None:
            return self.backend.decode([self._check_id(i) for i in ids], skip_special_tokens=skip_special)
        return b"".join(self._iter_bytes(ids, skip_special, True)).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ chat templates
    @property
    def bos_token(self) -> str | None:
        return self._tokens[self.bos_id] if self.bos_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self._tokens[self.eos_id] if self.eos_id is not None else None

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        template_name: str | None = None,
        time_limit: float | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation with the model's chat template (raises NoChatTemplateError if it has
        none; `time_limit` in seconds, see `ChatTemplate.render`)."""
        if not self.chat_templates:
            raise NoChatTemplateError(
                "the model has no chat template (no tokenizer.chat_template in the GGUF / no chat_template in "
                "tokenizer_config.json); use a raw text prompt instead"
            )
        tpl = self._compiled_templates.get(template_name)
        if tpl is None:
            source = select_template(self.chat_templates, template_name)
            if source is None:
                raise NoChatTemplateError(
                    f"the model has no default chat template, only {sorted(self.chat_templates)}; pick one by name"
                )
            tpl = ChatTemplate(source, bos_token=self.bos_token, eos_token=self.eos_token)
            self._compiled_templates[template_name] = tpl
        return tpl.render(messages, add_generation_prompt=add_generation_prompt, time_limit=time_limit, **kwargs)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.kind}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_ids={sorted(self.eos_ids)}, add_bos={self.add_bos})"
        )


class StreamDetokenizer:
    """Turns generated token ids into text as they arrive.

    `add(id)` returns only new, complete text: bytes of a UTF-8 character split across tokens are
    held back until the character is whole. `flush()` returns whatever is still held (an incomplete
    character becomes U+FFFD). The concatenation of everything returned equals
    `tokenizer.decode(all_ids, skip_special)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self._first = True
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._emitted = ""  # only used when the tokenizer has no byte table

    def add(self, token_id: int) -> str:
        tok = self.tokenizer
        token_id = int(token_id)
        self.ids.append(token_id)
        if tok._pieces is None:
            return self._add_generic()
        out = []
        for p in tok._iter_bytes((token_id,), self.skip_special, self._first):
            self._first = False
            out.append(self._utf8.decode(p))
        return "".join(out)

    def _add_generic(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special=self.skip_special)
        if text.endswith("\ufffd") or not text.startswith(self._emitted):
            return ""
        new = text[len(self._emitted):]
        self._emitted = text
        return new

    def flush(self) -> str:
        if self.tokenizer._pieces is None:
            text = self.tokenizer.decode(self.ids, skip_special=self.skip_special)
            new = text[len(self._emitted):] if text.startswith(self._emitted) else ""
            self._emitted = text
            return new
        return self._utf8.decode(b"", final=True)

    @property
    def text(self) -> str:
        """Everything decoded so far (including a possibly incomplete tail)."""
        return self.tokenizer.decode(self.ids, skip_special=self.skip_special)


# ---------------------------------------------------------------------------------- helpers
def _parse_merges(merges_raw: Sequence[str], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """`"a b"` strings -> (a, b) pairs, dropping (and counting) any that do not fit the vocabulary."""
    out: list[tuple[str, str]] = []
    dropped = 0
    for m in merges_raw:
        parts = m.split(" ")
        if len(parts) == 2:
            a, b = parts
        else:  # a token with a literal space: find the split whose halves are both tokens
            cands = [(m[:k], m[k + 1:]) for k, c in enumerate(m) if c == " "]
            cands = [(a, b) for a, b in cands if a in vocab and b in vocab]
            if not cands:
                dropped += 1
                continue
            a, b = cands[0]
        if a in vocab and b in vocab and (a + b) in vocab:
            out.append((a, b))
        else:
            dropped += 1
    if dropped:
        log.warning("tokenizer: ignored %d merges that do not fit the vocabulary", dropped)
    return out


def _merges_from_scores(normal: Mapping[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every split of a piece into two pieces is a merge, ranked by
    the merged piece's score (higher first), ties by vocabulary order."""
    cands = []
    for tok, i in normal.items():
        if len(tok) < 2:
            continue
        s = -float(scores[i])
        for k in range(1, len(tok)):
            left = normal.get(tok[:k])
            if left is None:
                continue
            right = normal.get(tok[k:])
            if right is None:
                continue
            cands.append((s, i, left, right, k, tok))
    cands.sort(key=lambda c: c[:4])
    return [(tok[:k], tok[k:]) for _s, _i, _l, _r, k, tok in cands]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except Exception as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from e
    return data if isinstance(data, dict) else {}


def _first_int(*vals) -> int | None:
    for v in vals:
        if isinstance(v, int):
            return v
        if isinstance(v, list) and v and isinstance(v[0], int):
            return v[0]
    return None


def _components(spec) -> list[dict]:
    if not isinstance(spec, dict):
        return []
    out = [spec]
    for key in ("decoders", "pretokenizers", "processors", "normalizers"):
        for sub in spec.get(key) or []:
            out.extend(_components(sub))
    return out


def _component_types(spec) -> set[str]:
    return {c.get("type") for c in _components(spec)}


def _has_replace(spec, old: str, new: str) -> bool:
    for c in _components(spec):
        if c.get("type") == "Replace" and c.get("content") == new:
            pat = c.get("pattern") or {}
            if pat.get("String") == old:
                return True
    return False


def _strips_leading_space(decoder_spec) -> bool:
    for c in _components(decoder_spec):
        if c.get("type") == "Strip" and c.get("content") == " " and int(c.get("start", 0)) >= 1:
            return True
        if c.get("type") == "Metaspace":
            scheme = c.get("prepend_scheme")
            if scheme is None:
                return bool(c.get("add_prefix_space", True))
            return scheme != "never"
    return False


def _template_processing_ends(spec, vocab: Mapping[str, int]) -> tuple[int | None, int | None]:
    """(bos, eos) ids a TemplateProcessing post-processor puts around a single sequence."""
    for c in _components(spec):
        if c.get("type") != "TemplateProcessing":
            continue
        single = c.get("single") or []
        specials = c.get("special_tokens") or {}

        def sid(item):
            st = item.get("SpecialToken") if isinstance(item, dict) else None
            if not st:
                return None
            name = st.get("id")
            ids = (specials.get(name) or {}).get("ids") or []
            return ids[0] if ids else vocab.get(name)

        bos = sid(single[0]) if single else None
        eos = sid(single[-1]) if len(single) > 1 else None
        return bos, eos
    return None, None
