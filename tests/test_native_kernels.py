"""The native attention kernels (runtime/kernels/) against ONNX Runtime's own: each kernel on one-node graphs of the
forms the exporter writes, the fallback for any other form, and the runtime and engine running on them."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmt_serve.runtime.float_matmul_fusion import fusion_pays_here
from nmt_serve.runtime.native_kernels import NativeKernels, NativeKernelsError, resolve_native_kernels
from nmt_serve.runtime.ort_step import make_session
from nmt_serve.server.engine.sessions import Runtime, RuntimeSettings

CPU = ["CPUExecutionProvider"]
ELEMENT_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int8): TensorProto.INT8, np.dtype(np.int32): TensorProto.INT32}


def one_node_model(path: Path, node: onnx.NodeProto, feeds: dict[str, np.ndarray], constants: dict[str, np.ndarray]) -> Path:
    """A model of `node` alone: `feeds` are its graph inputs, `constants` its initializers, every output a graph output."""
    inputs = [helper.make_tensor_value_info(name, ELEMENT_TYPES[value.dtype], value.shape) for name, value in feeds.items()]
    outputs = [helper.make_empty_tensor_value_info(name) for name in node.output]  # types as the node gives them
    initializers = [numpy_helper.from_array(value, name) for name, value in constants.items()]
    graph = helper.make_graph([node], "one_node", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def run_both(path: Path, library: Path, feeds: dict[str, np.ndarray], kernel: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The model through ONNX Runtime's kernels and through the library's; asserts the library's kernel ran."""
    stock = make_session(path, CPU, threads=1).run(None, feeds)
    before = NativeKernels(library).calls()[kernel]
    native = make_session(path, CPU, threads=1, kernels_library=library).run(None, feeds)
    assert NativeKernels(library).calls()[kernel] == before + 1, "ONNX Runtime ran its own kernel, not the library's"
    return stock, native


def cross_attention_feeds(rng: np.random.Generator, sources: int, queries: int, keys: int, heads: int, head_dim: int,
                          mask: str) -> dict[str, np.ndarray]:  # fmt: skip
    """Query (S, Q, H * Dh), key and value (S, H, L, Dh), and a key padding mask: right padding of random length
    (at least one key kept), or random holes anywhere; "repeated queries": every query of a source its first one, as
    the engine fills a source's query slots; "one source all masked": the first source keeps no key."""
    if mask.startswith("right padding"):
        lengths = rng.integers(1, keys + 1, sources)
        keep = (np.arange(keys)[None, :] < lengths[:, None]).astype(np.int32)
    else:
        keep = (rng.random((sources, keys)) < 0.6).astype(np.int32)
        keep[:, rng.integers(0, keys)] = 1
    if mask.endswith("all masked"):
        keep[0] = 0
    query = rng.standard_normal((sources, queries, heads * head_dim), dtype=np.float32)
    if mask.endswith("repeated queries"):
        query[:, 1:] = query[:, :1]
    return {
        "query": query,
        "key": rng.standard_normal((sources, heads, keys, head_dim), dtype=np.float32) * 2,
        "value": rng.standard_normal((sources, heads, keys, head_dim), dtype=np.float32),
        "mask": keep,
    }


@pytest.mark.parametrize(
    ("sources", "queries", "keys", "heads", "head_dim", "mask"),
    [(1, 1, 1, 4, 64, "right padding"), (3, 2, 17, 4, 64, "right padding"), (33, 4, 40, 8, 64, "right padding"),
     (5, 2, 23, 4, 64, "holes"), (4, 3, 9, 2, 16, "right padding"), (4, 2, 12, 2, 24, "holes"),
     (6, 2, 19, 4, 64, "right padding, repeated queries"), (3, 2, 10, 4, 64, "holes, one source all masked")],
)  # fmt: skip
def test_cross_attention_kernel_matches_onnxruntime(native_kernels_library: Path, tmp_path: Path, sources: int, queries: int,
                                                    keys: int, heads: int, head_dim: int, mask: str) -> None:  # fmt: skip
    """MultiHeadAttention over 4-D key and value with a key padding mask: the library's kernel gives ONNX Runtime's
    output within float rounding, for 64-wide heads (the vector path) and others, masks with padding or holes."""
    feeds = cross_attention_feeds(np.random.default_rng(sources * keys), sources, queries, keys, heads, head_dim, mask)
    node = helper.make_node("MultiHeadAttention", ["query", "key", "value", "", "mask"], ["out"], domain="com.microsoft",
                            num_heads=heads, scale=1 / np.sqrt(head_dim))  # fmt: skip
    stock, native = run_both(one_node_model(tmp_path / "cross.onnx", node, feeds, {}), native_kernels_library, feeds, "cross_attention")
    # A source with every key masked: ONNX Runtime adds -10000 to each score, which costs its float32 scores about
    # 1e-3 of their precision; the library attends over the unshifted scores.
    tolerance = 1e-2 if mask.endswith("all masked") else 1e-5
    np.testing.assert_allclose(native[0], stock[0], rtol=tolerance, atol=tolerance)


