"""nmt-train and nmt-eval on the tiny preset: checkpoint contents, exact resume, eval reproduces train.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from nmt_serve.model.batching import make_batch, plan_batches
from nmt_serve.model.checkpoint import load_checkpoint
from nmt_serve.model.device import native_bf16, pick_device
from nmt_serve.model.evaluate import main as eval_main
from nmt_serve.model.grow import source_layer_order
from nmt_serve.model.train import TrainSettings, learning_rate
from nmt_serve.model.train import main as train_main


def train_args(corpus: dict[str, Path], out: Path, max_steps: int) -> list[str]:
    return ["--train", str(corpus["train"]), "--valid", str(corpus["valid"]), "--out", str(out), "--preset", "tiny",
            "--max-steps", str(max_steps), "--eval-every", "6", "--log-every", "1", "--max-tokens", "300",
            "--warmup-steps", "4", "--valid-bleu-size", "5"]  # fmt: skip


def test_plan_batches_respects_token_budget_and_covers_every_pair() -> None:
    rng = np.random.default_rng(0)
    lengths = [(int(a), int(b)) for a, b in rng.integers(1, 30, size=(200, 2))]
    batches = plan_batches(lengths, max_tokens=120, rng=np.random.default_rng(1))
    assert sorted(np.concatenate(batches).tolist()) == list(range(200))
    for batch in batches:
        longest = max(max(lengths[i]) + 1 for i in batch)
        assert len(batch) == 1 or len(batch) * longest <= 120


def test_make_batch_adds_bos_eos_and_padding() -> None:
    batch = make_batch([([5, 6], [7]), ([8], [9, 10, 11])])
    assert batch.src_ids.tolist() == [[5, 6, 2], [8, 2, 0]]
    assert batch.tgt_in.tolist() == [[1, 7, 0, 0], [1, 9, 10, 11]]
    assert batch.tgt_out.tolist() == [[7, 2, 0, 0], [9, 10, 11, 2]]
    assert batch.n_tgt_tokens == 6


def test_learning_rate_warms_up_then_decays_as_inverse_sqrt() -> None:
    settings = TrainSettings(peak_lr=1e-3, warmup_steps=100)
    assert learning_rate(50, settings) == pytest.approx(5e-4)
    assert learning_rate(100, settings) == pytest.approx(1e-3)
    assert learning_rate(400, settings) == pytest.approx(5e-4)


def test_learning_rate_cools_down_linearly_over_the_last_steps() -> None:
    settings = TrainSettings(peak_lr=1e-3, warmup_steps=100, max_steps=1000, cooldown_steps=200)
    plain = TrainSettings(peak_lr=1e-3, warmup_steps=100)
    assert learning_rate(800, settings) == pytest.approx(learning_rate(800, plain))  # before the cool-down
    assert learning_rate(901, settings) == pytest.approx(learning_rate(901, plain) * 100 / 200)
    assert learning_rate(1000, settings) == pytest.approx(learning_rate(1000, plain) / 200)  # the last step still moves
    assert learning_rate(1001, settings) == 0.0


def test_train_cooldown_needs_a_step_limit(tiny_corpus: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [*train_args(tiny_corpus, tmp_path, 0), "--max-minutes", "1", "--cooldown-steps", "5"]
    with pytest.raises(SystemExit):
        train_main(args)
    assert "--cooldown-steps needs --max-steps" in capsys.readouterr().err


def test_train_writes_checkpoint_dir(tiny_checkpoint: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "train.json", "last/trainer_state.pt"):
        assert (tiny_checkpoint / name).is_file(), name
    info = json.loads((tiny_checkpoint / "train.json").read_text())
    assert info["steps"] == 20
    assert [v["step"] for v in info["validations"]] == [10, 20]
    assert {"bleu", "chrf", "valid_nll"} <= set(info["best"])
    checkpoint = load_checkpoint(tiny_checkpoint)
    assert checkpoint.config.vocab_size == checkpoint.tokenizer.vocab_size


def test_train_records_the_device_it_ran_on(tiny_checkpoint: Path) -> None:
    info = json.loads((tiny_checkpoint / "train.json").read_text())
    assert info["device"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")


def test_pick_device_takes_the_gpu_only_when_torch_sees_one() -> None:
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        pick_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here: --device cuda is no error")
def test_train_on_cuda_without_a_gpu_is_refused_not_run_on_the_cpu(tiny_corpus: dict[str, Path], tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        train_main([*train_args(tiny_corpus, tmp_path / "run", 2), "--device", "cuda"])
    assert stopped.value.code == 2
    assert "device cuda: torch sees no CUDA GPU here" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_train_loss_decreases(tiny_checkpoint: Path) -> None:
    curve = json.loads((tiny_checkpoint / "train.json").read_text())["loss_curve"]
    assert curve[-1][1] < curve[0][1]


def test_train_resume_continues_the_same_loss_curve(tiny_corpus: dict[str, Path], tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train_main(train_args(tiny_corpus, straight, 12)) == 0
    assert train_main(train_args(tiny_corpus, resumed, 6)) == 0
    assert train_main([*train_args(tiny_corpus, resumed, 12), "--resume"]) == 0
    straight_info = json.loads((straight / "train.json").read_text())
    resumed_info = json.loads((resumed / "train.json").read_text())
    assert len(straight_info["loss_curve"]) == 12
    # Same batches, same dropout masks, same optimizer state: the curves are identical, not just close.
    assert resumed_info["loss_curve"] == straight_info["loss_curve"]
    assert resumed_info["validations"] == straight_info["validations"]


def test_each_run_of_a_resumed_training_is_recorded_as_a_leg(tiny_corpus: dict[str, Path], tmp_path: Path) -> None:
    assert train_main(train_args(tiny_corpus, tmp_path, 6)) == 0
    assert train_main([*train_args(tiny_corpus, tmp_path, 12), "--resume"]) == 0
    legs = json.loads((tmp_path / "train.json").read_text())["legs"]
    assert [(leg["start_step"], leg["end_step"]) for leg in legs] == [(0, 6), (6, 12)]
    assert legs[1]["start_target_tokens"] > 0
    for leg in legs:
        assert leg["peak_rss_mb"] > 0 and leg["target_tokens_per_second"] > 0 and leg["cpu"]


def test_train_requires_a_limit(tiny_corpus: dict[str, Path], tmp_path: Path) -> None:
    args = train_args(tiny_corpus, tmp_path, 0)
    with pytest.raises(SystemExit, match="--max-steps or --max-minutes"):
        train_main(args)


def test_eval_reproduces_the_validation_bleu(tiny_checkpoint: Path, tiny_corpus: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    best = json.loads((tiny_checkpoint / "train.json").read_text())["best"]
    output = tiny_checkpoint / "hyps.txt"
    args = [str(tiny_checkpoint), "--test", str(tiny_corpus["valid"]), "--beam", "1", "--limit", "10", "--output", str(output), "--record"]
    assert eval_main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads((tiny_checkpoint / "train.json").read_text())["test"]["greedy"] == result
    assert result["bleu"] == pytest.approx(best["bleu"], abs=0.1)
    assert result["chrf"] == pytest.approx(best["chrf"], abs=0.1)
    assert len(output.read_text().splitlines()) == 10


def test_eval_nll_reproduces_the_validation_nll(tiny_checkpoint: Path, tiny_corpus: dict[str, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """--nll scores the references teacher-forced, as nmt-train's validation does (weights stored in float16 since)."""
    best = json.loads((tiny_checkpoint / "train.json").read_text())["best"]
    args = [str(tiny_checkpoint), "--test", str(tiny_corpus["valid"]), "--beam", "1", "--nll", "--output", str(tmp_path / "hyps.txt")]
    assert eval_main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["nll"] == pytest.approx(best["valid_nll"], abs=0.01)
    assert eval_main(args[:-3] + ["--output", str(tmp_path / "hyps.txt")]) == 0
    assert "nll" not in json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_best_weights_ship_in_float16_and_load_as_float32(tiny_checkpoint: Path) -> None:
    stored = load_file(str(tiny_checkpoint / "model.safetensors"))
    assert {tensor.dtype for tensor in stored.values() if tensor.is_floating_point()} == {torch.float16}
    model = load_checkpoint(tiny_checkpoint).model
    for name, parameter in model.state_dict().items():
        assert parameter.dtype == torch.float32 and torch.equal(parameter, stored[name].float()), name


