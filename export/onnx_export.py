"""nmt-export: checkpoint dir -> model dir (encoder.onnx, decoder.onnx, tokenizer.json, manifest.json), then parity."""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
import warnings
from collections.abc import Sequence
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

from nmt_serve.model.extras import require_extra

require_extra("nmt-export", "export", ('torch', 'onnx', 'onnxscript', 'sacrebleu'))

import numpy as np
import onnx
import onnxruntime
import torch

from nmt_serve.export.decoder_graph import build_decoder_graph
from nmt_serve.export.exact_halves import store_file_exact_halves
from nmt_serve.export.graphs import ENCODER_INPUTS, EncoderGraph, encoder_output_names, example_encoder_inputs
from nmt_serve.export.int8_cache import CACHE_SCALE_MARGIN, CALIBRATION_SENTENCES, calibrate_cache_scales, calibration_sources, quantize_cache_file
from nmt_serve.export.optimize import DEFAULT_INT8_SCHEME, INT8_SCHEMES, convert_precision
from nmt_serve.export.shared_weights import SHARED_WEIGHTS_FILE, share_weights
from nmt_serve.model.checkpoint import checkpoint_languages, load_checkpoint
from nmt_serve.model.corpus import read_tsv
from nmt_serve.model.languages import LANGUAGES_FILE
from nmt_serve.model.tokenizer import tokenizer_files
from nmt_serve.model.transformer import Transformer
from nmt_serve.runtime.manifest import FORMAT_VERSION, PRECISIONS, GraphSpec, Manifest, TensorSpec, write_manifest
from nmt_serve.runtime.ort_step import OrtStep
from nmt_serve.runtime.self_check import SELF_CHECK_FILE, write_reference

logger = logging.getLogger(__name__)

ENCODER_FILE = "encoder.onnx"
DECODER_FILE = "decoder.onnx"
DEFAULT_OPSET = 23

ONNX_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.INT64: "int64", onnx.TensorProto.BOOL: "bool",
               onnx.TensorProto.INT8: "int8"}


def export_encoder(model: Transformer, path: Path, opset: int) -> None:
    dims = {0: "sources", 1: "src_len"}
    torch.onnx.export(
        EncoderGraph(model), example_encoder_inputs(model), str(path), dynamo=True, opset_version=opset,
        input_names=ENCODER_INPUTS, output_names=encoder_output_names(model.config.n_decoder_layers),
        dynamic_shapes={"src_ids": dims, "src_mask": dims}, external_data=False, verbose=False,
    )  # fmt: skip


def export_decoder(model: Transformer, path: Path, opset: int) -> None:
    """Written node by node with fused attention ops (export/decoder_graph.py says why), not traced."""
    onnx.save(build_decoder_graph(model, opset), str(path))


def tensor_specs(values: Sequence[onnx.ValueInfoProto]) -> tuple[TensorSpec, ...]:
    specs = []
    for value in values:
        tensor_type = value.type.tensor_type
        shape = tuple(dim.dim_param or dim.dim_value for dim in tensor_type.shape.dim)
        specs.append(TensorSpec(value.name, ONNX_DTYPES.get(tensor_type.elem_type, str(tensor_type.elem_type)), shape))
    return tuple(specs)


def graph_spec(path: Path) -> GraphSpec:
    graph = onnx.load(str(path), load_external_data=False).graph
    return GraphSpec(path.name, tensor_specs(graph.input), tensor_specs(graph.output))