def self_attention_case(rng: np.random.Generator, rows: int, heads: int, kv_heads: int, capacity: int, head_dim: int,
                        cache: str) -> tuple[onnx.NodeProto, dict[str, np.ndarray], dict[str, np.ndarray]]:  # fmt: skip
    """A GroupQueryAttention node as the exporter writes it (packed QKV, the cache as past, each row's length), its
    feeds (rows at random lengths, random caches) and its constants (an int8 cache's scales)."""
    int8 = cache.startswith("int8")
    feeds = {
        "qkv": rng.standard_normal((rows, 1, (heads + 2 * kv_heads) * head_dim), dtype=np.float32) * 2,
        "past_key": rng.integers(-127, 128, (rows, kv_heads, capacity, head_dim)).astype(np.int8) if int8
        else rng.standard_normal((rows, kv_heads, capacity, head_dim), dtype=np.float32),
        "past_value": rng.integers(-127, 128, (rows, kv_heads, capacity, head_dim)).astype(np.int8) if int8
        else rng.standard_normal((rows, kv_heads, capacity, head_dim), dtype=np.float32),
        "seqlens_k": rng.integers(0, capacity, rows).astype(np.int32),
    }  # fmt: skip
    feeds["total_sequence_length"] = np.array(feeds["seqlens_k"].max() + 1, dtype=np.int32)
    scale_shape = (1, kv_heads, 1, head_dim) if cache == "int8 per channel" else (1,)
    constants = {"key_scale": rng.uniform(0.03, 0.08, scale_shape).astype(np.float32),
                 "value_scale": rng.uniform(0.03, 0.08, scale_shape).astype(np.float32)} if int8 else {}  # fmt: skip
    quantization = {"k_quant_type": "PER_CHANNEL" if cache == "int8 per channel" else "PER_TENSOR", "kv_cache_bit_width": 8}
    node = helper.make_node(
        "GroupQueryAttention", ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total_sequence_length", *([""] * 5),
                                *(["key_scale", "value_scale"] if int8 else [])],
        ["out", "present_key", "present_value"], domain="com.microsoft", num_heads=heads, kv_num_heads=kv_heads, scale=head_dim**-0.5,
        **({**quantization, "v_quant_type": quantization["k_quant_type"]} if int8 else {}),
    )  # fmt: skip
    return node, feeds, constants


