"""The second packed list of the GPU check: vLLM 0.24 (verl 0.9.1's pin, constraints-gpu.txt) and
what it adds to the first list (bench/gpu_wheels.py, the project's own set), so that vLLM's
first-contact imports (openai_harmony, msgspec, fastapi below vLLM's cap, ...) travel too.

The list is read from vLLM 0.24.0's own metadata: every `Requires-Dist` of the wheel (no
extras, markers for the device's Python on Linux x86_64) is packed, left to the device image
(`gpu_wheels.DEVICE_VERSIONS`), or left out for a reason in `LEFT_OUT` (GPU kernel libraries
behind import guards or another backend's path, hundreds of MB: flashinfer-cubin alone is
447 MB). The kept ones are resolved for the device by pip (CPython 3.12, manylinux x86_64),
pinned to the first list's versions and the image's, with the image's distributions standing
in as empty wheels (so torch's CUDA requirements are not fetched). What the first list does
not already hold at that version is this list; `vllm==0.24.0` itself is installed --no-deps,
stripped of what `STRIP` names (import-guarded extensions the check never loads).

    python bench/gpu_vllm_wheels.py resolve METADATA BASE_REQUIREMENTS > requirements-vllm.txt
    python bench/gpu_vllm_wheels.py strip VLLM_WHEEL DEST_DIR          # the stripped copy
    python bench/gpu_vllm_wheels.py part-size TREE_BYTES               # bytes of one part
    python bench/gpu_vllm_wheels.py kept METADATA                      # the requirements kept
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterable, Mapping



def _beside(name: str):
    """A script beside this one (bench/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_wheels = _beside("gpu_wheels")

VLLM = "vllm==0.24.0"

# vLLM 0.24.0's requirements that do not travel, each for a reason read from its source (the
# wheel's vllm/ tree; tests/bench/test_gpu_vllm_wheels.py keeps every Requires-Dist accounted for).
LEFT_OUT = {
    # FlashInfer: imported by vllm/v1/attention/backends/flashinfer.py (not chosen on Hopper, where
    # FLASH_ATTN with FA3 is the default for Qwen2) and by the top-p/top-k sampler unless
    # VLLM_USE_FLASHINFER_SAMPLER=0 (vllm/v1/sample/ops/topk_topp_sampler.py: with the variable
    # unset it imports FlashInferBackend and raises ImportError without flashinfer; with it 0 it
    # returns False before the import). gpu_check.sh sets it to 0. flashinfer-cubin is 447 MB.
    "flashinfer-python": "FlashInfer attention/sampler; off with VLLM_USE_FLASHINFER_SAMPLER=0",
    "flashinfer-cubin": "FlashInfer's kernels (447 MB); off with VLLM_USE_FLASHINFER_SAMPLER=0",
    "apache-tvm-ffi": "FlashInfer's and FA4 (cute)'s FFI; the first list packs xgrammar's version",
    # CuTe-DSL / TileLang kernels: imported inside functions of the MLA, FP8/FP4 MoE, mamba and
    # FA4 (vllm_flash_attn/cute) paths, none of which a bf16 Qwen2 on Hopper takes
    "tilelang": "TileLang kernels (sparse MLA, imported inside functions)",
    "nvidia-cutlass-dsl": "CuTe-DSL (FA4 on Blackwell, cute_utils), imported inside functions",
    "quack-kernels": "CuTe-DSL kernels (FA4 backward, GDN mamba), never on a Qwen2 path",
    "tokenspeed-mla": "MLA decode kernels (DeepSeek-style attention), imported inside functions",
    "humming-kernels": "quantised GEMM kernels, imported inside functions",
    "nvidia-cudnn-frontend": "cuDNN prefill for MLA (FlashInfer), imported inside functions",
    "fastsafetensors": "load_format=fastsafetensors only (guarded import in weight_utils)",
    # numba: vllm/v1/spec_decode/ngram_proposer.py alone (n-gram speculative decoding, imported
    # inside functions of gpu_model_runner); vLLM pins numba==0.65.0, which needs numpy<2.5,
    # and the device's numpy is 2.5.2 (the image has a numba of its own)
    "numba": "n-gram speculative decoding only; 0.65.0 needs numpy<2.5, the device has 2.5.2",
    # Mistral's tokenizer and tool parser (vllm/tokenizers/mistral.py,
    # vllm/tool_parsers/mistral_tool_parser.py): not imported for a Qwen2 model; every release
    # caps numpy<2.4 on Python 3.12
    "mistral-common": "Mistral tokenizer/tool parser only; caps numpy<2.4 on Python 3.12",
    # OpenCV: vllm/multimodal/video.py (guarded); the device image has opencv-python-headless
    "opencv-python-headless": "video inputs only (guarded import); the device image has it",
}

# parts of the vLLM wheel left out of the stripped copy: (path in the wheel, why it is never loaded)
STRIP = {
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "FlashAttention 2 (pre-Hopper); Hopper loads _vllm_fa3_C",
    "vllm/_moe_C_stable_libtorch.abi3.so": "MoE kernels (imported under a guard); Qwen2 is dense",
    "vllm/vllm-rs": "the Rust front end binary (`vllm-rs` serving); verl drives the Python engine",
}

# what travels per device call: the working tree plus the carried part, 64 MiB in all
CALL_LIMIT = 64 * 2**20
MARGIN = 2 * 2**20  # the tree may grow a little between prepare and the calls


def canonical(name: str) -> str:
    return gpu_wheels.canonical(name)


def requires_dist(metadata: str) -> list[str]:
    return [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]


def accounted(metadata: str) -> dict[str, str]:
    """Every requirement of vLLM's metadata that applies on the device (no extra), by canonical
    name: `packed`, `device` (the image's, at a recorded version) or the `LEFT_OUT` reason."""
    from packaging.requirements import Requirement

    env = gpu_wheels._environment()
    out = {}
    for text in requires_dist(metadata):
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonical(req.name)
        if name in LEFT_OUT:
            out[name] = LEFT_OUT[name]
        elif name in gpu_wheels.DEVICE_VERSIONS:
            out[name] = "device"
        else:
            out[name] = "packed"
    return out


def kept(metadata: str) -> list[str]:
    """vLLM's requirements to resolve and pack (without their markers, which `accounted` read)."""
    from packaging.requirements import Requirement

    keep = {n for n, how in accounted(metadata).items() if how == "packed"}
    out = []
    for text in requires_dist(metadata):
        req = Requirement(text)
        if canonical(req.name) in keep and (req.marker is None or req.marker.evaluate(gpu_wheels._environment())):
            extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            out.append(f"{req.name}{extras}{req.specifier}")
    return out


def stub_wheel(folder: Path, name: str, version: str) -> Path:
    """An empty wheel of `name==version` with no requirements: stands in for the device image's
    copy while pip resolves (pip then fetches none of torch's CUDA requirements)."""
    dist = re.sub(r"[-.]+", "_", name)
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: gpu_vllm_wheels\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as z:
        for arc, text in files.items():
            z.writestr(arc, text)
        z.writestr(f"{info}/RECORD", "".join(f"{arc},,\n" for arc in [*files, f"{info}/RECORD"]))
    return path


PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *[f"--platform={p}" for p in ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
                                          "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                                          "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")]]


def resolve(requirements: Iterable[str], base: Iterable[str], pip: Iterable[str] = (sys.executable, "-m", "pip")) -> dict[str, str]:
    """pip's resolution of `requirements` for the device (canonical name -> version), with the
    first list's `base` lines as constraints and the image's distributions as empty stand-ins."""
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        stubs = [f"{name} @ {stub_wheel(t, name, v).as_uri()}" for name, v in gpu_wheels.DEVICE_VERSIONS.items()]
        (t / "req.txt").write_text("\n".join([*requirements, *stubs]) + "\n")
        (t / "base.txt").write_text("\n".join(base) + "\n")
        out = subprocess.run([*pip, "install", "-q", "--dry-run", "--ignore-installed", "--report", str(t / "report.json"),
                              "--target", str(t / "target"), *PLATFORM, "-c", str(t / "base.txt"), "-r", str(t / "req.txt")],
                             capture_output=True, text=True)
        if out.returncode != 0:
            errors = [line for line in out.stderr.splitlines() if line.startswith("ERROR") or "conflict" in line.lower()
                      or "requested" in line or "depends on" in line]
            raise SystemExit("gpu_vllm_wheels: pip cannot resolve vLLM's requirements for the device:\n" + "\n".join(errors))
        report = json.loads((t / "report.json").read_text())
    return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}


def vllm_list(resolved: Mapping[str, str], base: Iterable[str]) -> list[str]:
    """The second list: `VLLM`, then each resolved distribution that neither the first list
    holds nor the device image brings, as name==version (sorted). A resolved version other than
    the first list's cannot happen (its lines were constraints) and is refused."""
    have = {}
    for line in base:
        name, _, version = line.partition("==")
        have[canonical(name)] = version
    out = []
    for name, version in sorted(resolved.items()):
        if gpu_wheels.on_device(name) or name == canonical(VLLM.split("==")[0]):
            continue
        if name in have:
            if have[name] != version:
                raise SystemExit(f"gpu_vllm_wheels: vLLM needs {name}=={version}, the first list packs {have[name]}")
            continue
        out.append(f"{name}=={version}")
    return [VLLM, *out]


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def strip(wheel: Path, dest: Path, drop: Iterable[str] = tuple(STRIP)) -> Path:
    """A copy of `wheel` in `dest` (same file name) without the members `drop` names, its RECORD
    rewritten to match. Stored members are copied without recompressing the large ones twice."""
    drop = set(drop)
    out = dest / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        names = [i.filename for i in src.infolist()]
        missing = drop - set(names)
        if missing:
            raise SystemExit(f"gpu_vllm_wheels: {wheel.name} has no {', '.join(sorted(missing))}: STRIP is for another vLLM")
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        for info in src.infolist():
            if info.filename in drop or info.filename == record:
                continue
            dst.writestr(info, src.read(info.filename), compress_type=info.compress_type)
        lines = [line for line in src.read(record).decode().splitlines() if line.split(",", 1)[0] not in drop]
        dst.writestr(record, "\n".join(lines) + "\n")
    return out


def part_size(tree_bytes: int, limit: int = CALL_LIMIT, margin: int = MARGIN) -> int:
    """Bytes of one part: what a call carries beside the working tree, whole MiB, so the set
    travels in the fewest calls (ceil(total / part_size))."""
    room = (limit - tree_bytes - margin) // 2**20 * 2**20
    if room < 8 * 2**20:
        raise SystemExit(f"gpu_vllm_wheels: the working tree ({tree_bytes / 2**20:.1f} MiB) leaves under 8 MiB a call")
    return room


def parts(total: int, size: int) -> int:
    return -(-total // size)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    cmd, args = argv[0], argv[1:]
    if cmd == "kept":
        print("\n".join(kept(Path(args[0]).read_text())))
    elif cmd == "resolve":
        metadata, base = Path(args[0]).read_text(), Path(args[1]).read_text().splitlines()
        print("\n".join(vllm_list(resolve(kept(metadata), base), base)))
    elif cmd == "strip":
        print(strip(Path(args[0]), Path(args[1])))
    elif cmd == "part-size":
        print(part_size(int(args[0])))
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
