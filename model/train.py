"""nmt-train: train the Transformer on a TSV corpus into a checkpoint dir, with exact resume."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import resource
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from importlib.metadata import version

from nmt_serve.model.extras import require_extra

require_extra("nmt-train", "train", ('torch', 'safetensors', 'sacrebleu', 'tqdm'))

import numpy as np
import torch
from safetensors.torch import load_file
from tqdm import tqdm

from nmt_serve.model.batching import Batch, encode_pairs, make_batch, plan_batches
from nmt_serve.model.checkpoint import TOKENIZER_FILE, WEIGHTS_FILE, load_train_info, save_train_info, save_weights
from nmt_serve.model.config import PRESETS, ModelConfig
from nmt_serve.model.corpus import read_tsv
from nmt_serve.model.cpu_memory import bound_heap, bound_kernel_cache
from nmt_serve.model.device import DEVICE_CHOICES, bf16_is_native, cpu_model_name, native_bf16, pick_device
from nmt_serve.model.evaluate import score, translate
from nmt_serve.model.file_hash import sha256_file
from nmt_serve.model.grow import STACK_ORDERS, grow_encoder, source_layer_order
from nmt_serve.model.loss import LossFunction, accumulate_gradients, batch_loss, mean_nll
from nmt_serve.model.search import SearchOptions
from nmt_serve.model.tokenizer import Tokenizer
from nmt_serve.model.transformer import Transformer

logger = logging.getLogger(__name__)

LAST_DIR = "last"  # resume state: weights, optimizer, RNG and data position (not shipped)
TRAINER_STATE_FILE = "trainer_state.pt"
SNAPSHOTS_DIR = "snapshots"
COMPILE_BACKEND = "inductor"  # torch.compile's; tests swap in "eager" to check the wiring without a C++ compile


@dataclass
class TrainSettings:
    max_tokens: int = 6000  # padded tokens (rows x longest side) per batch
    peak_lr: float = 1e-3
    warmup_steps: int = 800
    label_smoothing: float = 0.1
    clip_norm: float = 1.0
    max_steps: int = 0  # 0 = no step limit
    max_minutes: float = 0.0  # 0 = no time limit
    eval_every: int = 500
    log_every: int = 50
    valid_bleu_size: int = 500
    max_len: int = 100  # pairs with a longer side (in tokens) are skipped
    seed: int = 1234
    bf16: bool = field(default_factory=native_bf16)  # autocast to bfloat16; nmt-train's default: where the device has it natively
    rewarmup_steps: int = 300  # after a restart from shipped weights: ramp the LR up again while Adam's moments refill
    keep_snapshots: int = 0  # float16 weights of the last N validations in OUT/snapshots/, for nmt-average
    cooldown_steps: int = 0  # > 0 (with max_steps): the LR falls linearly to 0 over the run's last N steps
    dropout: float = -1.0  # < 0: the preset's (or, resuming, the checkpoint's)
    accumulate: int = 1  # batches per optimizer step: the step over a batch N times --max-tokens, holding one batch's activations at a time
    compile: bool = False  # torch.compile the training loss (forward and backward of the model)


@dataclass
class Progress:
    """Everything besides weights and optimizer that an exact resume needs."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tgt_tokens: int = 0
    train_seconds: float = 0.0
    wall_seconds: float = 0.0  # train_seconds plus validation and checkpoint writing, over every leg
    best_bleu: float = -1.0
    loss_curve: list[list[float]] = field(default_factory=list)  # [step, mean train loss]
    validations: list[dict[str, float]] = field(default_factory=list)
    checkpoint_minutes: list[dict[str, float]] = field(default_factory=list)  # step, training and wall minutes of each validation
    restart_step: int = -1  # step of the last restart without optimizer state; -1 = none


