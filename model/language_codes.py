"""Language codes as data: BCP 47 primary subtags (ISO 639-1) and the ISO 639-3 codes models use for them. Torch-free.

NLLB-200 names languages ISO 639-3 + script ("deu_Latn"), M2M-100 mostly ISO 639-1 ("de"), OPUS-MT
multilingual models ISO 639-3 (">>deu<<"). One table maps between them; where a macrolanguage has one
individual language the models use, that one is given (ar -> arb, fa -> pes, ms -> zsm, sw -> swh).
"""

from __future__ import annotations

ISO_639_1_TO_3 = {
    "af": "afr", "ak": "aka", "am": "amh", "ar": "arb", "as": "asm", "ay": "ayr", "az": "azj", "ba": "bak", "be": "bel", "bg": "bul",
    "bm": "bam", "bn": "ben", "bo": "bod", "br": "bre", "bs": "bos", "ca": "cat", "cs": "ces", "cy": "cym", "da": "dan", "de": "deu",
    "dz": "dzo", "ee": "ewe", "el": "ell", "en": "eng", "eo": "epo", "es": "spa", "et": "est", "eu": "eus", "fa": "pes", "ff": "fuv",
    "fi": "fin", "fj": "fij", "fo": "fao", "fr": "fra", "fy": "fry", "ga": "gle", "gd": "gla", "gl": "glg", "gn": "grn", "gu": "guj",
    "ha": "hau", "he": "heb", "hi": "hin", "hr": "hrv", "ht": "hat", "hu": "hun", "hy": "hye", "id": "ind", "ig": "ibo", "is": "isl",
    "it": "ita", "ja": "jpn", "jv": "jav", "ka": "kat", "kg": "kon", "ki": "kik", "kk": "kaz", "km": "khm", "kn": "kan", "ko": "kor",
    "ks": "kas", "ku": "kmr", "ky": "kir", "lb": "ltz", "lg": "lug", "li": "lim", "ln": "lin", "lo": "lao", "lt": "lit", "lv": "lvs",
    "mg": "plt", "mi": "mri", "mk": "mkd", "ml": "mal", "mn": "khk", "mr": "mar", "ms": "zsm", "mt": "mlt", "my": "mya", "ne": "npi",
    "nl": "nld", "nn": "nno", "no": "nob", "nb": "nob", "ns": "nso", "ny": "nya", "oc": "oci", "om": "gaz", "or": "ory", "pa": "pan",
    "pl": "pol", "ps": "pbt", "pt": "por", "qu": "quy", "rn": "run", "ro": "ron", "ru": "rus", "rw": "kin", "sa": "san", "sc": "srd",
    "sd": "snd", "sg": "sag", "si": "sin", "sk": "slk", "sl": "slv", "sm": "smo", "sn": "sna", "so": "som", "sq": "als", "sr": "srp",
    "ss": "ssw", "st": "sot", "su": "sun", "sv": "swe", "sw": "swh", "ta": "tam", "te": "tel", "tg": "tgk", "th": "tha", "ti": "tir",
    "tk": "tuk", "tl": "tgl", "tn": "tsn", "tr": "tur", "ts": "tso", "tt": "tat", "tw": "twi", "ug": "uig", "uk": "ukr", "ur": "urd",
    "uz": "uzn", "vi": "vie", "wo": "wol", "xh": "xho", "yi": "ydd", "yo": "yor", "zh": "zho", "zu": "zul",
}  # fmt: skip
# Macrolanguage codes a user may send for the individual language above ("ara" for "arb").
MACROLANGUAGES = {"ara": "arb", "fas": "pes", "msa": "zsm", "swa": "swh", "est": "est", "lav": "lvs", "mon": "khk", "nep": "npi",
                  "nor": "nob", "uzb": "uzn", "sqi": "als", "pus": "pbt", "mlg": "plt", "orm": "gaz", "aze": "azj", "yid": "ydd",
                  "que": "quy", "kur": "kmr", "ori": "ory", "aym": "ayr", "grn": "grn"}  # fmt: skip
ISO_639_3_TO_1 = {three: one for one, three in ISO_639_1_TO_3.items() if one != "nb"}


def primary_forms(primary: str) -> set[str]:
    """The spellings of one language's primary subtag across the tables: {"de", "deu"} for "de" or "deu"."""
    primary = primary.lower()
    three = MACROLANGUAGES.get(primary) or ISO_639_1_TO_3.get(primary, primary)
    return {primary, three, ISO_639_3_TO_1.get(three, primary)}