@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "capacity", "head_dim", "cache"),
    [(1, 4, 4, 8, 64, "int8 per channel"), (9, 4, 4, 33, 64, "int8 per channel"), (6, 4, 2, 16, 64, "int8 per tensor"),
     (7, 4, 4, 20, 64, "float"), (5, 2, 2, 12, 16, "int8 per channel"), (5, 2, 1, 12, 16, "float")],
)  # fmt: skip
def test_self_attention_kernel_matches_onnxruntime(native_kernels_library: Path, tmp_path: Path, rows: int, heads: int, kv_heads: int,
                                                   capacity: int, head_dim: int, cache: str) -> None:  # fmt: skip
    """GroupQueryAttention over an int8 (per-channel or per-tensor scales) or float cache, grouped heads included: the
    library's kernel gives ONNX Runtime's output within float rounding (sums in another order), leaves the cached rows
    as they were, and stores the new key and value as round(x / scale) clipped to int8 (or as they are in a float cache)."""
    node, feeds, constants = self_attention_case(np.random.default_rng(rows * capacity), rows, heads, kv_heads, capacity, head_dim, cache)
    path = one_node_model(tmp_path / "self.onnx", node, feeds, constants)
    stock, native = run_both(path, native_kernels_library, feeds, "self_attention")
    np.testing.assert_allclose(native[0], stock[0], rtol=1e-5, atol=1e-5)
    rows, positions = np.arange(rows), feeds["seqlens_k"]
    for present, offset, scale in ((1, heads, "key_scale"), (2, heads + kv_heads, "value_scale")):
        for row, position in zip(rows, positions, strict=True):  # the cached rows before the new token: the past's, copied
            past = feeds[("past_key", "past_value")[present - 1]]
            np.testing.assert_array_equal(native[present][row, :, :position], past[row, :, :position])
            np.testing.assert_array_equal(stock[present][row, :, :position], native[present][row, :, :position])
        new = feeds["qkv"][:, 0].reshape(rows.size, heads + 2 * kv_heads, head_dim)[:, offset : offset + kv_heads]
        stored = native[present][rows, :, positions]
        if cache == "float":
            np.testing.assert_array_equal(stored, new)
            np.testing.assert_array_equal(stock[present][rows, :, positions], new)
        else:
            # IEEE float32 division and round half to even give the same bytes on every CPU; ONNX Runtime's own
            # quantization may divide or multiply by the reciprocal (a different x86 kernel per instruction set), which
            # moves a value lying within one ulp of a .5 tie by one step, so it is held to one step.
            by_channel = np.broadcast_to(constants[scale], (1, kv_heads, 1, head_dim)).reshape(kv_heads, head_dim)
            expected = np.clip(np.round(new / by_channel), -128, 127).astype(np.int8)
            np.testing.assert_array_equal(stored, expected)
            assert np.abs(stock[present][rows, :, positions].astype(int) - expected.astype(int)).max() <= 1


@pytest.mark.parametrize("cache", ["int8 per channel", "int8 per tensor", "float"])
def test_self_attention_kernel_reads_prepared_and_per_call_scales_alike(native_kernels_library: Path, tmp_path: Path, cache: str) -> None:
    """The kernel prepares its scales once where the cache's head width is fixed and an int8 cache's scales are constant,
    and reads them per call otherwise (scales fed as inputs, every axis symbolic): the same outputs, bit for bit."""
    node, feeds, constants = self_attention_case(np.random.default_rng(7), 5, 4, 2, 12, 64, cache)
    prepared = one_node_model(tmp_path / "prepared.onnx", node, feeds, constants)
    per_call_feeds = {**feeds, **constants}
    per_call = onnx.load(one_node_model(tmp_path / "per_call.onnx", node, per_call_feeds, {}))
    for value in per_call.graph.input:
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            dim.dim_param = f"{value.name}_{axis}"
    onnx.save(per_call, tmp_path / "per_call.onnx")
    outputs = []
    for path, path_feeds in ((prepared, feeds), (tmp_path / "per_call.onnx", per_call_feeds)):
        before = NativeKernels(native_kernels_library).calls()["self_attention"]
        session = make_session(path, CPU, threads=1, kernels_library=native_kernels_library)
        outputs.append(session.run(None, path_feeds))
        assert NativeKernels(native_kernels_library).calls()["self_attention"] == before + 1
    for prepared_output, per_call_output in zip(*outputs, strict=True):
        np.testing.assert_array_equal(prepared_output, per_call_output)