def restart_scale(progress: Progress, settings: TrainSettings) -> float:
    """A fresh Adam takes near-sign-sized steps at first; ramping the LR back up keeps it from undoing training."""
    if progress.restart_step < 0 or settings.rewarmup_steps <= 0:
        return 1.0
    return min(1.0, (progress.step + 1 - progress.restart_step) / settings.rewarmup_steps)


def learning_rate(step: int, settings: TrainSettings) -> float:
    """The paper's schedule, d^-0.5 * min(step^-0.5, step * warmup^-1.5), rescaled to peak at `peak_lr`.

    With `cooldown_steps` it then decays linearly to 0 at `max_steps`: the inverse square root never
    anneals, and a run that ends on a cool-down settles into the minimum its noisy steps hover around.
    """
    step = max(step, 1)
    rate = settings.peak_lr * min(step / settings.warmup_steps, math.sqrt(settings.warmup_steps / step))
    if settings.cooldown_steps > 0 and settings.max_steps > 0:
        rate *= min(1.0, max(0.0, (settings.max_steps - step + 1) / settings.cooldown_steps))
    return rate


def compiled_loss() -> LossFunction:
    """batch_loss compiled by torch.compile: the function, not the module, so that the model's state dict keeps its
    names (a compiled module's gain an `_orig_mod.` prefix) and checkpoints are the same with and without --compile."""
    # Every batch has another shape: dynamic from the first call instead of a recompile per new shape.
    return torch.compile(batch_loss, dynamic=True, backend=COMPILE_BACKEND)


def load_or_train_tokenizer(out: Path, pairs: Sequence[tuple[str, str]], vocab_size: int) -> Tokenizer:
    path = out / TOKENIZER_FILE
    if path.is_file():
        return Tokenizer.load(path)
    logger.info("training a %d-id BPE tokenizer on %d pairs", vocab_size, len(pairs))
    tokenizer = Tokenizer.train((text for pair in pairs for text in pair), vocab_size)
    tokenizer.save(path)
    return tokenizer


