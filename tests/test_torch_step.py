"""TorchStep + search: a request decoded beside others gives exactly what it gives alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nmt_serve.model.config import PRESETS, ModelConfig
from nmt_serve.model.search import SearchOptions, generate
from nmt_serve.model.torch_step import TorchStep
from nmt_serve.model.transformer import Transformer


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(1)
    config = ModelConfig(**{**PRESETS["tiny"].to_dict(), "dropout": 0.0})
    return Transformer(config).eval()


SOURCES = [[5, 9, 17, 4], [33], [8, 8, 8, 12, 40, 41, 7], [100, 101]]


@pytest.mark.parametrize("beam_size", [1, 2, 4])
def test_generate_batched_equals_each_source_alone(model: Transformer, beam_size: int) -> None:
    config = model.config
    # Forced length keeps every request running long enough to share many steps with the others.
    options = SearchOptions(beam_size=beam_size, num_hypotheses=beam_size, max_output_tokens=12, min_output_tokens=6)
    step = TorchStep(model)
    together = generate(step, SOURCES, options, config.bos_id, config.eos_id, config.max_positions)
    for source, hypotheses in zip(SOURCES, together, strict=True):
        alone = generate(step, [source], options, config.bos_id, config.eos_id, config.max_positions)[0]
        assert [h.token_ids for h in hypotheses] == [h.token_ids for h in alone]
        assert [h.score for h in hypotheses] == pytest.approx([h.score for h in alone], abs=1e-5)


def test_torch_step_new_row_joins_rows_already_decoding(model: Transformer) -> None:
    """A row with parent -1 starts at position 0 with an empty past while others are at position 3."""
    step = TorchStep(model)
    step.begin([[5, 6, 7], [9, 10]])
    bos = model.config.bos_id
    step(np.array([0]), np.array([-1]), np.array([bos]))
    step(np.array([0]), np.array([0]), np.array([20]))
    step(np.array([0]), np.array([0]), np.array([21]))
    mixed = step(np.array([0, 1]), np.array([0, -1]), np.array([22, bos]))

    fresh = TorchStep(model)
    fresh.begin([[5, 6, 7], [9, 10]])
    alone = fresh(np.array([1]), np.array([-1]), np.array([bos]))
    np.testing.assert_allclose(mixed[1], alone[0], atol=1e-5)
