"""nmt-average: average the weights of several snapshots of one training run into a checkpoint dir."""

from __future__ import annotations

import argparse
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from importlib.metadata import version

from nmt_serve.model.extras import require_extra

require_extra("nmt-average", "train", ('torch', 'safetensors'))

import torch
from safetensors.torch import load_file

from nmt_serve.model.checkpoint import (
    CONFIG_FILE,
    IMPORT_RECORD_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    load_train_info,
    save_train_info,
    save_weights,
)
from nmt_serve.model.config import ModelConfig
from nmt_serve.model.tokenizer import tokenizer_files
from nmt_serve.model.transformer import Transformer

logger = logging.getLogger(__name__)


def average_weights(snapshots: Sequence[Path]) -> dict[str, torch.Tensor]:
    """Element-wise mean in float32 of every floating tensor; the snapshots must share one config."""
    if not snapshots:
        raise ValueError("nothing to average: no snapshot dirs given")
    total: dict[str, torch.Tensor] = {}
    for snapshot in snapshots:
        state = load_file(str(Path(snapshot) / WEIGHTS_FILE))
        if total and state.keys() != total.keys():
            raise ValueError(f"{snapshot}: its tensors differ from {snapshots[0]}'s")
        for name, tensor in state.items():
            total[name] = total[name] + tensor.float() if name in total else tensor.float().clone()
    return {name: tensor / len(snapshots) for name, tensor in total.items()}


def carried_files(checkpoint: Path) -> list[str]:
    """The files of CHECKPOINT an averaged dir keeps: config and tokenizer always (copying names a missing one),
    an imported model's target tokenizer and import record when present."""
    names = [CONFIG_FILE, *dict.fromkeys([TOKENIZER_FILE, *tokenizer_files(checkpoint)])]
    if (checkpoint / IMPORT_RECORD_FILE).is_file():
        names.append(IMPORT_RECORD_FILE)
    return names


def write_average(checkpoint: Path, snapshots: Sequence[Path], out: Path) -> None:
    """`out` becomes a checkpoint dir: CHECKPOINT's config, tokenizers and records, the averaged weights."""
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != checkpoint.resolve():
        for name in carried_files(checkpoint):
            shutil.copyfile(checkpoint / name, out / name)
    model = Transformer(ModelConfig.load(checkpoint / CONFIG_FILE))
    model.load_state_dict(average_weights(snapshots))
    save_weights(model, out, half=True)
    record = load_train_info(checkpoint)
    record["averaged"] = sorted(Path(snapshot).name for snapshot in snapshots)
    save_train_info(record, out)
    logger.info("averaged %d snapshots into %s", len(snapshots), out)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="nmt-average", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("checkpoint", type=Path, help="the run's checkpoint dir (config, tokenizer, train.json)")
    parser.add_argument("snapshots", type=Path, nargs="*", help="snapshot dirs (default: the newest --last of CHECKPOINT/snapshots)")
    parser.add_argument("--last", type=int, default=5, help="how many of the newest snapshots to average when none are named")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint dir to write")
    args = parser.parse_args(argv)
    snapshots = args.snapshots or sorted((args.checkpoint / "snapshots").glob("step-*"))[-args.last :]
    try:
        write_average(args.checkpoint, snapshots, args.out)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"nmt-average: {error}") from error
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