class Trainer:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, train_pairs, valid_pairs, out: Path, settings: TrainSettings,
                 device: torch.device = torch.device("cpu")) -> None:  # fmt: skip
        self.device = device
        self.model = model.to(device)
        self.tokenizer = tokenizer
        # One slot is kept for EOS/BOS inside the position table.
        max_len = min(settings.max_len, model.config.max_positions - 1)
        self.train_ids = encode_pairs(tokenizer, train_pairs, max_len)
        self.valid_pairs = list(valid_pairs)
        self.valid_ids = encode_pairs(tokenizer, self.valid_pairs, max_len)
        self.out = out
        self.settings = settings
        self.optimizer = torch.optim.Adam(model.parameters(), lr=settings.peak_lr, betas=(0.9, 0.98), eps=1e-9)
        self.loss_function = compiled_loss() if settings.compile else batch_loss
        self.wall_mark = time.monotonic()  # where the wall time of the next checkpoint counts from (reset as each leg starts)
        self.progress = Progress()
        self.lengths = [(len(s), len(t)) for s, t in self.train_ids]
        self._planned_epoch, self._planned = -1, []
        valid_lengths = [(len(s), len(t)) for s, t in self.valid_ids]
        self.valid_batches = plan_batches(valid_lengths, settings.max_tokens, np.random.default_rng(settings.seed))

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        # Seeded by epoch so a resumed run sees exactly the batches an uninterrupted one would.
        if self._planned_epoch != epoch:
            rng = np.random.default_rng([self.settings.seed, epoch])
            self._planned = plan_batches(self.lengths, self.settings.max_tokens, rng)
            self._planned_epoch = epoch
        return self._planned

    def save_last(self) -> None:
        last = self.out / LAST_DIR
        last.mkdir(parents=True, exist_ok=True)
        save_weights(self.model, last)
        state = {"optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state(), "progress": dataclasses.asdict(self.progress)}
        if self.device.type == "cuda":  # dropout draws from the GPU's generator there
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        torch.save(state, last / TRAINER_STATE_FILE)

    def load_last(self) -> None:
        last = self.out / LAST_DIR
        self.model.load_state_dict(load_file(str(last / WEIGHTS_FILE)))
        # Saved on any device, loaded on this one: the optimizer moves its moments to the parameters' device.
        state = torch.load(last / TRAINER_STATE_FILE, weights_only=False, map_location="cpu")
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        if self.device.type == "cuda" and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        self.progress = Progress(**state["progress"])
        logger.info("resumed at step %d (epoch %d, batch %d)", self.progress.step, self.progress.epoch, self.progress.batch_in_epoch)

    def restart_from_best(self, record: dict[str, Any]) -> None:
        """Continue from the checkpoint's weights when last/ is gone (a fresh machine): not exact.

        The optimizer starts empty (the LR ramps up again over `rewarmup_steps`), and the data
        order continues at the start of the epoch after the recorded one.
        """
        self.model.load_state_dict({name: tensor.float() for name, tensor in load_file(str(self.out / WEIGHTS_FILE)).items()})
        best = record.get("best", {})
        # Shipped weights (train.json "shipped", say a mean of the last snapshots) come from the whole
        # run, so it continues from its last step; otherwise the weights are the best step's.
        step = int(record.get("steps", 0)) if "shipped" in record else int(best.get("step", record.get("steps", 0)))
        self.progress = Progress(
            step=step,
            epoch=int(record.get("epochs", 0)) + 1,
            tgt_tokens=int(record.get("target_tokens", 0)),
            train_seconds=float(record.get("train_minutes", 0.0)) * 60,
            wall_seconds=float(record.get("wall_minutes", 0.0)) * 60,
            best_bleu=float(best.get("bleu", -1.0)),
            loss_curve=[point for point in record.get("loss_curve", []) if point[0] <= step],
            validations=[result for result in record.get("validations", []) if result["step"] <= step],
            checkpoint_minutes=[times for times in record.get("checkpoint_minutes", []) if times["step"] <= step],
            restart_step=step,
        )
        logger.warning("no %s/ resume state: restarting from the best weights at step %d with a fresh optimizer", LAST_DIR, step)

    def initialize_from(self, source: Path, stack_order: str = "cycle") -> dict[str, Any]:
        """Start from another checkpoint's weights (fine-tuning on a new corpus): a new run from step 0, so the
        learning rate warms up again and the validations and best score are this corpus's own. Where this
        model has more encoder layers than the source, the new ones start as copies of trained ones."""
        state = {name: tensor.float() for name, tensor in load_file(str(source / WEIGHTS_FILE)).items()}
        source_layers = ModelConfig.load(source / "config.json").n_encoder_layers
        target_layers = self.model.config.n_encoder_layers
        grown = None
        if target_layers != source_layers:
            state = grow_encoder(state, source_layers, target_layers, stack_order)
            grown = {"encoder_layers": [source_layers, target_layers], "stack_order": stack_order}
            logger.info("encoder grown from %d to %d layers (%s)", source_layers, target_layers, stack_order)
        self.model.load_state_dict(state)
        origin = load_train_info(source)
        logger.info("initialized from the weights in %s", source)
        record = {"dir": str(source), "weights_sha256": sha256_file(source / WEIGHTS_FILE), "version": origin.get("shipped", {}).get("version"),
                  "steps": origin.get("steps"), "corpus": origin.get("corpus")}  # fmt: skip
        if grown:
            record["grown"] = grown
        return record

    def save_snapshot(self) -> None:
        """Weights of this validation for checkpoint averaging; only the newest `keep_snapshots` stay."""
        snapshots = self.out / SNAPSHOTS_DIR
        directory = snapshots / f"step-{self.progress.step:07d}"
        directory.mkdir(parents=True, exist_ok=True)
        save_weights(self.model, directory, half=True)
        for old in sorted(snapshots.glob("step-*"))[: -self.settings.keep_snapshots]:
            shutil.rmtree(old)

    def validate(self) -> dict[str, float]:
        valid_nll = mean_nll(self.model, self.valid_ids, self.valid_batches, self.device)
        self.model.eval()
        sample = self.valid_pairs[: self.settings.valid_bleu_size]
        hypotheses = translate(self.model, self.tokenizer, [src for src, _ in sample], SearchOptions(beam_size=1))
        self.model.train()
        return {"step": self.progress.step, "valid_nll": round(valid_nll, 4), **score(hypotheses, [ref for _, ref in sample])}

    def finished(self, started: float) -> bool:
        settings, progress = self.settings, self.progress
        if settings.max_steps and progress.step >= settings.max_steps:
            return True
        return bool(settings.max_minutes) and time.monotonic() - started >= settings.max_minutes * 60

    def start_leg(self, record: dict[str, Any]) -> None:
        """A leg is one uninterrupted run of nmt-train; train.json keeps each one's span, speed and peak memory."""
        record.setdefault("legs", []).append({
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpu": cpu_model_name() if self.device.type == "cpu" else torch.cuda.get_device_name(self.device),
            "threads": torch.get_num_threads(),
            "bf16": self.settings.bf16,
            "compile": self.settings.compile,
            "max_tokens": self.settings.max_tokens,
            "accumulate": self.settings.accumulate,
            "start_step": self.progress.step,
            "start_target_tokens": self.progress.tgt_tokens,
            "start_train_seconds": round(self.progress.train_seconds, 1),
        })

    def update_leg(self, record: dict[str, Any]) -> None:
        leg, progress = record["legs"][-1], self.progress
        seconds = progress.train_seconds - leg["start_train_seconds"]
        tokens = progress.tgt_tokens - leg["start_target_tokens"]
        leg.update(
            end_step=progress.step,
            train_minutes=round(seconds / 60, 2),
            target_tokens_per_second=round(tokens / max(seconds, 1e-9), 1),
            # ru_maxrss is in KiB on Linux: the process's peak resident memory so far.
            peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        )

    def run(self, record: dict[str, Any]) -> None:
        settings, progress = self.settings, self.progress
        self.model.train()
        self.start_leg(record)
        started = self.wall_mark = time.monotonic()
        # With a time limit the bar counts minutes, so tqdm's ETA is the time left.
        by_time = not settings.max_steps
        bar = tqdm(total=settings.max_minutes if by_time else settings.max_steps, initial=0 if by_time else progress.step,
                   unit="min" if by_time else "step", desc="train", dynamic_ncols=True)
        window_loss, window_tokens, window_start = 0.0, 0, time.monotonic()
        while not self.finished(started):
            loss, tokens = self.advance()
            window_loss += loss
            window_tokens += tokens
            if progress.step % settings.log_every == 0:
                elapsed = time.monotonic() - window_start
                progress.train_seconds += elapsed
                progress.loss_curve.append([progress.step, round(window_loss / window_tokens, 6)])
                bar.set_postfix(step=progress.step, loss=f"{window_loss / window_tokens:.3f}", tok_s=f"{window_tokens / elapsed:.0f}", epoch=progress.epoch)
                window_loss, window_tokens, window_start = 0.0, 0, time.monotonic()
            if by_time:
                bar.n = round(min((time.monotonic() - started) / 60, settings.max_minutes), 2)
                bar.refresh()
            else:
                bar.update(1)
            if progress.step % settings.eval_every == 0 or self.finished(started):
                self.checkpoint(record)
                window_start = time.monotonic()  # validation time is not training time
        bar.close()

    def next_batches(self, count: int) -> list[Batch]:
        """The next `count` batches in data order (into the next epoch when one ends), moving the data position past them."""
        progress, batches = self.progress, []
        while len(batches) < count:
            planned = self.epoch_batches(progress.epoch)
            if progress.batch_in_epoch >= len(planned):
                progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
                continue
            batches.append(make_batch([self.train_ids[i] for i in planned[progress.batch_in_epoch]]))
            progress.batch_in_epoch += 1
        return batches

    def advance(self) -> tuple[float, int]:
        """One optimizer step over the next `accumulate` batches: their summed loss and target tokens."""
        batches = self.next_batches(self.settings.accumulate)
        loss = self.train_step(batches)
        tokens = sum(batch.n_tgt_tokens for batch in batches)
        self.progress.step += 1
        self.progress.tgt_tokens += tokens
        return loss, tokens

    def train_step(self, batches: Sequence[Batch]) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.progress.step + 1, self.settings) * restart_scale(self.progress, self.settings)
        self.optimizer.zero_grad(set_to_none=True)
        loss = accumulate_gradients(self.model, batches, self.settings.label_smoothing, self.loss_function, self.settings.bf16, self.device)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.clip_norm)
        self.optimizer.step()
        return loss

    def checkpoint(self, record: dict[str, Any]) -> None:
        progress = self.progress
        result = self.validate()
        progress.validations.append(result)
        logger.info("step %d: valid nll %.3f, greedy BLEU %.2f, chrF %.2f", progress.step, result["valid_nll"], result["bleu"], result["chrf"])
        if result["bleu"] > progress.best_bleu:
            progress.best_bleu = result["bleu"]
            # Best weights are what ships: float16 halves the committed size; last/ keeps float32 for exact resume.
            save_weights(self.model, self.out, half=True)
            record["best"] = result
        now = time.monotonic()
        progress.wall_seconds += now - self.wall_mark
        self.wall_mark = now
        progress.checkpoint_minutes.append({"step": progress.step, "train_minutes": round(progress.train_seconds / 60, 2),
                                            "wall_minutes": round(progress.wall_seconds / 60, 2)})  # fmt: skip
        self.save_last()
        if self.settings.keep_snapshots > 0:
            self.save_snapshot()
        seconds = max(progress.train_seconds, 1e-9)
        record.update(
            steps=progress.step,
            epochs=round(progress.epoch + progress.batch_in_epoch / max(len(self.epoch_batches(progress.epoch)), 1), 3),
            target_tokens=progress.tgt_tokens,
            train_minutes=round(seconds / 60, 2),
            wall_minutes=round(progress.wall_seconds / 60, 2),
            target_tokens_per_second=round(progress.tgt_tokens / seconds, 1),
            loss_curve=progress.loss_curve,
            validations=progress.validations,
            checkpoint_minutes=progress.checkpoint_minutes,
        )
        self.update_leg(record)
        save_train_info(record, self.out)