def export_graphs(model: Transformer, out: Path, precision: str, opset: int, int8_scheme: str = DEFAULT_INT8_SCHEME,
                  cache_scales: np.ndarray | None = None) -> dict[str, float]:  # fmt: skip
    """Write encoder.onnx and decoder.onnx at `precision`; returns seconds per stage. cache_scales (int8 only,
    export/int8_cache.py): the decoder keeps its self-attention cache in int8 with these scales."""
    timings = {}
    with tempfile.TemporaryDirectory() as tmp:
        fp32_dir = out if precision == "fp32" else Path(tmp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter warns about every un-needed torchvision op
            for name, export in ((ENCODER_FILE, export_encoder), (DECODER_FILE, export_decoder)):
                started = time.perf_counter()
                export(model, fp32_dir / name, opset)
                timings[f"export_{name}"] = round(time.perf_counter() - started, 2)
        for name in (ENCODER_FILE, DECODER_FILE):
            started = time.perf_counter()
            if precision == "fp32":
                store_file_exact_halves(out / name)  # an fp32 dir only: the int8 and fp16 conversions read plain float32
            else:
                convert_precision(fp32_dir / name, out / name, precision, int8_scheme)
            if name == DECODER_FILE and cache_scales is not None:
                quantize_cache_file(out / name, cache_scales, model.config.n_heads, model.config.head_dim)
            timings[f"{precision}_{name}"] = round(time.perf_counter() - started, 2)
            onnx.checker.check_model(str(out / name))
    started = time.perf_counter()
    share_weights(out, (ENCODER_FILE, DECODER_FILE))
    timings["share_weights"] = round(time.perf_counter() - started, 2)
    return timings


def export_model_dir(checkpoint_dir: Path, out: Path, precision: str, name: str, version: str, check_texts: Sequence[str],
                     opset: int = DEFAULT_OPSET, int8_scheme: str = DEFAULT_INT8_SCHEME, cache_calibration: Path | None = None) -> Manifest:  # fmt: skip
    """The export pipeline: load, export, convert precision, check, write manifest and the host self-check's
    reference (`check_texts`: its source sentences). Parity is separate. cache_calibration: a TSV of sentence
    pairs (or sources); an int8 dir then keeps its self-attention cache in int8, scaled on what the model caches
    while it translates the first CALIBRATION_SENTENCES of them."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if cache_calibration is not None and precision != "int8":
        raise ValueError(f"--cache-calibration is for --precision int8 (the {precision} cache stays float), got {precision}")
    checkpoint = load_checkpoint(checkpoint_dir)
    out.mkdir(parents=True, exist_ok=True)
    cache: dict[str, Any] = {}
    scales = None
    if cache_calibration is not None:
        sources = calibration_sources(cache_calibration, checkpoint.tokenizer)
        scales = calibrate_cache_scales(checkpoint.model, sources)
        cache = {"int8_cache": {"calibration": str(cache_calibration), "sentences": len(sources), "margin": CACHE_SCALE_MARGIN}}
    elif precision == "int8":
        logger.info("int8 without --cache-calibration: the self-attention cache stays float32")
    timings = export_graphs(checkpoint.model, out, precision, opset, int8_scheme, scales)
    # A multilingual model's languages.json travels with its tokenizer: requests name languages through it.
    tokenizers = [*tokenizer_files(checkpoint_dir), *([LANGUAGES_FILE] if (checkpoint_dir / LANGUAGES_FILE).is_file() else [])]
    for file_name in tokenizers:
        shutil.copyfile(checkpoint_dir / file_name, out / file_name)
    source_language, target_language = checkpoint_languages(checkpoint_dir)
    manifest = Manifest(
        format_version=FORMAT_VERSION, model_name=name, model_version=version, source_language=source_language, target_language=target_language,
        config=checkpoint.config, precision=precision, opset=opset,
        graphs={"encoder": graph_spec(out / ENCODER_FILE), "decoder": graph_spec(out / DECODER_FILE)},
        files={}, parity={},
        created_by={"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
                    "checkpoint": str(checkpoint_dir), "export_seconds": timings, **({"int8_scheme": int8_scheme} if precision == "int8" else {}), **cache},
    )  # fmt: skip
    files = [ENCODER_FILE, DECODER_FILE, *graph_data_files(out), *tokenizers]
    manifest = write_manifest(out, manifest, files)
    step = OrtStep(out)
    write_reference(out, step.encode, step, step.cache, checkpoint.config, precision, checkpoint.tokenizer.encode_batch(list(check_texts)))
    manifest = write_manifest(out, manifest, [*files, SELF_CHECK_FILE])
    logger.info("exported %s (%s) in %.1f s: %s", out, precision, sum(timings.values()), file_sizes(out))
    return manifest


def graph_data_files(directory: Path) -> list[str]:
    """The weights file the graphs share, where they share one: hashed in the manifest like the graphs."""
    return [SHARED_WEIGHTS_FILE] if (directory / SHARED_WEIGHTS_FILE).is_file() else []


def file_sizes(directory: Path) -> dict[str, str]:
    return {path.name: f"{path.stat().st_size / 1e6:.1f} MB" for path in sorted(directory.iterdir()) if path.is_file()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt-export", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version('nmt-serve')}")
    parser.add_argument("checkpoint", type=Path, help="checkpoint dir (config.json, model.safetensors, tokenizer.json)")
    parser.add_argument("--out", type=Path, required=True, help="model dir to write")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--name", default="", help="model name in the manifest (default: the checkpoint dir's name)")
    parser.add_argument("--model-version", default="", help="model version in the manifest (default: the best validation step from train.json)")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    parser.add_argument("--int8-scheme", choices=INT8_SCHEMES, default=DEFAULT_INT8_SCHEME,
                        help="with --precision int8: how to quantize (export/optimize.py; u8s8-rows keeps answers independent of the batch)")
    parser.add_argument("--cache-calibration", type=Path,
                        help="with --precision int8: a TSV of source sentences or pairs (not the test set); the decoder then keeps its "
                             f"self-attention cache in int8, scaled on what the model caches translating the first {CALIBRATION_SENTENCES} "
                             "(export/int8_cache.py)")
    parser.add_argument("--parity-test", type=Path, help="TSV for token/text parity (default: tensor parity only)")
    parser.add_argument("--parity-limit", type=int, default=0, help="only the first N test pairs (0 = all)")
    parser.add_argument("--no-parity", action="store_true", help="skip parity (the manifest then says so)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from nmt_serve.export.parity import random_pairs, run_parity  # imported late: parity pulls in sacrebleu

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    info: dict[str, Any] = load_checkpoint(args.checkpoint).train_info
    name = args.name or args.checkpoint.resolve().name
    # The weights are the best validation step's, not the run's last step.
    version = args.model_version or f"step-{info.get('best', {}).get('step', info.get('steps', 0))}"
    pairs = read_tsv(str(args.parity_test)) if args.parity_test else random_pairs(32)
    export_model_dir(args.checkpoint, args.out, args.precision, name, version, [source for source, _ in pairs], args.opset, args.int8_scheme,
                     args.cache_calibration)
    if not args.no_parity:
        run_parity(args.out, args.checkpoint, args.parity_test, args.parity_limit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
