"""Beam search's per-step choice compiled (runtime/kernels/beam_select.c, built by runtime/build_extensions.py) against
its numpy form in model/search.py: the same choices and search state, ties, bans and NaN included."""

from __future__ import annotations

import copy
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from nmt_serve.model import search
from nmt_serve.model.search import BeamSearch, SearchOptions
from nmt_serve.runtime.build_extensions import BEAM_SELECT
from tests.extensions import compiled_extension

EOS = 2


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """The extension built in this session from the source (tests/extensions.py)."""
    return compiled_extension("beam_select", tmp_path_factory.mktemp("beam_select"))  # type: ignore[return-value]


def candidates(rng: np.random.Generator, rows: int, needed: int, extra: int, distinct: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Each row's best `needed` (+ `extra` more columns, so the search reads a slice) log-probs, best first, and distinct
    token ids; `distinct` values only, for ties within and across rows."""
    width = needed + extra
    values = np.log(rng.random((rows, width))).astype(np.float32)
    if distinct is not None:
        values = (np.floor(values * distinct / 8) * 8 / distinct).astype(np.float32)
    values = -np.sort(-values, axis=1)
    tokens = np.stack([rng.choice(np.arange(3, 40), width, replace=False) for _ in range(rows)]).astype(np.int64)
    for row in range(rows):
        if rng.random() < 0.5:  # EOS somewhere among the row's candidates
            tokens[row, rng.integers(width)] = EOS
    return values, tokens


def state(searcher: BeamSearch) -> tuple:
    return searcher.rows, searcher.row_scores.tolist(), searcher.next_tokens.tolist(), searcher.finished, searcher.done


@pytest.mark.parametrize("beam_size", [2, 4, 5])
@pytest.mark.parametrize("distinct", [None, 3])
def test_compiled_choice_gives_the_numpy_searchs_state(compiled: ModuleType, monkeypatch: pytest.MonkeyPatch, beam_size: int,
                                                       distinct: int | None) -> None:  # fmt: skip
    """Searches of many steps, the minimum length banning EOS for the first ones: after every step both forms hold the
    same rows, scores, next tokens and finished hypotheses, and return the same parents."""
    rng = np.random.default_rng(beam_size * 10 + (distinct or 0))
    options = SearchOptions(beam_size=beam_size, max_output_tokens=12, min_output_tokens=3)
    for _ in range(20):
        with_numpy = BeamSearch(options, 8, 1, EOS, 64)
        with_compiled = copy.deepcopy(with_numpy)
        while not with_numpy.done:
            values, tokens = candidates(rng, len(with_numpy.rows), with_numpy.candidates_needed, int(rng.integers(3)), distinct)
            monkeypatch.setattr(search, "native_beam_select", None)
            expected = with_numpy.advance_candidates(values, tokens)
            monkeypatch.setattr(search, "native_beam_select", compiled)
            got = with_compiled.advance_candidates(values, tokens)
            assert (expected is None) == (got is None)
            if expected is not None:
                np.testing.assert_array_equal(got, expected)
            assert state(with_compiled) == state(with_numpy)


@pytest.mark.parametrize("finished", [0, 1, 3])
def test_choices_with_eos_infinities_and_nan(compiled: ModuleType, finished: int) -> None:
    """The walk over ranked candidates as the numpy form ranks them: -inf after every finite total, NaN last, equal totals
    by token id then row; an EOS is taken only among the K best and while fewer than K hypotheses have finished."""
    values = np.array([[-0.5, -1.0, -1.0, -np.inf, np.nan], [-0.25, -1.0, -1.5, -2.0, -3.0]], dtype=np.float32)
    tokens = np.array([[EOS, 7, 5, 9, 11], [6, 8, EOS, 4, 3]], dtype=np.int64)
    scores = np.array([0.0, -0.5])
    got = compiled.choose(values, tokens, scores, 5, EOS, False, 3, finished)
    # totals: (0, EOS) -0.5, (1, 6) -0.75, (0, 5) -1.0, (0, 7) -1.0, (1, 8) -1.5, (1, EOS) -2.0, ...
    ranked = [(1, 6, -0.75), (0, 5, -1.0), (0, 7, -1.0), (1, 8, -1.5)]
    expected = ([(0, EOS, -0.5)] if finished < 3 else []) + ranked[:3]
    assert got == expected
    banned = compiled.choose(values, tokens, scores, 5, EOS, True, 3, finished)
    assert banned == ranked[:3]


def test_bad_arrays_are_refused_with_their_name(compiled: ModuleType) -> None:
    values, tokens, scores = np.zeros((2, 4), np.float32), np.zeros((2, 4), np.int64), np.zeros(2)
    with pytest.raises(ValueError, match="log_probs"):
        compiled.choose(values.astype(np.float64), tokens, scores, 4, EOS, False, 2, 0)
    with pytest.raises(ValueError, match="token_ids"):
        compiled.choose(values, tokens.astype(np.int32), scores, 4, EOS, False, 2, 0)
    with pytest.raises(ValueError, match="row_scores"):
        compiled.choose(values, tokens, scores.astype(np.float32), 4, EOS, False, 2, 0)
    with pytest.raises(ValueError, match="need 5 candidates for each of 2 rows"):
        compiled.choose(values, tokens, scores, 5, EOS, False, 2, 0)


def test_the_build_writes_the_module_search_imports() -> None:
    """model/search.py imports the extension from the model package under this Python's extension suffix."""
    assert BEAM_SELECT.module.parent == Path(search.__file__).parent and BEAM_SELECT.module.name.startswith("_beam_select")
