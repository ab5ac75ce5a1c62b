"""Transformer: shapes, padding invariance, cached decode_step == forward, mixed positions in one batch."""

from __future__ import annotations

import pytest
import torch

from nmt_serve.model.config import BOS_ID, PRESETS, ModelConfig
from nmt_serve.model.transformer import Transformer, sinusoidal_table

TOL = 1e-5


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(**{**PRESETS["tiny"].to_dict(), "dropout": 0.0})
    return Transformer(config).eval()


def random_ids(model: Transformer, batch: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # Ids >= 4 avoid the special tokens, so no accidental padding.
    return torch.randint(4, model.config.vocab_size, (batch, length), generator=generator)


def test_sinusoidal_table_matches_paper_formula() -> None:
    table = sinusoidal_table(10, 8)
    assert table[3, 2].item() == pytest.approx(torch.sin(torch.tensor(3 / 10000 ** (2 / 8))).item())
    assert table[3, 3].item() == pytest.approx(torch.cos(torch.tensor(3 / 10000 ** (2 / 8))).item())


@pytest.mark.parametrize("batch", [1, 3])
def test_transformer_output_shapes(model: Transformer, batch: int) -> None:
    config = model.config
    src = random_ids(model, batch, 7, seed=1)
    mask = torch.ones_like(src, dtype=torch.bool)
    memory = model.encode(src, mask)
    assert memory.shape == (batch, 7, config.d_model)
    cross = model.cross_kv(memory)
    assert len(cross) == config.n_decoder_layers
    assert cross[0][0].shape == (batch, config.n_heads, 7, config.head_dim)
    tgt = random_ids(model, batch, 5, seed=2)
    log_probs = model(src, mask, tgt)
    assert log_probs.shape == (batch, 5, config.vocab_size)
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(batch, 5), atol=1e-4)


def test_transformer_padding_does_not_change_log_probs(model: Transformer) -> None:
    src = random_ids(model, 1, 5, seed=3)
    tgt = random_ids(model, 1, 4, seed=4)
    alone = model(src, torch.ones_like(src, dtype=torch.bool), tgt)
    pad = model.config.pad_id
    padded_src = torch.cat([src, torch.full((1, 6), pad)], dim=1)
    padded_tgt = torch.cat([tgt, torch.full((1, 3), pad)], dim=1)
    other_src, other_tgt = random_ids(model, 1, 11, seed=5), random_ids(model, 1, 7, seed=6)
    batch_src = torch.cat([padded_src, other_src])
    batch_tgt = torch.cat([padded_tgt, other_tgt])
    batched = model(batch_src, batch_src != pad, batch_tgt)
    assert (batched[0, :4] - alone[0]).abs().max() <= TOL


def test_transformer_cached_steps_equal_forward(model: Transformer) -> None:
    batch, length = 3, 6
    src = random_ids(model, batch, 5, seed=7)
    mask = torch.ones_like(src, dtype=torch.bool)
    tgt = torch.cat([torch.full((batch, 1), BOS_ID), random_ids(model, batch, length - 1, seed=8)], dim=1)
    full = model(src, mask, tgt)
    cross = model.cross_kv(model.encode(src, mask))
    past = model.empty_past(batch)
    past_mask = torch.zeros(batch, 0, dtype=torch.bool)
    for t in range(length):
        positions = torch.full((batch,), t)
        log_probs, past = model.decode_step(tgt[:, t : t + 1], positions, past, past_mask, cross, mask)
        past_mask = torch.ones(batch, t + 1, dtype=torch.bool)
        assert (log_probs[:, 0] - full[:, t]).abs().max() <= TOL
    assert past[0][0].shape == (batch, model.config.n_heads, length, model.config.head_dim)


def test_transformer_rows_at_different_positions_equal_rows_alone(model: Transformer) -> None:
    """Row 0 has 4 tokens of history, row 1 has 1 (its unused past slots masked), row 2 has none."""
    src = random_ids(model, 3, 6, seed=9)
    src[2, 4:] = model.config.pad_id  # a shorter source in the same batch
    src_mask = src != model.config.pad_id
    histories = [random_ids(model, 1, 4, seed=10)[0], random_ids(model, 1, 1, seed=11)[0], torch.zeros(0, dtype=torch.long)]
    next_tokens = random_ids(model, 3, 1, seed=12)
    cross = model.cross_kv(model.encode(src, src_mask))

    # Each row alone: its history fed as one multi-token step from an empty past.
    expected = []
    for row, history in enumerate(histories):
        tokens = torch.cat([history, next_tokens[row]])[None]
        row_cross = [(k[row : row + 1], v[row : row + 1]) for k, v in cross]
        log_probs, _ = model.decode_step(tokens, torch.zeros(1, dtype=torch.long), model.empty_past(1), torch.zeros(1, 0, dtype=torch.bool), row_cross, src_mask[row : row + 1])
        expected.append(log_probs[0, -1])

    # All rows together: each history's cache left-padded into a shared past of length 4.
    past_len = 4
    config = model.config
    past = [(torch.zeros(3, config.n_heads, past_len, config.head_dim), torch.zeros(3, config.n_heads, past_len, config.head_dim)) for _ in range(config.n_decoder_layers)]
    past_mask = torch.zeros(3, past_len, dtype=torch.bool)
    for row, history in enumerate(histories):
        if len(history) == 0:
            continue
        row_cross = [(k[row : row + 1], v[row : row + 1]) for k, v in cross]
        _, present = model.decode_step(history[None], torch.zeros(1, dtype=torch.long), model.empty_past(1), torch.zeros(1, 0, dtype=torch.bool), row_cross, src_mask[row : row + 1])
        for layer, (key, value) in enumerate(present):
            past[layer][0][row, :, past_len - len(history) :] = key[0]
            past[layer][1][row, :, past_len - len(history) :] = value[0]
        past_mask[row, past_len - len(history) :] = True
    positions = torch.tensor([len(history) for history in histories])
    log_probs, _ = model.decode_step(next_tokens, positions, past, past_mask, cross, src_mask)
    for row in range(3):
        assert (log_probs[row, 0] - expected[row]).abs().max() <= TOL


def test_from_state_holds_the_given_tensors_and_computes_like_a_loaded_model(model: Transformer) -> None:
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    rebuilt = Transformer.from_state(model.config, state).eval()
    assert rebuilt.embed.weight.data_ptr() == state["embed.weight"].data_ptr()  # no second copy of the weights
    assert not any(buffer.is_meta for buffer in rebuilt.buffers())
    src, tgt = random_ids(model, 2, 7, seed=3), random_ids(model, 2, 5, seed=4)
    mask = torch.ones_like(src, dtype=torch.bool)
    with torch.no_grad():
        assert torch.equal(rebuilt(src, mask, tgt), model(src, mask, tgt))


def test_from_state_casts_a_half_checkpoint_and_refuses_missing_tensors(model: Transformer) -> None:
    half = {name: tensor.half() for name, tensor in model.state_dict().items()}
    rebuilt = Transformer.from_state(model.config, half)
    assert all(parameter.dtype == torch.float32 for parameter in rebuilt.parameters())
    del half["embed.weight"]
    with pytest.raises(RuntimeError, match="embed.weight"):
        Transformer.from_state(model.config, half)
