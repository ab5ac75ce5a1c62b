"""nmt-build-kernels: compile the native attention kernels (runtime/kernels/*.cc) into the library the runtime loads.

They need ONNX Runtime's C API headers, which its Python wheels do not ship: --include names a directory holding
them, else ORT_INCLUDE_DIR, headers fetched before (runtime/kernels/ort-headers) or /usr/include/onnxruntime are used;
--download-headers fetches Debian's libonnxruntime-dev package (headers only, checked against the archive's SHA-256)
into runtime/kernels/ort-headers first. The library does not link against ONNX Runtime (the API table comes from
the session), so headers of an API version at most the installed onnxruntime's serve.
It first compiles the engine's host work in C (runtime/build_extensions.py), which needs no ONNX Runtime headers.

Exit status: 0 built, 1 the compiler failed, 2 no usable headers or compiler (the message says what to do).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import logging
import lzma
import os
import re
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from importlib.metadata import version
from pathlib import Path

from nmt_serve.runtime.build_extensions import build_extensions, compile_into
from nmt_serve.runtime.native_kernels import DEFAULT_LIBRARY, KERNELS_DIR

logger = logging.getLogger(__name__)

SOURCES = ("cross_attention.cc", "grouped_cross_attention.cc", "self_attention.cc", "row_quantize.cc", "quantized_matmul.cc",
           "float_matmul.cc", "candidate_top_k.cc", "packed_self_attention.cc", "head_layout.cc", "decoder_embedding.cc",
           "decoder_lengths.cc", "register.cc")
HEADER = "onnxruntime_cxx_api.h"
FETCHED_HEADERS = KERNELS_DIR / "ort-headers"
SYSTEM_HEADERS = Path("/usr/include/onnxruntime")
DEBIAN_MIRROR = "https://deb.debian.org/debian"
DEBIAN_SUITES = ("trixie", "sid")  # the first whose index has the package; its headers' API version is checked below
DEBIAN_PACKAGE = "libonnxruntime-dev"
# AVX2 + FMA: what every x86-64 CPU this project supports has; no -march=native, so a library built on one machine
# runs on another of that class.
COMPILE_FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-std=c++17", "-Wall", "-Wextra")


class BuildError(RuntimeError):
    """What stops the build, with what to do about it; `status` is the command's exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def find_headers(include: Path | None) -> Path:
    """The first directory holding ONNX Runtime's C++ API header: --include, ORT_INCLUDE_DIR, fetched, system."""
    candidates = [include] if include else []
    if os.environ.get("ORT_INCLUDE_DIR"):
        candidates.append(Path(os.environ["ORT_INCLUDE_DIR"]))
    candidates += [FETCHED_HEADERS, SYSTEM_HEADERS]
    for candidate in candidates:
        if (candidate / HEADER).is_file():
            return candidate
    raise BuildError(f"no {HEADER} in {', '.join(str(c) for c in candidates)}: pass --download-headers (fetches Debian's "
                     f"{DEBIAN_PACKAGE}), or --include DIR with ONNX Runtime's include directory", 2)  # fmt: skip


def header_api_version(include: Path) -> int:
    text = (include / "onnxruntime_c_api.h").read_text(encoding="utf-8", errors="replace")
    found = re.search(r"#define ORT_API_VERSION (\d+)", text)
    if not found:
        raise BuildError(f"{include}/onnxruntime_c_api.h defines no ORT_API_VERSION: not ONNX Runtime's header", 2)
    return int(found.group(1))


def runtime_api_version() -> int:
    """The C API version the installed onnxruntime serves: its minor version (1.31.1 serves 1..31)."""
    import onnxruntime

    return int(onnxruntime.__version__.split(".")[1])


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.read()


def package_entry(index: str, package: str) -> dict[str, str]:
    """The Packages-index stanza of `package` as {field: value}; empty when absent."""
    for stanza in index.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith(" "))
        if fields.get("Package") == package:
            return fields
    return {}


