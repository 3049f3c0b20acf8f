"""Reading checkpoints a user names (``ckpt_path``, ``init_ckpt``) with one clear line for every way they are wrong.

``torch.load`` on a damaged file fails deep in zip or pickle code, and a checkpoint of another architecture fails
in ``load_state_dict`` with a page of key names. Here each becomes a :class:`ConfigError` naming the key, the
file and what is wrong: not a checkpoint, truncated, not a Lightning checkpoint, or the first tensor whose shape
differs. Checks run before anything of the run is written.

Light checkpoints: a LoRA run whose base is frozen saves only what training changes (the adapters, the trained heads,
buffers) and a :data:`LIGHT_KEY` entry naming the frozen tensors it left out with a digest of each
(:func:`light_state`); whoever loads it builds the model from the run's config and completes the state from that
model's own, identical base (:func:`complete_light_state`), refusing a base whose tensors differ.

torch is imported by the functions that need it, not by this module: the pre-flight check runs
:func:`check_checkpoint_file` (and, for a file that passes, :func:`read_checkpoint`) before the run has imported
anything heavy, and a refused file should not cost torch's import (seconds).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adls_lightning.errors import ConfigError

if TYPE_CHECKING:
    import torch

# torch.save's archive is a zip; every zip starts with a local file header.
ZIP_MAGIC = b"PK\x03\x04"
# Keys every checkpoint Lightning's Trainer writes has.
LIGHTNING_KEYS = ("state_dict", "pytorch-lightning_version")
#: The entry of a light checkpoint: ``{"base": where the frozen base was loaded from, "omitted": count of tensors
#: left out, "omitted_parameters": their elements, "base_digest": one digest of them all, "digests": {key: digest}}``.
LIGHT_KEY = "adls_light"
#: The settings a run measured on its machine (``trainer.precision=auto`` -> ``bf16-mixed`` or ``32-true``;
#: ``runtime.gemm=auto`` -> ``aten`` or ``onednn``), as ``{key: value}``: a later evaluation of the checkpoint or of
#: its export computes as the run's own test pass did, whatever the machine or its load measures then.
RESOLVED_KEY = "adls_resolved"


def _shape(shape: Iterable[int]) -> str:
    return " x ".join(str(d) for d in shape) or "scalar"


def missing_checkpoint(path: str | Path, key: str, valid: str = "a .ckpt path") -> ConfigError:
    """The refusal of a ``KEY=PATH`` that is no checkpoint file. A folder is named for what it is, with the
    checkpoint to give instead: a run's (its best checkpoint), a sweep's (a job's), or an export (no training
    checkpoint at all)."""
    path = Path(path)
    if not path.is_dir():
        return ConfigError(f"{key}={path}: no such checkpoint file (give {valid})")
    saved = sorted(
        (path / "checkpoints").glob("*.ckpt"), key=lambda p: (not p.name.startswith("best"), p.name)
    )
    if saved:
        return ConfigError(
            f"{key}={path}: a run folder, not a checkpoint file; give one of its checkpoints, e.g. "
            f"{key}={saved[0]}"
        )
    jobs = sorted(path.glob("*/checkpoints/best*.ckpt"))
    if jobs:
        kind = "a sweep folder" if (path / "multirun.yaml").is_file() else "a folder of runs"
        return ConfigError(
            f"{key}={path}: {kind}, not a checkpoint file; give a checkpoint of one of its runs, e.g. "
            f"{key}={jobs[0]}"
        )
    if (path / "export.json").is_file():
        return ConfigError(
            f"{key}={path}: an export folder (adls-export's), not a training checkpoint; give the "
            "checkpoint of the run it was exported from (<run>/checkpoints/*.ckpt)"
        )
    return ConfigError(f"{key}={path}: a folder, not a checkpoint file (give {valid})")


def check_checkpoint_file(path: str | Path, key: str) -> None:
    """The checks that read no more than the archive's ends (the pre-flight check runs them before any import of
    the model's libraries): the file exists, is not empty, is a ``torch.save`` archive and is whole.

    Raises:
        ConfigError: ``KEY=PATH: <what is wrong>`` for a missing, empty, non-checkpoint or truncated file.
    """
    path = Path(path)
    if not path.is_file():
        raise missing_checkpoint(path, key)
    size = path.stat().st_size
    if size == 0:
        raise ConfigError(f"{key}={path}: empty file (0 bytes), not a checkpoint")
    with path.open("rb") as handle:
        head = handle.read(len(ZIP_MAGIC))
    if head != ZIP_MAGIC:
        raise ConfigError(f"{key}={path}: not a checkpoint (not a torch.save archive; {size} bytes)")
    if not zipfile.is_zipfile(path):
        raise ConfigError(
            f"{key}={path}: truncated checkpoint ({size} bytes; the archive's end is missing: a copy or a "
            "save that was cut short)"
        )


#: The checkpoints read within :func:`reading_once` (None outside it): file identity -> checkpoint.
_read_once: dict[tuple, dict[str, Any]] | None = None


@contextlib.contextmanager
def reading_once() -> Iterator[None]:
    """Within this block, each checkpoint file is read once: the pre-flight check, the run's shape checks and the
    model's initial weights (``init_ckpt``) share one mapped read of it (``read_checkpoint(..., mmap=True)``)
    instead of reading it three times. A file changed in between (another size, inode or modification time) is
    read again; the reads are dropped when the block ends."""
    global _read_once
    outer, _read_once = _read_once, {} if _read_once is None else _read_once
    try:
        yield
    finally:
        _read_once = outer


def _identity(path: str | Path) -> tuple:
    info = os.stat(path)
    return (os.path.realpath(path), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def read_checkpoint(path: str | Path, key: str, mmap: bool = False) -> dict[str, Any]:
    """Load a Lightning checkpoint onto the CPU.

    ``mmap``: map the tensors' bytes instead of reading them (copy-on-write: the file never changes); what is
    checked is the same (the whole archive's structure is unpickled). Within :func:`reading_once`, a mapped read
    of a file already read is the same checkpoint again (a new dict, and a new ``state_dict`` dict, over the same
    tensors).

    Raises:
        ConfigError: ``KEY=PATH: <what is wrong>`` for a missing, empty, non-checkpoint, truncated or
            non-Lightning file.
    """
    check_checkpoint_file(path, key)
    if not mmap or _read_once is None:
        return _read(path, key, mmap)
    identity = _identity(path)
    if identity not in _read_once:
        _read_once[identity] = _read(path, key, mmap=True)
    checkpoint = dict(_read_once[identity])
    if isinstance(checkpoint.get("state_dict"), Mapping):
        checkpoint["state_dict"] = dict(checkpoint["state_dict"])
    return checkpoint


def _read(path: str | Path, key: str, mmap: bool) -> dict[str, Any]:
    import torch

    try:
        # Lightning checkpoints hold plain containers and tensors (hyper-parameters are saved as dicts), so the
        # safe loader suffices and a hostile file cannot run code while being read.
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, KeyError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{key}={path}: damaged or truncated checkpoint ({reason[:200]})") from None
    if not isinstance(checkpoint, Mapping) or any(k not in checkpoint for k in LIGHTNING_KEYS):
        found = sorted(checkpoint)[:6] if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
        raise ConfigError(
            f"{key}={path}: not a Lightning checkpoint (needs keys {list(LIGHTNING_KEYS)}; found {found})"
        )
    return dict(checkpoint)


def check_shapes(
    state_dict: Mapping[str, torch.Tensor],
    model: torch.nn.Module,
    path: str | Path,
    key: str,
    structured: bool = False,
) -> None:
    """Refuse a checkpoint whose tensors do not fit ``model``: another architecture (width, depth, vocabulary).

    Only keys present in both are compared: callbacks (quantization, pruning, LoRA merge) may add or rename
    entries when they set the model up, and ``load_state_dict`` reports those itself. ``structured``: the run prunes
    structurally (``prune.structured``), so its callback gives the model a structurally pruned checkpoint's head and
    FFN sizes before loading it, and the shapes are compared at those sizes.

    Raises:
        ConfigError: ``KEY=PATH: shapes of key K differ: checkpoint a x b vs model c x d``, or no key in common.
    """
    own = model_state = model.state_dict()
    common = [k for k in state_dict if k in own]
    if not common:
        # A run whose compression callbacks merged LoRA (model.merge_lora_before_compress) checkpoints the merged
        # model: compare with the layout this model takes once merged, as the resumed run's callbacks will do.
        own = _merged_layout(model) or own
        common = [k for k in state_dict if k in own]
    # a full checkpoint fits a LoRA model's merged layout, so only the LoRA checkpoint is refused here; the other
    # way round is told when the weights load (SequenceClassifier's init_ckpt), once callbacks merged or not
    if not common and _has_lora(state_dict) and not _has_lora(model_state):
        raise ConfigError(lora_mismatch(state_dict, model_state, path, key))
    if not common:
        raise ConfigError(
            f"{key}={path}: no weight of this model in the checkpoint (another model? e.g. it has "
            f"{next(iter(state_dict), 'no keys')}, the model has {next(iter(own), 'no keys')})"
        )
    if any(_differs(state_dict[name], own[name]) for name in common):
        shrunk = _structured_copy(model, state_dict)
        if shrunk is not None and not structured:
            raise ConfigError(
                f"{key}={path}: a structurally pruned checkpoint (fewer heads or FFN neurons than this model); "
                "load it with the run's prune=structured_* override"
            )
        if shrunk is not None:
            # a structurally pruned checkpoint (prune.structured): compared with this model at the checkpoint's
            # head and FFN sizes, which the pruning callback gives it before the weights load
            own = shrunk.state_dict()
            own = own if any(k in own for k in common) else _merged_layout(shrunk) or own
    for name in common:
        theirs, ours = state_dict[name], own.get(name)
        if _differs(theirs, ours):
            raise ConfigError(
                f"{key}={path}: shapes of key {name} differ: checkpoint {_shape(theirs.shape)} vs model "
                f"{_shape(ours.shape)} (a checkpoint of another architecture)"
            )


def _has_lora(state_dict: Mapping[str, Any]) -> bool:
    return any(".lora_A." in k for k in state_dict)


def lora_mismatch(
    state_dict: Mapping[str, Any], model_state: Mapping[str, Any], path: str | Path, key: str
) -> str | None:
    """The refusal of a checkpoint and a model of which one has LoRA adapters and the other none, or None."""
    if _has_lora(state_dict) and not _has_lora(model_state):
        return (
            f"{key}={path}: a LoRA checkpoint, and this model has no LoRA adapters (model.lora=null); keep the "
            f"run's LoRA, or export it merged (python -m adls_lightning.export ckpt={path} out=DIR format=hf) and "
            "start from that folder with model.backbone.name_or_path=DIR"
        )
    if _has_lora(model_state) and not _has_lora(state_dict):
        return (
            f"{key}={path}: a full fine-tune checkpoint (no LoRA adapters), and this model has LoRA adapters; "
            "build the model its run trained: model/lora=none"
        )
    return None


def _differs(theirs: Any, ours: Any) -> bool:
    import torch

    return isinstance(theirs, torch.Tensor) and isinstance(ours, torch.Tensor) and theirs.shape != ours.shape


def _structured_copy(model: torch.nn.Module, state_dict: Mapping[str, Any]) -> torch.nn.Module | None:
    """A copy of ``model`` shrunk to the head and FFN sizes of a structurally pruned ``state_dict``, or None when
    the state's sizes are not those of a structured pruning of it."""
    import copy

    from adls_lightning.prune.structured import fit_structure_to_state

    copied = copy.deepcopy(model)
    return copied if fit_structure_to_state(copied, state_dict) else None


def _merged_layout(model: torch.nn.Module) -> dict[str, Any] | None:
    """``model``'s state in the layout of its LoRA-merged model (``model.model`` a PEFT model), else None."""
    from peft import PeftModel

    from adls_lightning.lora import lora_scalings, merged_state

    inner = getattr(model, "model", None)
    if not isinstance(inner, PeftModel):
        return None
    return merged_state(model.state_dict(), "model.", lora_scalings(inner))


def load_weights(model: torch.nn.Module, path: str | Path, key: str) -> None:
    """Load the model weights of a Lightning checkpoint, full or light, into ``model`` (strict), with one-line
    errors."""
    state_dict = complete_light_state(model, read_checkpoint(path, key), path, key)
    check_shapes(state_dict, model, path, key)
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        raise ConfigError(f"{key}={path}: does not fit this model ({' '.join(lines[1:2])[:300]})") from None


def last_checkpoint(dirs: Iterable[str | Path]) -> Path:
    """The checkpoint ``ckpt_path=last`` resumes: the newest ``last*.ckpt`` in the checkpoint folders ``dirs`` (what
    Lightning's ``ckpt_path="last"`` would pick).

    Lightning would warn and start afresh when there is none, silently discarding the intent to resume.

    Raises:
        ConfigError: no ``last*.ckpt`` in any of ``dirs``.
    """
    dirs = list(dict.fromkeys(str(d) for d in dirs))
    found = [p for d in dirs if Path(d).is_dir() for p in Path(d).glob("last*.ckpt")]
    if not found:
        raise ConfigError(
            f"ckpt_path=last: nothing to resume, no last*.ckpt in {', '.join(dirs) or 'this run'} "
            "(start a fresh run without ckpt_path, or give a .ckpt path)"
        )
    return max(found, key=lambda p: p.stat().st_mtime_ns)


def tensor_digest(tensor: torch.Tensor) -> str:
    """A digest of ``tensor``'s shape, dtype and bytes (SHA-256: about 1 GB/s here, 0.1 s for MiniLM's base)."""
    import hashlib

    import torch

    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    digest = hashlib.sha256(f"{tuple(tensor.shape)}|{tensor.dtype}|".encode())
    digest.update(memoryview(data))
    return digest.hexdigest()[:32]


def _combined_digest(digests: Mapping[str, str]) -> str:
    import hashlib

    return hashlib.sha256("".join(f"{k}={d};" for k, d in sorted(digests.items())).encode()).hexdigest()[:32]


def frozen_base_digests(model: torch.nn.Module) -> dict[str, str]:
    """The digest of every frozen parameter of ``model`` (by state key) that a light checkpoint may leave out:
    taken when the model is built, so that what a later save finds unchanged is what a fresh build gives again.

    PEFT keeps an untouched copy of each ``modules_to_save`` module (``original_module``): for the task head it was
    drawn at random (the run's seed), not read from the base's files, so it is not offered (it is small, and stays in
    the checkpoint).
    """
    from peft.utils import ModulesToSaveWrapper

    originals = tuple(
        f"{name}.original_module."
        for name, sub in model.named_modules()
        if isinstance(sub, ModulesToSaveWrapper)
    )
    return {
        name: tensor_digest(param)
        for name, param in model.named_parameters(remove_duplicate=False)
        if not param.requires_grad and not name.startswith(originals)
    }


def light_state(
    model: torch.nn.Module, state_dict: Mapping[str, Any], base_digests: Mapping[str, str], base: str
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``state_dict`` without the frozen tensors a fresh build of ``model`` restores, and the :data:`LIGHT_KEY`
    entry that names them; None when nothing can be left out.

    Left out: a tensor that is a parameter of ``model`` frozen now (no gradient, no optimizer state) and still
    bit-identical to its value when the model was built (``base_digests``, :func:`frozen_base_digests`). Whatever
    a run changed (merged LoRA, a quantized or pruned base, unfrozen weights, buffers) is kept, so runs that
    change their base write full checkpoints without being told.
    """
    from collections import OrderedDict

    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    omitted = {
        key: digest
        for key, value in state_dict.items()
        if key in frozen and (digest := base_digests.get(key)) is not None and tensor_digest(value) == digest
    }
    if not omitted:
        return None
    kept = OrderedDict((k, v) for k, v in state_dict.items() if k not in omitted)
    if hasattr(state_dict, "_metadata"):
        kept._metadata = state_dict._metadata  # type: ignore[attr-defined]  # the modules' state versions
    entry = {
        "base": base,
        "omitted": len(omitted),
        "omitted_parameters": sum(int(state_dict[k].numel()) for k in omitted),
        "base_digest": _combined_digest(omitted),
        "digests": omitted,
    }
    return kept, entry


def complete_light_state(
    model: torch.nn.Module,
    checkpoint: Mapping[str, Any],
    path: str | Path,
    key: str,
    copy: bool = False,
    base: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """The full state dict of ``checkpoint``: its ``state_dict`` as it is for a full checkpoint; for a light one
    (:data:`LIGHT_KEY`), completed with ``model``'s own tensors of the keys it left out, after checking that each
    is bit-identical to the one the run had. ``model`` must be built from the run's config and not yet changed
    (LoRA unmerged, nothing quantized or pruned: a light checkpoint comes from a run that changed none of its base).
    ``copy``: clone the completed tensors (for a caller that changes the model before loading the state).
    ``base``: the frozen base's tensors as built, by state-dict key, for a model that has changed since (LoRA merged
    by a compression callback before the checkpoint loads); default: ``model``'s own.

    Raises:
        ConfigError: ``KEY=PATH: a light checkpoint ...`` naming the first key this model lacks or holds another
            value of (another base model, or a model changed before loading).
    """
    state = checkpoint["state_dict"]
    light = checkpoint.get(LIGHT_KEY)
    if not light:
        return state
    own = model.state_dict() if base is None else base
    digests = light["digests"]
    what = (
        f"{key}={path}: a light checkpoint (LoRA adapters and trained heads; its {light['omitted']} frozen base "
        f"tensors, from {light['base']}, left out)"
    )
    if missing := next((k for k in digests if k not in own), None):
        raise ConfigError(
            f"{what}, and this model has no {missing}; load it into the model its run built (the run's model= "
            "overrides, LoRA unmerged)"
        )
    if differs := next((k for k, d in digests.items() if tensor_digest(own[k]) != d), None):
        raise ConfigError(
            f"{what}, and this model's {differs} differs from the run's: another base model; build the one the run "
            f"was trained on (its model.backbone.name_or_path, {light['base']})"
        )
    from collections import OrderedDict

    full = OrderedDict(state)
    full.update({k: own[k].detach().clone() if copy else own[k] for k in digests})
    if hasattr(state, "_metadata"):
        full._metadata = state._metadata  # type: ignore[attr-defined]
    return full