def test_train_restarts_from_the_best_weights_without_resume_state(tiny_corpus: dict[str, Path], tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """A fresh machine has only the shipped checkpoint: --resume continues from its best step with a fresh optimizer."""
    import shutil

    out = tmp_path / "run"
    assert train_main(train_args(tiny_corpus, out, 6)) == 0
    shutil.rmtree(out / "last")
    best_step = json.loads((out / "train.json").read_text())["best"]["step"]
    assert train_main([*train_args(tiny_corpus, out, best_step + 4), "--resume", "--rewarmup-steps", "4", "--keep-snapshots", "2"]) == 0
    assert f"restarting from the best weights at step {best_step}" in caplog.text
    info = json.loads((out / "train.json").read_text())
    assert info["steps"] == best_step + 4
    curve = info["loss_curve"]
    assert [point[0] for point in curve] == list(range(1, best_step + 5))
    assert curve[best_step][1] < curve[0][1]  # the first step after the restart starts from trained weights
    assert len(list((out / "snapshots").glob("step-*"))) <= 2


def test_train_restart_from_shipped_weights_continues_from_the_last_step(tiny_corpus: dict[str, Path], tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """Shipped weights (an average of the last snapshots) are not the best step's: the run goes on from its last step."""
    import shutil

    out = tmp_path / "run"
    assert train_main(train_args(tiny_corpus, out, 6)) == 0
    shutil.rmtree(out / "last")
    info = json.loads((out / "train.json").read_text())
    info["best"]["step"] = 3
    info["shipped"] = {"version": "step-6-avg2"}
    (out / "train.json").write_text(json.dumps(info))
    assert train_main([*train_args(tiny_corpus, out, 8), "--resume", "--rewarmup-steps", "2"]) == 0
    assert "restarting from the best weights at step 6" in caplog.text
    assert [point[0] for point in json.loads((out / "train.json").read_text())["loss_curve"]] == list(range(1, 9))


def test_restart_scale_ramps_the_learning_rate_back_up() -> None:
    from nmt_serve.model.train import Progress, restart_scale

    settings = TrainSettings(rewarmup_steps=4)
    assert restart_scale(Progress(step=100), settings) == 1.0  # no restart: no ramp
    ramp = [restart_scale(Progress(step=step, restart_step=100), settings) for step in range(100, 106)]
    assert ramp == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_average_of_snapshots_is_their_mean(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from nmt_serve.model.average import main as average_main
    from nmt_serve.model.checkpoint import save_weights

    model = load_checkpoint(tiny_checkpoint).model
    first, second = tmp_path / "a", tmp_path / "b"
    for directory, shift in ((first, 0.0), (second, 0.5)):
        directory.mkdir()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(shift)
        save_weights(model, directory)
    assert average_main([str(tiny_checkpoint), str(first), str(second), "--out", str(tmp_path / "avg")]) == 0
    averaged = load_checkpoint(tmp_path / "avg")
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    for name, tensor in averaged.model.state_dict().items():
        if tensor.is_floating_point():
            torch.testing.assert_close(tensor, ((a[name] + b[name]) / 2).half().float(), rtol=0, atol=0)
    assert averaged.train_info["averaged"] == ["a", "b"]


def test_average_keeps_an_imported_checkpoints_target_tokenizer_and_record(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """An imported checkpoint decodes with target_tokenizer.json: an averaged copy without it would decode wrongly."""
    from nmt_serve.model.average import write_average

    imported = tmp_path / "imported"
    shutil.copytree(tiny_checkpoint, imported, ignore=shutil.ignore_patterns("snapshots"))
    shutil.copyfile(imported / "tokenizer.json", imported / "target_tokenizer.json")
    (imported / "import.json").write_text(json.dumps({"source_language": "de", "target_language": "en"}), encoding="utf-8")
    write_average(imported, [imported], tmp_path / "avg")
    for name in ("config.json", "tokenizer.json", "target_tokenizer.json", "import.json"):
        assert (tmp_path / "avg" / name).read_bytes() == (imported / name).read_bytes(), name


@pytest.mark.parametrize("line, expected", [
    ("flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni", False),  # AVX-512 alone: torch emulates bf16, slower
    ("flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni", True),
    ("flags\t\t: fpu avx512f amx_bf16 amx_tile", True),
    ("Features\t: fp asimd bf16 i8mm", True),  # Arm
])
def test_bf16_defaults_on_only_where_the_cpu_has_it(tmp_path: Path, line: str, expected: bool) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\n{line}\n", encoding="utf-8")
    assert native_bf16(str(cpuinfo)) is expected
    assert native_bf16(str(tmp_path / "missing")) is False


def test_train_dropout_flag_overrides_the_checkpoint_config_on_a_restart(tiny_corpus: dict[str, Path], tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """--dropout replaces the checkpoint config's on a restart, and a bad value is refused naming the flag and the limit."""
    import shutil

    out = tmp_path / "run"
    assert train_main(train_args(tiny_corpus, out, 6)) == 0
    assert load_checkpoint(out).config.dropout == 0.1
    shutil.rmtree(out / "last")
    assert train_main([*train_args(tiny_corpus, out, 10), "--resume", "--rewarmup-steps", "2", "--dropout", "0.3"]) == 0
    info = json.loads((out / "train.json").read_text())
    assert info["config"]["dropout"] == 0.3 and info["settings"]["dropout"] == 0.3
    assert json.loads((out / "last" / "config.json").read_text())["dropout"] == 0.3  # an exact resume keeps it
    with pytest.raises(SystemExit):
        train_main([*train_args(tiny_corpus, out, 12), "--resume", "--dropout", "1.5"])
    assert "--dropout: invalid ModelConfig: dropout must be in [0, 1), got 1.5" in capsys.readouterr().err


def test_init_from_starts_a_new_run_from_another_checkpoints_weights_and_tokenizer(tiny_checkpoint: Path, tiny_corpus: dict[str, Path],
                                                                                   tmp_path: Path) -> None:  # fmt: skip
    """Fine-tuning: step 0 of a new run on the source checkpoint's weights (a zero learning rate keeps them as they were)."""
    out = tmp_path / "tuned"
    assert train_main([*train_args(tiny_corpus, out, 1), "--init-from", str(tiny_checkpoint), "--peak-lr", "0"]) == 0
    assert (out / "tokenizer.json").read_bytes() == (tiny_checkpoint / "tokenizer.json").read_bytes()
    source, tuned = load_file(str(tiny_checkpoint / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert source.keys() == tuned.keys() and all(torch.equal(source[name], tuned[name]) for name in source)
    info = json.loads((out / "train.json").read_text())
    assert info["steps"] == 1 and [point[0] for point in info["loss_curve"]] == [1]
    assert info["initialized_from"]["dir"] == str(tiny_checkpoint)
    assert len(info["initialized_from"]["weights_sha256"]) == 64


@pytest.mark.parametrize("order, copies", [("cycle", [0, 1, 0, 1]), ("repeat", [0, 0, 1, 1])])
def test_init_from_with_more_encoder_layers_copies_trained_layers_in_the_stack_order(tiny_checkpoint: Path, tiny_corpus: dict[str, Path],
                                                                                     tmp_path: Path, order: str, copies: list[int]) -> None:  # fmt: skip
    """A 2-layer encoder grown to 4 (a zero learning rate keeps the copies as they were made); the decoder is untouched."""
    out = tmp_path / "grown"
    args = [*train_args(tiny_corpus, out, 1), "--init-from", str(tiny_checkpoint), "--peak-lr", "0", "--encoder-layers", "4", "--stack-order", order]
    assert train_main(args) == 0
    source, grown = load_file(str(tiny_checkpoint / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for name, tensor in grown.items():
        if name.startswith("encoder_layers."):
            index, suffix = name.split(".", 2)[1:]
            assert torch.equal(tensor, source[f"encoder_layers.{copies[int(index)]}.{suffix}"]), name
        else:
            assert torch.equal(tensor, source[name]), name
    assert {name.split(".")[1] for name in grown if name.startswith("encoder_layers.")} == {"0", "1", "2", "3"}
    info = json.loads((out / "train.json").read_text())
    assert info["config"]["n_encoder_layers"] == 4 and info["config"]["n_decoder_layers"] == 2
    assert info["initialized_from"]["grown"] == {"encoder_layers": [2, 4], "stack_order": order}
    assert load_checkpoint(out).config.n_encoder_layers == 4


def test_stack_orders_name_the_trained_layer_each_new_one_copies() -> None:
    assert source_layer_order(3, 6, "cycle") == [0, 1, 2, 0, 1, 2]
    assert source_layer_order(3, 6, "repeat") == [0, 0, 1, 1, 2, 2]
    assert source_layer_order(3, 5, "repeat") == [0, 0, 1, 1, 2] and source_layer_order(3, 3, "cycle") == [0, 1, 2]
    with pytest.raises(ValueError, match="fewer than the checkpoint's 3"):
        source_layer_order(3, 2, "cycle")
    with pytest.raises(ValueError, match="use one of cycle, repeat"):
        source_layer_order(3, 6, "zigzag")


def test_encoder_layers_without_init_from_is_refused(tiny_corpus: dict[str, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    with pytest.raises(SystemExit):
        train_main([*train_args(tiny_corpus, tmp_path / "run", 1), "--encoder-layers", "4"])
    assert "--encoder-layers grows the model of --init-from" in capsys.readouterr().err


def test_encoder_layers_fewer_than_the_checkpoints_are_refused(tiny_checkpoint: Path, tiny_corpus: dict[str, Path], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    with pytest.raises(SystemExit):
        train_main([*train_args(tiny_corpus, tmp_path / "run", 1), "--init-from", str(tiny_checkpoint), "--encoder-layers", "1"])
    assert "--encoder-layers: encoder layers: 1 is fewer than the checkpoint's 2; layers are only added" in capsys.readouterr().err
    assert not (tmp_path / "run" / "train.json").exists()


def test_init_from_with_resume_of_a_run_without_its_resume_state_is_refused(tiny_checkpoint: Path, tiny_corpus: dict[str, Path],
                                                                            tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    with pytest.raises(SystemExit):
        train_main([*train_args(tiny_corpus, tmp_path / "run", 1), "--init-from", str(tiny_checkpoint), "--resume"])
    assert "--init-from starts a new run" in capsys.readouterr().err


def test_accumulated_gradients_equal_those_of_one_batch_of_their_union() -> None:
    """--accumulate N: one optimizer step over N batches is the step over their union (dropout off, so both see the same function)."""
    import dataclasses

    from nmt_serve.model.config import PRESETS
    from nmt_serve.model.loss import accumulate_gradients
    from nmt_serve.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(PRESETS["tiny"], dropout=0.0))
    rng = np.random.default_rng(3)
    pairs = [(rng.integers(4, 256, rng.integers(1, 12)).tolist(), rng.integers(4, 256, rng.integers(1, 12)).tolist()) for _ in range(12)]

    def gradients(batches: list) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = accumulate_gradients(model, batches, smoothing=0.1)
        return loss, {name: parameter.grad.clone() for name, parameter in model.named_parameters()}

    union_loss, union = gradients([make_batch(pairs)])
    accumulated_loss, accumulated = gradients([make_batch(pairs[:3]), make_batch(pairs[3:8]), make_batch(pairs[8:])])
    assert accumulated_loss == pytest.approx(union_loss, rel=1e-5)
    for name, gradient in union.items():
        torch.testing.assert_close(accumulated[name], gradient, rtol=1e-4, atol=1e-6, msg=name)


def test_train_resume_with_accumulation_and_compile_continues_the_same_loss_curve(tiny_corpus: dict[str, Path], tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Steps of 3 batches cross epoch ends; the compiled loss leaves the checkpoint's tensor names as they are."""
    from nmt_serve.model import train
    from nmt_serve.model.transformer import Transformer

    monkeypatch.setattr(train, "COMPILE_BACKEND", "eager")  # the wiring, without a C++ compile in the test
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    options = ["--accumulate", "3", "--compile", "--no-bf16"]
    assert train_main([*train_args(tiny_corpus, straight, 12), *options]) == 0
    assert train_main([*train_args(tiny_corpus, resumed, 6), *options]) == 0
    assert train_main([*train_args(tiny_corpus, resumed, 12), *options, "--resume"]) == 0
    straight_info = json.loads((straight / "train.json").read_text())
    resumed_info = json.loads((resumed / "train.json").read_text())
    assert straight_info["epochs"] > 1
    assert resumed_info["loss_curve"] == straight_info["loss_curve"]
    assert resumed_info["validations"] == straight_info["validations"]
    assert [leg["accumulate"] for leg in resumed_info["legs"]] == [3, 3] and all(leg["compile"] for leg in resumed_info["legs"])
    assert [times["step"] for times in resumed_info["checkpoint_minutes"]] == [6, 12]
    names = set(Transformer(load_checkpoint(resumed).config).state_dict())
    for directory in (resumed, resumed / "last"):
        assert set(load_file(str(directory / "model.safetensors"))) == names


def test_accumulated_steps_take_n_times_the_batches_of_plain_ones(tiny_corpus: dict[str, Path], tmp_path: Path) -> None:
    assert train_main([*train_args(tiny_corpus, tmp_path / "plain", 4), "--no-bf16"]) == 0
    assert train_main([*train_args(tiny_corpus, tmp_path / "twice", 2), "--no-bf16", "--accumulate", "2"]) == 0
    plain, twice = (json.loads((tmp_path / name / "train.json").read_text()) for name in ("plain", "twice"))
    assert twice["target_tokens"] == plain["target_tokens"] and twice["epochs"] == plain["epochs"]


def test_train_refuses_fewer_than_one_batch_per_step(tiny_corpus: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        train_main([*train_args(tiny_corpus, tmp_path, 2), "--accumulate", "0"])
    assert "--accumulate: batches per optimizer step must be at least 1, got 0" in capsys.readouterr().err


def test_train_speed_leg_and_tables_on_the_tiny_preset(tiny_corpus: dict[str, Path], tmp_path: Path) -> None:
    """nmt-train-speed's pieces: one leg in this process (8 batches of 300 tokens: 4 steps of 4 batches of 150), its table row, and the padding shares."""
    from nmt_serve.bench.train_speed import padding_share, run_leg, speed_table
    from nmt_serve.model.corpus import read_tsv
    from nmt_serve.model.train import load_or_train_tokenizer

    pairs = read_tsv(tiny_corpus["train"])
    tokenizer = load_or_train_tokenizer(tmp_path, pairs, 256)
    spec = {"variant": "accumulate 4 of half batches", "round": 0, "seed": 1, "threads": 1, "preset": "tiny", "max_tokens": 300, "batches": 8,
            "first_steps": 1, "train": str(tiny_corpus["train"]), "work": str(tmp_path)}  # fmt: skip
    leg = run_leg(spec)
    assert leg["steps"] == 4 and leg["target_tokens"] > 0 and leg["tokens_per_s"] > 0 and leg["peak_rss_mb"] > 0
    baseline = {**leg, "variant": "baseline"}
    rows = speed_table([baseline, leg], 300).splitlines()[2:]
    assert [row.split("|")[1].strip() for row in rows] == ["baseline", "accumulate 4 of half batches"]
    assert rows[1].split("|")[2].strip() == "600"  # 4 batches of 150 padded tokens per step
    source, target = padding_share(tokenizer, pairs, 300, 100)
    assert 0.5 < source <= 1.0 and 0.5 < target <= 1.0