def deb_member(deb: bytes, prefix: str) -> tuple[str, bytes]:
    """The first member of a .deb (an `ar` archive) whose name starts with `prefix`."""
    if not deb.startswith(b"!<arch>\n"):
        raise BuildError("the downloaded package is not a Debian archive", 2)
    offset = 8
    while offset + 60 <= len(deb):
        name, size = deb[offset : offset + 16].decode().strip().rstrip("/"), int(deb[offset + 48 : offset + 58].decode().strip())
        if name.startswith(prefix):
            return name, deb[offset + 60 : offset + 60 + size]
        offset += 60 + size + (size % 2)
    raise BuildError(f"the downloaded package has no {prefix}* member", 2)


def download_headers(target: Path = FETCHED_HEADERS) -> Path:
    """Debian's libonnxruntime-dev headers into `target`; returns it."""
    for suite in DEBIAN_SUITES:
        index = lzma.decompress(fetch(f"{DEBIAN_MIRROR}/dists/{suite}/main/binary-amd64/Packages.xz")).decode("utf-8", "replace")
        entry = package_entry(index, DEBIAN_PACKAGE)
        if entry:
            break
    else:
        raise BuildError(f"no {DEBIAN_PACKAGE} in Debian {', '.join(DEBIAN_SUITES)}: pass --include DIR instead", 2)
    deb = fetch(f"{DEBIAN_MIRROR}/{entry['Filename']}")
    if hashlib.sha256(deb).hexdigest() != entry.get("SHA256"):
        raise BuildError(f"{entry['Filename']}: SHA-256 differs from Debian's index; not used", 2)
    name, data = deb_member(deb, "data.tar")
    if name.endswith(".zst"):
        raise BuildError(f"{entry['Filename']} is zstd-compressed, which Python cannot read: pass --include DIR instead", 2)
    staging = Path(tempfile.mkdtemp(prefix="ort-headers-", dir=target.parent))
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        for member in archive.getmembers():
            if member.isfile() and member.name.startswith("./usr/include/onnxruntime/"):
                relative = Path(member.name).relative_to("./usr/include/onnxruntime")
                (staging / relative).parent.mkdir(parents=True, exist_ok=True)
                (staging / relative).write_bytes(archive.extractfile(member).read())  # type: ignore[union-attr]
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    logger.info("ONNX Runtime headers %s (Debian %s) in %s", entry.get("Version", "?"), suite, target)
    return target


def build_library(include: Path, out: Path, compiler: str = "g++") -> Path:
    """Compile the kernels against the headers in `include` into `out` (written whole, then moved into place)."""
    if shutil.which(compiler) is None:
        raise BuildError(f"no C++ compiler {compiler!r}: install one (Debian: apt-get install g++) or pass --cxx", 2)
    headers, runtime = header_api_version(include), runtime_api_version()
    if headers > runtime:
        raise BuildError(f"{include} holds API version {headers} headers; the installed onnxruntime serves up to {runtime}: "
                         "use headers of an older or the same ONNX Runtime", 2)  # fmt: skip
    failure = compile_into([compiler, *COMPILE_FLAGS, f"-I{include}", *(str(KERNELS_DIR / source) for source in SOURCES)], out)
    if failure is not None:
        raise BuildError(failure, 1)
    logger.info("built %s (API version %d headers from %s)", out, headers, include)
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="nmt-build-kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('nmt-serve')}")
    parser.add_argument("--include", type=Path, help="a directory with ONNX Runtime's C and C++ API headers")
    parser.add_argument("--download-headers", action="store_true", help=f"fetch Debian's {DEBIAN_PACKAGE} headers first (network)")
    parser.add_argument("--out", type=Path, default=DEFAULT_LIBRARY, help="where the library goes (default: where the runtime looks)")
    parser.add_argument("--cxx", default=os.environ.get("CXX", "g++"), help="the C++ compiler (default: $CXX, else g++)")
    parser.add_argument("--extensions-out", type=Path,
                        help="a directory for the host work's CPython extensions (default: where the engine imports them)")
    args = parser.parse_args(argv)
    status = 0 if build_extensions(args.cxx, args.extensions_out) else 1  # independent of the library, built either way
    try:
        include = args.include or (download_headers() if args.download_headers else None)
        build_library(find_headers(include), args.out, args.cxx)
    except BuildError as error:
        logger.error("nmt-build-kernels: %s", error)
        return error.status
    except OSError as error:  # the download: no network, a mirror error
        logger.error("nmt-build-kernels: fetching the headers failed (%s): pass --include DIR instead", error)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
