"""LanguageTokens: the language codes a multilingual model knows and the token that tells it each one (languages.json). Torch-free.

NLLB-200 and M2M-100 read the source language as the source's first token and are forced to start
the target with the target language's token; OPUS-MT multilingual models read the target language as
a ">>xxx<<" token first in the source. A request may name a language by the model's own code
("deu_Latn", "de", "deu") or by BCP 47 ("de", "zh-Hant"); `resolve` maps it onto one of the model's codes.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nmt_serve.model.language_codes import primary_forms

LANGUAGES_FILE = "languages.json"
# Where the target language's token goes: forced as the first generated token, or first in the source.
TARGET_PLACES = ("target", "source")


class UnknownLanguage(ValueError):
    """A requested code that names none of the model's languages, or several of them."""


def code_parts(code: str) -> tuple[str, str | None]:
    """(primary subtag, script subtag or None) of a model code or BCP 47 tag: "deu_Latn" -> ("deu", "Latn"), "zh-Hant-TW" -> ("zh", "Hant")."""
    subtags = code.replace("_", "-").split("-")
    script = next((tag.title() for tag in subtags[1:] if len(tag) == 4 and tag.isalpha()), None)
    return subtags[0].lower(), script


def resolve(requested: str, known: Collection[str]) -> str:
    """The one code of `known` that `requested` names: itself, its case or separator variant, or its BCP 47 language (and script)."""
    if requested in known:
        return requested
    folded = {code.lower().replace("-", "_"): code for code in known}
    if requested.lower().replace("-", "_") in folded:
        return folded[requested.lower().replace("-", "_")]
    primary, script = code_parts(requested)
    forms = primary_forms(primary)
    matches = sorted(code for code in known if primary_forms(code_parts(code)[0]) & forms and (script is None or code_parts(code)[1] in (None, script)))
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise UnknownLanguage(f"names several of the model's languages ({', '.join(matches[:10])}); send one of them")
    raise UnknownLanguage("is not a language of this model")


@dataclass(frozen=True)
class LanguageTokens:
    source: Mapping[str, int] = field(default_factory=dict)  # code -> token id first in the source; empty: the model is not told
    target: Mapping[str, int] = field(default_factory=dict)  # code -> token id naming the target language
    target_place: str = "target"  # one of TARGET_PLACES

    def __post_init__(self) -> None:
        if self.target_place not in TARGET_PLACES:
            raise ValueError(f"target_place must be one of {', '.join(TARGET_PLACES)}, got {self.target_place!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"source": dict(self.source), "target": dict(self.target), "target_place": self.target_place}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LanguageTokens:
        return cls({str(k): int(v) for k, v in values.get("source", {}).items()}, {str(k): int(v) for k, v in values.get("target", {}).items()},
                   str(values.get("target_place", "target")))  # fmt: skip

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> LanguageTokens:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))

    def prefixes(self, source_code: str | None, target_code: str | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(tokens before the source text, tokens forced first in the target) for resolved codes."""
        source = (self.source[source_code],) if source_code in self.source else ()
        target = (self.target[target_code],) if target_code in self.target else ()
        return (target + source, ()) if self.target_place == "source" else (source, target)


def load_languages(directory: Path) -> LanguageTokens | None:
    """A checkpoint's or model dir's languages.json, or None for a single-pair model."""
    path = Path(directory) / LANGUAGES_FILE
    return LanguageTokens.load(path) if path.is_file() else None


# Codes an error message lists before "and N more": NLLB-200 knows 202, more than a status message should carry.
LISTED_CODES = 20


def listed(codes: list[str]) -> str:
    shown = ", ".join(codes[:LISTED_CODES])
    return shown + (f" and {len(codes) - LISTED_CODES} more (GetModelInfo lists them all)" if len(codes) > LISTED_CODES else "")


@dataclass(frozen=True)
class ModelLanguages:
    """What a served model's requests may name: its codes, the defaults of a request that names none, the tokens that tell the model."""

    default_source: str
    default_target: str
    tokens: LanguageTokens | None = None

    @property
    def source_codes(self) -> list[str]:
        return sorted(self.tokens.source) if self.tokens and self.tokens.source else [self.default_source]

    @property
    def target_codes(self) -> list[str]:
        return sorted(self.tokens.target) if self.tokens and self.tokens.target else [self.default_target]

    def prefixes(self, source_language: str, target_language: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(tokens before each source, tokens forced first in each target) for a request's codes ("" = the default);
        raises UnknownLanguage naming the field and the supported codes."""
        source = choose("source_language", source_language, self.source_codes, self.default_source)
        target = choose("target_language", target_language, self.target_codes, self.default_target)
        return self.tokens.prefixes(source, target) if self.tokens else ((), ())


def choose(field_name: str, requested: str, codes: list[str], default: str) -> str:
    if not requested:
        return default
    try:
        return resolve(requested, codes)
    except UnknownLanguage as error:
        shown = requested if len(requested) <= 40 else requested[:40] + "..."
        raise UnknownLanguage(f"{field_name} {shown!r} {error}; supported: {listed(codes)}") from None
