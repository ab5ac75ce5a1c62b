"""bench/ct2_convert.py: CTranslate2 on the converted weights decodes what our PyTorch search decodes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

ctranslate2 = pytest.importorskip("ctranslate2")

from nmt_serve.bench.ct2_convert import CT2_PAD_TOKEN, convert_checkpoint  # noqa: E402
from nmt_serve.model.checkpoint import TOKENIZER_FILE, save_weights  # noqa: E402
from nmt_serve.model.config import PRESETS  # noqa: E402
from nmt_serve.model.padding import pad_sources  # noqa: E402
from nmt_serve.model.search import FinishReason, SearchOptions, generate  # noqa: E402
from nmt_serve.model.tokenizer import Tokenizer  # noqa: E402
from nmt_serve.model.torch_step import TorchStep  # noqa: E402
from nmt_serve.model.transformer import Transformer  # noqa: E402

TEXTS = ["Ich sehe den Hund.", "I see the dog.", "Wir mögen Kaffee heute.", "We like coffee today."]
SOURCE_TEXTS = ["Ich sehe den Hund.", "Kaffee", "Wir mögen den großen Hund heute nicht."]  # 3 lengths
MAX_TOKENS = 12
# Exact-weights parity: per-token log-probs agree to ~1e-6; this leaves room for other CPUs' kernels.
SCORE_ATOL = 1e-3


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train(TEXTS * 3, vocab_size=300)


@pytest.fixture(scope="module")
def model(tokenizer: Tokenizer) -> Transformer:
    """Tiny random model whose EOS is likely enough that some beam hypotheses end with it."""
    torch.manual_seed(0)
    config = dataclasses.replace(PRESETS["tiny"], dropout=0.0, vocab_size=tokenizer.vocab_size)
    model = Transformer(config).eval()
    with torch.no_grad():
        direction = torch.randn(config.d_model)
        direction /= direction.norm()
        # Every hidden state leans towards `direction`, and so towards EOS: its logit gains ~2.
        model.decoder_layers[-1].norm3.bias.copy_(0.5 * direction)
        model.embed.weight[config.eos_id] = 4.0 * direction
    return model


@pytest.fixture(scope="module")
def checkpoint_dir(model: Transformer, tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("checkpoint")
    save_weights(model, directory)
    tokenizer.save(directory / TOKENIZER_FILE)
    return directory


@pytest.fixture(scope="module")
def ct2_dir(checkpoint_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_checkpoint(checkpoint_dir, tmp_path_factory.mktemp("ct2") / "model")


@pytest.fixture(scope="module")
def translator(ct2_dir: Path):
    return ctranslate2.Translator(str(ct2_dir), device="cpu", inter_threads=1, intra_threads=1)


@pytest.fixture(scope="module")
def vocabulary(ct2_dir: Path) -> list[str]:
    return json.loads((ct2_dir / "shared_vocabulary.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def sources(tokenizer: Tokenizer) -> list[list[int]]:
    return tokenizer.encode_batch(SOURCE_TEXTS)


def to_tokens(vocabulary: list[str], ids: list[int]) -> list[str]:
    return [vocabulary[token_id] for token_id in ids]


def to_ids(vocabulary: list[str], tokens: list[str]) -> list[int]:
    index = {token: token_id for token_id, token in enumerate(vocabulary)}
    return [index[token] for token in tokens]


def teacher_forced_log_probs(model: Transformer, source: list[int], tokens: list[int]) -> torch.Tensor:
    """(T+1, V) float64 log-probs after BOS and after each of `tokens`."""
    src_ids, src_mask = map(torch.from_numpy, pad_sources([source], model.config.pad_id, model.config.eos_id))
    tgt_ids = torch.tensor([[model.config.bos_id, *tokens]])
    with torch.no_grad():
        return model(src_ids, src_mask, tgt_ids)[0].double()


def test_convert_checkpoint_writes_config_and_vocabulary(ct2_dir: Path, vocabulary: list[str], tokenizer: Tokenizer) -> None:
    config = json.loads((ct2_dir / "config.json").read_text(encoding="utf-8"))
    assert (config["bos_token"], config["eos_token"], config["unk_token"], config["decoder_start_token"]) == ("<s>", "</s>", "<unk>", "<s>")
    assert config["add_source_eos"] is True and config["add_source_bos"] is False
    assert len(vocabulary) == tokenizer.vocab_size
    assert vocabulary[:4] == [CT2_PAD_TOKEN, "<s>", "</s>", "<unk>"]
    assert (ct2_dir / "model.bin").is_file()


def test_convert_checkpoint_rejects_unknown_quantization(checkpoint_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        convert_checkpoint(checkpoint_dir, tmp_path / "model", quantization="int3")


def test_score_batch_log_probs_equal_torch(model: Transformer, translator, vocabulary: list[str], sources: list[list[int]]) -> None:
    """Tensor level: CTranslate2's per-token log-probs of a fixed target are ours (EOS included)."""
    targets = [[5 + i, 40, 41, 7, 200][: 2 + i] for i in range(len(sources))]
    results = translator.score_batch([to_tokens(vocabulary, s) for s in sources], [to_tokens(vocabulary, t) for t in targets])
    for source, target, result in zip(sources, targets, results, strict=True):
        full = [*target, model.config.eos_id]
        log_probs = teacher_forced_log_probs(model, source, target)
        expected = log_probs[torch.arange(len(full)), torch.tensor(full)].numpy()
        np.testing.assert_allclose(result.log_probs, expected, atol=SCORE_ATOL)


