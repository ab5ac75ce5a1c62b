"""The host self-check: reference log-probs of a few sentences, written at export and compared on the host that serves.

A model dir's numbers depend on the host's kernels: int8 most of all, where some x86 kernels add
products in saturating 16-bit lanes and others do not. At export, `write_reference` decodes a few
sentences greedily and stores, teacher-forced, the log-prob of every token of each output (EOS
included) with the exporting host's CPU. `check_host` feeds the same tokens through the sessions
that will serve and compares: the largest difference against the precision's bound decides.

Torch-free: the server runs it at start, `nmt-parity MODEL_DIR` on demand.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nmt_serve.model.config import ModelConfig
from nmt_serve.model.padding import pad_sources
from nmt_serve.model.search import SearchOptions, generate
from nmt_serve.runtime.host import cpu_facts, describe_cpu
from nmt_serve.runtime.manifest import load_model_dir
from nmt_serve.runtime.step_cache import StepCache

logger = logging.getLogger(__name__)

SELF_CHECK_FILE = "self_check.json"
SELF_CHECK_SENTENCES = 8
MAX_REFERENCE_TOKENS = 48  # per sentence: enough to cover every layer's cache at several positions, cheap at start
# Largest |log-prob difference| of any reference token a host may show against the exporting host.
# fp32: kernels that round differently (the fused SkipLayerNormalization kernel against Add +
# LayerNormalization) moved the shipped model's reference by 5e-6, so 1e-3 leaves two orders of
# margin. int8 (7-bit u8s8): every integer product is exact on any x86 CPU, so hosts differ only
# where an fp32 difference moves an activation across a quantization step: the same two kernels moved
# the reference by 0.019. Served on an AVX2-only host, 8-bit u8s8 weights exported on a VNNI host
# (whose exact products were reproduced through u8u8 kernels) moved it by 0.195: the bound of 0.05
# lies between. fp16 runs on CUDA, whose kernels round unlike the exporting host's: 0.1, unmeasured.
SELF_CHECK_BOUNDS = {"fp32": 1e-3, "int8": 0.05, "fp16": 0.1}
# An int8 dir whose self-attention cache is int8 too (export/int8_cache.py) rounds each cached key and value once
# more, so a float difference between hosts moves more of its log-probs: with SkipLayerNormalization fused (the
# stand-in for another CPU's rounding) the shipped int8 dirs' references moved by 0.0515 and 0.0572 against 0.0313
# and 0.0176 with their float32 caches. 0.1 lies between that and the 0.195 of saturating kernels.
INT8_CACHE_BOUND = 0.1
# int8 schemes (export/optimize.py) with 8-bit signed weights: their products are exact only where the u8s8
# kernel sums in 32-bit lanes (VNNI, AMX), which is what a failed self-check of such a dir most likely means.
EIGHT_BIT_SIGNED_SCHEMES = ("u8s8", "u8s8-fp32-logits", "u8s8-rows-vnni")
# Precisions whose log-probs must not depend on the batch: the reference sentences teacher-forced each
# alone and all packed in one batch must agree bit for bit (int8 quantizes each row with its own scale,
# and every source width is a multiple of runtime/source_group.py SOURCE_WIDTH_MULTIPLE). fp16 runs on
# CUDA kernels that choose their tiling by batch size, so it is checked against its bound only.
BATCH_INVARIANT_PRECISIONS = ("fp32", "int8")

Encode = Callable[[np.ndarray, np.ndarray], list[np.ndarray]]


@dataclass(frozen=True)
class SelfCheckResult:
    reference_path: str
    sentences: int
    tokens: int
    max_log_prob_diff: float
    bound: float
    reference_cpu: str  # the exporting host, as describe_cpu words it
    cpu: str  # this host
    # Largest |log-prob difference| between each sentence teacher-forced alone and all of them packed in one
    # batch; None where the precision is not required to be batch-invariant (BATCH_INVARIANT_PRECISIONS).
    batch_diff: float | None = None
    # How far alone and packed may differ: 0 where the decoder runs on the CPU (bit-identical, the batch-invariance
    # contract); the precision's bound on a device (CUDA's GEMMs pick their algorithm by the batch's shape).
    batch_bound: float = 0.0
    provider: str = "CPUExecutionProvider"
    # The dir's int8 scheme (manifest created_by), for what a failure most likely means (kernel_advice).
    int8_scheme: str | None = None

    @property
    def batch_invariant(self) -> bool:
        return self.batch_diff is None or self.batch_diff == 0.0

    @property
    def passed(self) -> bool:
        return self.max_log_prob_diff <= self.bound and (self.batch_diff is None or self.batch_diff <= self.batch_bound)

    def describe(self) -> str:
        verdict = "within" if self.max_log_prob_diff <= self.bound else "BEYOND"
        batch = "" if self.batch_diff is None else (
            "; alone and packed: bit-identical" if self.batch_invariant
            else f"; alone and packed: differ by up to {self.batch_diff:.2e}, within {self.batch_bound:g} on {self.provider}"
            if self.batch_diff <= self.batch_bound else f"; alone and packed: DIFFER by up to {self.batch_diff:.2e}")
        return (f"{self.reference_path}: max |log-prob diff| {self.max_log_prob_diff:.2e} over {self.tokens} tokens of {self.sentences} "
                f"sentences, {verdict} the bound {self.bound:g}{batch}; exported on {self.reference_cpu}, checked on {self.cpu}"
                f"{'' if self.passed else kernel_advice(self.int8_scheme)}")  # fmt: skip


def kernel_advice(int8_scheme: str | None) -> str:
    """What a failed self-check most likely means for a dir whose int8 weights need VNNI or AMX, else ''."""
    if int8_scheme not in EIGHT_BIT_SIGNED_SCHEMES:
        return ""
    return (f"; its int8 scheme {int8_scheme} has 8-bit signed weights, exact only on CPUs with VNNI or AMX: "
            f"serve an export made with --int8-scheme u8s8-rows (7-bit weights, exact on every x86 CPU) here")


class SelfCheckError(ValueError):
    """A reference file that cannot be read or does not fit the model dir: the message names the file."""


def forced_log_probs(encode: Encode, cache: StepCache, config: ModelConfig, sources: Sequence[Sequence[int]],
                     targets: Sequence[Sequence[int]]) -> list[np.ndarray]:  # fmt: skip
    """Per sentence, the log-prob of each target token and of the EOS after it, given the source and the
    tokens before it: every row continues itself, one decoder call per position."""
    src_ids, src_mask = pad_sources(sources, config.pad_id, config.eos_id)
    cross = encode(src_ids, src_mask)
    rows = len(sources)
    followed = [[*target, config.eos_id] for target in targets]  # what each step should predict
    fed = [[config.bos_id, *target] for target in targets]
    index = np.arange(rows, dtype=np.int64)
    cache.reset()
    scores = [np.zeros(len(tokens), dtype=np.float64) for tokens in followed]
    for position in range(max(len(tokens) for tokens in fed)):
        tokens = np.array([row[position] if position < len(row) else config.eos_id for row in fed], dtype=np.int64)
        parents = np.full(rows, -1, dtype=np.int64) if position == 0 else index
        cache.arrange(parents, tokens, index, index, cross, src_mask)
        log_probs = cache.run()
        for row, expected in enumerate(followed):
            if position < len(expected):
                scores[row][position] = log_probs[row, expected[position]]
    return scores


def batch_difference(encode: Encode, cache: StepCache, config: ModelConfig, sources: Sequence[Sequence[int]],
                     targets: Sequence[Sequence[int]], packed: Sequence[np.ndarray] | None = None) -> float:  # fmt: skip
    """Largest |log-prob difference| between each sentence teacher-forced alone and all of them in one batch (0.0: invariant).
    `packed`: forced_log_probs of all of them together, when the caller has it already."""
    packed = packed if packed is not None else forced_log_probs(encode, cache, config, sources, targets)
    alone = [forced_log_probs(encode, cache, config, [source], [target])[0] for source, target in zip(sources, targets, strict=True)]
    return float(max(np.abs(one - together).max() for one, together in zip(alone, packed, strict=True)))


def write_reference(model_dir: Path, encode: Encode, step: Any, cache: StepCache, config: ModelConfig, precision: str,
                    sources: Sequence[Sequence[int]]) -> dict[str, Any]:  # fmt: skip
    """Greedy outputs of `sources` through this model dir (`step`: the Step protocol over it), then their
    teacher-forced log-probs, into SELF_CHECK_FILE. The caller lists the file in the manifest."""
    sources = [list(ids[: config.max_positions - 1]) for ids in sources[:SELF_CHECK_SENTENCES]]
    options = SearchOptions(beam_size=1, max_output_tokens=min(MAX_REFERENCE_TOKENS, config.max_positions - 1))
    targets = [list(hypotheses[0].token_ids) for hypotheses in generate(step, sources, options, config.bos_id, config.eos_id, config.max_positions)]
    scores = forced_log_probs(encode, cache, config, sources, targets)
    reference = {
        "precision": precision,
        "bound": INT8_CACHE_BOUND if cache.cache_dtype == np.int8 else SELF_CHECK_BOUNDS[precision],
        "cpu": cpu_facts(),
        "sentences": [{"source_ids": source, "target_ids": target, "log_probs": [float(value) for value in score]}
                      for source, target, score in zip(sources, targets, scores, strict=True)],
    }  # fmt: skip
    (Path(model_dir) / SELF_CHECK_FILE).write_text(json.dumps(reference, indent=1) + "\n", encoding="utf-8")
    return reference


def load_reference(model_dir: Path, config: ModelConfig) -> dict[str, Any] | None:
    """The stored reference, or None when the model dir has none (dirs exported before it existed)."""
    path = Path(model_dir) / SELF_CHECK_FILE
    if not path.exists():
        return None
    try:
        reference = json.loads(path.read_text(encoding="utf-8"))
        sentences = reference["sentences"]
        for sentence in sentences:
            ids = [*sentence["source_ids"], *sentence["target_ids"]]
            if not all(isinstance(i, int) and 0 <= i < config.vocab_size for i in ids):
                raise ValueError(f"a token id outside the vocabulary of {config.vocab_size}")
            if len(sentence["log_probs"]) != len(sentence["target_ids"]) + 1:
                raise ValueError("log_probs must hold one value per target token and one for EOS")
        float(reference["bound"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SelfCheckError(f"{path}: unusable self-check reference: {error}") from error
    if not sentences:
        raise SelfCheckError(f"{path}: unusable self-check reference: no sentences")
    return reference


def check_host(model_dir: Path, reference: dict[str, Any], encode: Encode, cache: StepCache, config: ModelConfig) -> SelfCheckResult:
    """The stored tokens (`reference`, loaded from `model_dir`) through this host's sessions, against the stored log-probs."""
    sentences = reference["sentences"]
    sources, targets = [s["source_ids"] for s in sentences], [s["target_ids"] for s in sentences]
    scores = forced_log_probs(encode, cache, config, sources, targets)
    diffs = [np.abs(score - np.asarray(s["log_probs"], dtype=np.float64)).max() for score, s in zip(scores, sentences, strict=True)]
    batch_diff = None
    if reference.get("precision") in BATCH_INVARIANT_PRECISIONS:
        batch_diff = batch_difference(encode, cache, config, sources, targets, scores)
    provider = cache.provider
    result = SelfCheckResult(reference_path=str(Path(model_dir) / SELF_CHECK_FILE), sentences=len(sentences), tokens=sum(len(s["log_probs"]) for s in sentences), max_log_prob_diff=float(max(diffs)),
                             bound=float(reference["bound"]), reference_cpu=describe_cpu(reference.get("cpu", {})), cpu=describe_cpu(cpu_facts()),
                             batch_diff=batch_diff, batch_bound=0.0 if provider == "CPUExecutionProvider" else float(reference["bound"]),
                             provider=provider, int8_scheme=load_model_dir(model_dir, verify_hashes=False).created_by.get("int8_scheme")
                             if reference.get("precision") == "int8" else None)  # fmt: skip
    (logger.info if result.passed else logger.error)("self-check: %s", result.describe())
    return result


def check_model_dir(model_dir: Path, encode: Encode, cache: StepCache, config: ModelConfig) -> SelfCheckResult | None:
    """load_reference, then check_host: None when the model dir has no reference; SelfCheckError when it is unusable."""
    reference = load_reference(model_dir, config)
    return None if reference is None else check_host(model_dir, reference, encode, cache, config)