def build_parser() -> argparse.ArgumentParser:
    defaults = TrainSettings()
    parser = argparse.ArgumentParser(prog="nmt-train", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--train", type=Path, required=True, help="TSV of German<TAB>English training pairs")
    parser.add_argument("--valid", type=Path, required=True, help="TSV of validation pairs")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint dir (best weights; last/ holds resume state)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/last exactly, or without it from the best weights in OUT")
    parser.add_argument("--init-from", type=Path,
                        help="checkpoint dir whose weights, config and tokenizer a new run starts from (fine-tuning on another corpus)")  # fmt: skip
    parser.add_argument("--encoder-layers", type=int, default=0,
                        help="with --init-from: encoder layers of the new model (more than the source's: the added ones copy trained layers)")
    parser.add_argument("--stack-order", choices=STACK_ORDERS, default="cycle",
                        help="which trained layer each grown encoder layer copies: cycle 0,1,2,0,1,2; repeat 0,0,1,1,2,2")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto", help="auto = CUDA when torch sees a GPU, else CPU")
    for item in dataclasses.fields(TrainSettings):
        flag = "--" + item.name.replace("_", "-")
        if item.name == "bf16":  # its default depends on the device, known only once --device is read
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help="autocast to bfloat16 (default: where the device computes it natively)")  # fmt: skip
        elif item.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=getattr(defaults, item.name))
        else:
            parser.add_argument(flag, type=type(getattr(defaults, item.name)), default=item.default)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        device = pick_device(args.device)
    except ValueError as error:
        parser.error(str(error))
    if device.type == "cpu":  # before the first matmul and the corpus: both bounds apply from then on
        logger.info("CPU memory bounds: oneDNN kernel cache %s, mmap threshold %s bytes", bound_kernel_cache(), bound_heap() or "unchanged")
    if args.bf16 is None:
        args.bf16 = bf16_is_native(device)
    settings = TrainSettings(**{item.name: getattr(args, item.name) for item in dataclasses.fields(TrainSettings)})
    if args.threads:
        torch.set_num_threads(args.threads)
    if not settings.max_steps and not settings.max_minutes:
        raise SystemExit("nmt-train: give --max-steps or --max-minutes")
    if settings.cooldown_steps and not settings.max_steps:
        parser.error("--cooldown-steps needs --max-steps (the step the learning rate reaches 0)")
    if settings.accumulate < 1:
        parser.error(f"--accumulate: batches per optimizer step must be at least 1, got {settings.accumulate}")
    torch.manual_seed(settings.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    train_pairs, valid_pairs = read_tsv(args.train), read_tsv(args.valid)
    exact = (args.out / LAST_DIR / TRAINER_STATE_FILE).is_file()
    initialize = args.init_from is not None and not (args.resume and exact)
    if initialize:
        if args.resume:
            parser.error("--init-from starts a new run; --resume without OUT/last/ would restart from OUT's own weights")
        # The weights come with their tokenizer: the ids must mean what they meant in the source run.
        shutil.copyfile(args.init_from / TOKENIZER_FILE, args.out / TOKENIZER_FILE)
    tokenizer = load_or_train_tokenizer(args.out, train_pairs, PRESETS[args.preset].vocab_size)
    config = dataclasses.replace(PRESETS[args.preset], vocab_size=tokenizer.vocab_size)
    if args.resume or initialize:
        config = ModelConfig.load(args.init_from / "config.json" if initialize else args.out / (LAST_DIR if exact else "") / "config.json")
    if args.encoder_layers:
        if not initialize:
            parser.error("--encoder-layers grows the model of --init-from; a resumed run keeps its own layers")
        try:  # the growth's own rule (layers are only added), then the config's
            source_layer_order(config.n_encoder_layers, args.encoder_layers, args.stack_order)
            config = dataclasses.replace(config, n_encoder_layers=args.encoder_layers)
        except ValueError as error:
            parser.error(f"--encoder-layers: {error}")
    if settings.dropout >= 0.0:
        # Dropout changes training only; the exported graphs never see it.
        try:
            config = dataclasses.replace(config, dropout=settings.dropout)
        except ValueError as error:
            parser.error(f"--dropout: {error}")
    trainer = Trainer(Transformer(config), tokenizer, train_pairs, valid_pairs, args.out, settings, device)
    record = load_train_info(args.out) if args.resume else {}
    if args.resume and exact:
        trainer.load_last()
    elif args.resume:
        trainer.restart_from_best(record)
    elif initialize:
        record["initialized_from"] = trainer.initialize_from(args.init_from, args.stack_order)
    record.update(
        preset=args.preset,
        config=config.to_dict(),
        settings=dataclasses.asdict(settings),
        corpus={"train": str(args.train), "valid": str(args.valid), "train_pairs": len(trainer.train_ids), "valid_pairs": len(valid_pairs)},
        threads=torch.get_num_threads(),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    )
    logger.info("%d training pairs, %.1fM parameters, on %s (bf16 %s)", len(trainer.train_ids),
                sum(p.numel() for p in trainer.model.parameters()) / 1e6, record["device"], "on" if settings.bf16 else "off")  # fmt: skip
    trainer.run(record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
