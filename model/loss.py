"""Training loss and the references' mean NLL (teacher-forced), shared by nmt-train and nmt-eval."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from nmt_serve.model.batching import Batch, make_batch
from nmt_serve.model.transformer import Transformer


def label_smoothed_loss(log_probs: torch.Tensor, target: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Summed loss over (N, V) log-probs: (1 - eps) * NLL + eps * mean over the vocabulary."""
    nll = -log_probs.gather(-1, target[:, None]).squeeze(-1)
    uniform = -log_probs.mean(dim=-1)
    return ((1.0 - smoothing) * nll + smoothing * uniform).sum()


def batch_loss(model: Transformer, batch: Batch, smoothing: float) -> torch.Tensor:
    hidden = model.decode_hidden(batch.src_ids, batch.src_mask, batch.tgt_in)
    real = batch.tgt_out != model.config.pad_id
    # Project only real target positions: the V-wide output layer is the costliest matmul.
    log_probs = model.generate_log_probs(hidden[real])
    return label_smoothed_loss(log_probs, batch.tgt_out[real], smoothing)


LossFunction = Callable[[Transformer, Batch, float], torch.Tensor]


def accumulate_gradients(model: Transformer, batches: Sequence[Batch], smoothing: float, loss_function: LossFunction = batch_loss,
                         bf16: bool = False, device: torch.device = torch.device("cpu")) -> float:  # fmt: skip
    """Adds the gradient of the batches' summed loss per target token of all of them to the parameters' .grad.

    Dividing by the tokens of all the batches, not each batch's own, makes one optimizer step over N batches
    the step over a batch of their union, while only one batch's activations are held at a time.
    Returns the summed loss.
    """
    total_tokens = sum(batch.n_tgt_tokens for batch in batches)
    summed = 0.0
    for batch in batches:
        batch = batch.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_function(model, batch, smoothing)
        (loss / total_tokens).backward()
        summed += loss.item()
    return summed


def mean_nll(model: Transformer, id_pairs: Sequence[tuple[Sequence[int], Sequence[int]]], batches: Sequence[np.ndarray],
             device: torch.device = torch.device("cpu")) -> float:  # fmt: skip
    """Mean negative log-likelihood per target token (EOS included) of the pairs in `batches`, in eval mode.

    Comparing it on training pairs with held-out ones shows how far a model has memorised its data.
    """
    was_training = model.training
    model.eval()
    total_loss, total_tokens = 0.0, 0
    with torch.inference_mode():
        for index in batches:
            batch = make_batch([id_pairs[i] for i in index]).to(device)
            total_loss += float(batch_loss(model, batch, 0.0))
            total_tokens += batch.n_tgt_tokens
    model.train(was_training)
    return total_loss / max(total_tokens, 1)