def test_self_attention_kernel_writes_the_bound_cache_in_place(native_kernels_library: Path, tmp_path: Path) -> None:
    """With the present bound to the past's memory, as the engine binds it, the new key and value land in that buffer and
    the output is the unbound run's."""
    node, feeds, constants = self_attention_case(np.random.default_rng(5), 6, 4, 4, 16, 64, "int8 per channel")
    path = one_node_model(tmp_path / "self.onnx", node, feeds, constants)
    session = make_session(path, CPU, threads=1, kernels_library=native_kernels_library)
    unbound = session.run(None, feeds)
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    out = np.empty_like(unbound[0])
    binding.bind_output("out", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
    for past, present in (("past_key", "present_key"), ("past_value", "present_value")):
        binding.bind_output(present, "cpu", 0, np.int8, list(feeds[past].shape), feeds[past].ctypes.data)
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(out, unbound[0])
    rows = np.arange(6)
    np.testing.assert_array_equal(feeds["past_key"][rows, :, feeds["seqlens_k"]], unbound[1][rows, :, feeds["seqlens_k"]])
    np.testing.assert_array_equal(feeds["past_value"][rows, :, feeds["seqlens_k"]], unbound[2][rows, :, feeds["seqlens_k"]])


def test_a_node_of_another_form_loads_on_onnxruntimes_kernels(native_kernels_library: Path, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """A causal (unidirectional) MultiHeadAttention is not a form the library runs: the kernel refuses it when the
    session is made, and make_session makes it without the library, says so, and gives ONNX Runtime's result."""
    feeds = cross_attention_feeds(np.random.default_rng(0), 2, 2, 5, 4, 64, "right padding")
    node = helper.make_node("MultiHeadAttention", ["query", "key", "value", "", "mask"], ["out"], domain="com.microsoft", num_heads=4,
                            unidirectional=1)  # fmt: skip
    path = one_node_model(tmp_path / "causal.onnx", node, feeds, {})
    with caplog.at_level(logging.WARNING, logger="nmt_serve.runtime.ort_step"):
        session = make_session(path, CPU, threads=1, kernels_library=native_kernels_library)
    assert "not loadable with the native kernels" in caplog.text and "unidirectional=1 is not supported" in caplog.text
    before = NativeKernels(native_kernels_library).calls()
    np.testing.assert_array_equal(session.run(None, feeds)[0], make_session(path, CPU, threads=1).run(None, feeds)[0])
    assert NativeKernels(native_kernels_library).calls() == before


@pytest.mark.parametrize("precision", ["fp32", "int8 with an int8 cache"])
def test_runtime_on_native_kernels_passes_its_self_check(precision: str, native_kernels_library: Path, tiny_model_dir: Path,
                                                         int8_cache_dir: Path) -> None:  # fmt: skip
    """An exported dir on the native kernels: they run the decoder, and the dir's stored reference (exported on ONNX
    Runtime's kernels) holds within its precision's bound, alone and packed bit-identical."""
    model_dir = tiny_model_dir if precision == "fp32" else int8_cache_dir
    runtime = Runtime(model_dir, RuntimeSettings(warmup_rows=4, warmup_src_len=8, native_kernels=str(native_kernels_library)))
    runtime.warm_up()
    # The cross-attention blocks and the candidate search run fused (runtime/native_fusions.py); in int8 each weight
    # product with its row quantization (no RowQuantize node is left alone), in fp32 each weight product with its
    # epilogue (on a CPU with AVX-512) and the encoder's self-attention blocks (an fp32 graph quantizes nothing; an int8 one keeps those blocks
    # and fuses only the layout moves around them).
    quantization = ["quantized_matmul"] if precision != "fp32" else ["float_matmul"] if fusion_pays_here() else []
    encoder = ["packed_self_attention"] if precision == "fp32" else ["head_layout"]
    embedding = ["decoder_embedding"] if precision != "fp32" else []  # an int8 decoder's uint8 tables
    assert runtime.kernels_in_use == ["self_attention", "grouped_cross_attention", *quantization, "candidate_top_k", *encoder, *embedding,
                                      "decoder_lengths"]
    check = runtime.self_check()
    assert check is not None and check.max_log_prob_diff <= check.bound and check.batch_diff == 0.0


def test_resolve_native_kernels_names_what_is_wrong(native_kernels_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """'off' is no library; 'auto' is the built one or none; a path must be a library of these kernels."""
    assert resolve_native_kernels("off") is None
    monkeypatch.setattr("nmt_serve.runtime.native_kernels.DEFAULT_LIBRARY", tmp_path / "absent.so")
    assert resolve_native_kernels("auto") is None
    kernels = resolve_native_kernels(str(native_kernels_library))
    assert kernels is not None
    assert set(kernels.calls()) == {"cross_attention", "self_attention", "grouped_cross_attention", "row_quantization", "quantized_matmul",
                                    "float_matmul", "candidate_top_k", "packed_self_attention", "head_layout", "decoder_embedding",
                                    "decoder_lengths"}
    with pytest.raises(NativeKernelsError, match="absent.so is not a file; build it with `nmt-build-kernels"):
        resolve_native_kernels(str(tmp_path / "absent.so"))
    (tmp_path / "junk.so").write_bytes(b"not a library")
    with pytest.raises(NativeKernelsError, match="not an nmt-serve kernels library"):
        resolve_native_kernels(str(tmp_path / "junk.so"))


def test_build_needs_headers_and_says_where_to_get_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No headers anywhere: nmt-build-kernels exits 2 naming --download-headers and --include; headers of a newer
    ONNX Runtime than the installed one are refused before compiling."""
    from nmt_serve.runtime import build_kernels
    from nmt_serve.runtime.build_extensions import EXTENSIONS, python_headers

    monkeypatch.delenv("ORT_INCLUDE_DIR", raising=False)
    monkeypatch.setattr(build_kernels, "FETCHED_HEADERS", tmp_path / "fetched")
    monkeypatch.setattr(build_kernels, "SYSTEM_HEADERS", tmp_path / "system")
    with pytest.raises(build_kernels.BuildError, match="pass --download-headers") as refused:
        build_kernels.find_headers(None)
    assert refused.value.status == 2
    assert build_kernels.main(["--include", str(tmp_path / "empty"), "--out", str(tmp_path / "lib.so"),
                               "--extensions-out", str(tmp_path)]) == 2  # fmt: skip
    # the host work's extensions need no ONNX Runtime headers: built all the same wherever this Python has its own
    for extension in EXTENSIONS:
        assert (tmp_path / extension.module.name).is_file() == (python_headers() is not None)
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "onnxruntime_cxx_api.h").write_text("")
    (newer / "onnxruntime_c_api.h").write_text(f"#define ORT_API_VERSION {build_kernels.runtime_api_version() + 1}\n")
    with pytest.raises(build_kernels.BuildError, match="the installed onnxruntime serves up to"):
        build_kernels.build_library(newer, tmp_path / "lib.so")
    assert not (tmp_path / "lib.so").exists()


def test_debian_package_parts_are_read_from_the_archive_formats() -> None:
    """The Packages index stanza of a package, and a member of a .deb (an ar archive), as the header download reads them."""
    from nmt_serve.runtime.build_kernels import BuildError, deb_member, package_entry

    index = "Package: other\nVersion: 1\n\nPackage: libonnxruntime-dev\nVersion: 1.21.0\nFilename: pool/l/x.deb\nSHA256: ab\n"
    assert package_entry(index, "libonnxruntime-dev") == {"Package": "libonnxruntime-dev", "Version": "1.21.0",
                                                          "Filename": "pool/l/x.deb", "SHA256": "ab"}  # fmt: skip
    assert package_entry(index, "absent") == {}
    members = [(b"debian-binary", b"2.0\n"), (b"control.tar.xz", b"abc"), (b"data.tar.xz", b"payload")]
    deb = b"!<arch>\n" + b"".join(name.ljust(16) + b"0".ljust(32) + str(len(data)).encode().ljust(10) + b"`\n" + data
                                  + (b"\n" if len(data) % 2 else b"") for name, data in members)  # fmt: skip
    assert deb_member(deb, "data.tar") == ("data.tar.xz", b"payload")
    with pytest.raises(BuildError, match="not a Debian archive"):
        deb_member(b"PK\x03\x04", "data.tar")


def test_kernels_give_the_same_bits_on_more_threads(native_kernels_library: Path, tmp_path: Path) -> None:
    """The kernels share their (source, head) and (row, head) pairs out over ONNX Runtime's intra-op threads: each pair
    is computed the same whichever thread takes it, so two threads give one thread's output bit for bit."""
    feeds = cross_attention_feeds(np.random.default_rng(3), 17, 2, 21, 4, 64, "holes")
    node = helper.make_node("MultiHeadAttention", ["query", "key", "value", "", "mask"], ["out"], domain="com.microsoft", num_heads=4)
    cross = one_node_model(tmp_path / "cross.onnx", node, feeds, {})
    node, self_feeds, constants = self_attention_case(np.random.default_rng(4), 13, 4, 4, 24, 64, "int8 per channel")
    self_path = one_node_model(tmp_path / "self.onnx", node, self_feeds, constants)
    for path, inputs in ((cross, feeds), (self_path, self_feeds)):
        one, two = (make_session(path, CPU, threads=threads, kernels_library=native_kernels_library).run(None, inputs)
                    for threads in (1, 2))  # fmt: skip
        for single, double in zip(one, two, strict=True):
            np.testing.assert_array_equal(single, double)
