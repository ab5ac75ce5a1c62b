"""nmt-train and the PyTorch step on CUDA: a run there resumes on the CPU, and decodes what the CPU decodes.

Marked gpu; skipped with the reason where torch sees no CUDA GPU (CI never has one).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from nmt_serve.model.checkpoint import load_checkpoint
from nmt_serve.model.search import SearchOptions, generate
from nmt_serve.model.torch_step import TorchStep
from nmt_serve.model.train import main as train_main
from tests.test_train import train_args

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU here")]
SOURCES = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]


def test_train_on_cuda_then_resume_exactly_on_the_cpu(tiny_corpus: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert train_main([*train_args(tiny_corpus, out, 6), "--device", "cuda", "--bf16"]) == 0
    assert json.loads((out / "train.json").read_text())["device"] == torch.cuda.get_device_name()
    # The optimizer's moments were saved from the GPU; the resumed run on the CPU must take them.
    assert train_main([*train_args(tiny_corpus, out, 12), "--resume", "--device", "cpu"]) == 0
    curve = json.loads((out / "train.json").read_text())["loss_curve"]
    assert [point[0] for point in curve] == list(range(1, 13))
    assert all(math.isfinite(loss) for _, loss in curve) and curve[-1][1] < curve[0][1]


def test_torch_step_on_cuda_decodes_what_the_cpu_decodes(tiny_checkpoint: Path) -> None:
    cpu, cuda = load_checkpoint(tiny_checkpoint), load_checkpoint(tiny_checkpoint, "cuda")
    config = cpu.config
    for options in (SearchOptions(max_output_tokens=12), SearchOptions(beam_size=4, max_output_tokens=12)):
        results = [generate(TorchStep(checkpoint.model), SOURCES, options, config.bos_id, config.eos_id, config.max_positions)
                   for checkpoint in (cpu, cuda)]  # fmt: skip
        on_cpu, on_cuda = ([[hypothesis.token_ids for hypothesis in hypotheses] for hypotheses in result] for result in results)
        assert on_cuda == on_cpu
        scores = [[[hypothesis.score for hypothesis in hypotheses] for hypotheses in result] for result in results]
        np.testing.assert_allclose(scores[1], scores[0], atol=1e-3)