def test_greedy_forced_length_equals_torch(model: Transformer, translator, vocabulary: list[str], sources: list[list[int]]) -> None:
    """Token ids equal; scores equal once CTranslate2's convention is applied: it bans EOS before the
    minimum length by masking the logits, so its log-probs are renormalised over the other tokens,
    where our ban_eos_until leaves the log-probs as they were (score += -log(1 - p_eos) per banned step)."""
    config = model.config
    min_tokens = MAX_TOKENS - 1
    options = SearchOptions(beam_size=1, max_output_tokens=MAX_TOKENS, min_output_tokens=min_tokens, length_penalty=0.0)
    ours = generate(TorchStep(model), sources, options, config.bos_id, config.eos_id, config.max_positions)
    results = translator.translate_batch(
        [to_tokens(vocabulary, s) for s in sources], beam_size=1, max_decoding_length=MAX_TOKENS,
        min_decoding_length=min_tokens, length_penalty=0.0, return_scores=True,
    )  # fmt: skip
    for source, (hypothesis,), result in zip(sources, ours, results, strict=True):
        assert len(hypothesis.token_ids) >= min_tokens
        assert to_ids(vocabulary, result.hypotheses[0]) == list(hypothesis.token_ids)
        log_probs = teacher_forced_log_probs(model, source, list(hypothesis.token_ids))[: len(hypothesis.token_ids)]
        banned_steps = torch.arange(len(hypothesis.token_ids)) < min_tokens
        renormalised = torch.where(banned_steps, -torch.log1p(-log_probs[:, config.eos_id].exp()), 0.0)
        assert result.scores[0] == pytest.approx(hypothesis.score + float(renormalised.sum()), abs=SCORE_ATOL)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
@pytest.mark.parametrize("beam_size", [1, 4])
def test_search_equals_torch_without_min_length(
    model: Transformer, translator, vocabulary: list[str], sources: list[list[int]], beam_size: int, length_penalty: float
) -> None:
    """With no EOS ban (CTranslate2's default min_decoding_length is 1, ours 0) both searches apply the
    same rules: the whole n-best list, EOS-finished hypotheses included, and normalised scores agree."""
    config = model.config
    options = SearchOptions(beam_size=beam_size, num_hypotheses=beam_size, max_output_tokens=MAX_TOKENS, length_penalty=length_penalty)
    ours = generate(TorchStep(model), sources, options, config.bos_id, config.eos_id, config.max_positions)
    results = translator.translate_batch(
        [to_tokens(vocabulary, s) for s in sources], beam_size=beam_size, num_hypotheses=beam_size,
        max_decoding_length=MAX_TOKENS, min_decoding_length=0, length_penalty=length_penalty, return_scores=True,
    )  # fmt: skip
    for hypotheses, result in zip(ours, results, strict=True):
        assert [to_ids(vocabulary, tokens) for tokens in result.hypotheses] == [list(h.token_ids) for h in hypotheses]
        np.testing.assert_allclose(result.scores, [h.score for h in hypotheses], atol=SCORE_ATOL)
    if beam_size > 1:  # the EOS rules were exercised, not only the length limit
        assert any(h.finish_reason is FinishReason.EOS for hypotheses in ours for h in hypotheses)


def test_convert_checkpoint_int8_translates(checkpoint_dir: Path, tmp_path: Path, vocabulary: list[str], sources: list[list[int]]) -> None:
    out = convert_checkpoint(checkpoint_dir, tmp_path / "int8", quantization="int8")
    translator = ctranslate2.Translator(str(out), device="cpu", compute_type="int8", inter_threads=1, intra_threads=1)
    results = translator.translate_batch([to_tokens(vocabulary, s) for s in sources], beam_size=1,
                                         max_decoding_length=MAX_TOKENS, min_decoding_length=MAX_TOKENS - 1)
    assert [len(result.hypotheses[0]) >= MAX_TOKENS - 1 for result in results] == [True] * len(sources)


def test_build_spec_refuses_what_it_does_not_convert() -> None:
    from nmt_serve.bench.ct2_convert import build_spec

    config = dataclasses.replace(PRESETS["tiny"], pre_norm=True, activation="gelu")
    with pytest.raises(ValueError, match=r"cannot convert pre_norm=True, activation='gelu'"):
        build_spec(Transformer(config))
