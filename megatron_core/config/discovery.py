"""Finding recipe files: the recipes directory, a name or family resolved to a file (a family by the
number of visible GPUs, counted only when a family needs it), and a file read with its `base:` chain.

A recipe may start from another: `base: NAME` (a recipe in recipes_dir()) or `base: PATH` (relative to
the recipe file), then give only what differs. Bases may chain. The child's sections merge key by key
over the base's (nested mappings too); any other value, lists included, replaces the base's. `base`
itself is no recipe value: the resolved recipe and its hash are those of the merged mapping.
"""

from __future__ import annotations

import copy
import ctypes
import os
import re
from pathlib import Path
from typing import Any, Optional

import yaml

from megatron_core.config.parsing import did_you_mean
from megatron_core.errors import UserError


def recipes_dir() -> Path:
    env = os.environ.get("MEGATRON_RECIPES_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "recipes"


def list_recipe_files() -> list[Path]:
    return sorted(recipes_dir().glob("*.yaml"))


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"cannot read recipe {path}: {exc.strerror}") from None
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None


def read_recipe_file(path: Path) -> Any:
    """The recipe file's mapping with its `base:` chain merged in (and the `base` key gone)."""
    return _with_bases(Path(path), ())


def _with_bases(path: Path, chain: tuple[Path, ...]) -> Any:
    raw = _read_yaml(path)
    if not isinstance(raw, dict) or "base" not in raw:
        return raw  # a non-mapping is refused, naming the file, when the recipe is built
    raw = dict(raw)
    base = _base_path(raw.pop("base"), path)
    seen = (*chain, path.resolve())
    if base.resolve() in seen:
        loop = " -> ".join(p.name for p in (*seen, base))
        raise UserError(f"{path}: recipe bases form a cycle ({loop}): remove one of these 'base:' keys")
    if "name" not in raw:
        raise UserError(f"{path}: missing 'name' (a recipe with a base still names itself)")
    inherited = _with_bases(base, seen)
    if not isinstance(inherited, dict):
        raise UserError(f"{base}: a recipe must be a YAML mapping (it is the base of {path})")
    # a family is a recipe's own claim: a copy made from a variant (a sweep, an experiment) must not become
    # one of that family's variants without saying so
    inherited = {k: v for k, v in inherited.items() if k != "family"}
    return merge_over(inherited, raw)


def _base_path(spec: Any, path: Path) -> Path:
    """`base:` of the recipe at `path`: a recipe name, or a path relative to that file."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"{path}: base must be a recipe name or a path relative to this file, got {spec!r}")
    if spec.endswith((".yaml", ".yml")) or "/" in spec or os.sep in spec:
        candidate = path.parent / spec
        if not candidate.is_file():
            raise UserError(f"{path}: base {spec} does not exist ({candidate}; a path is relative to this file)")
        return candidate
    by_name = {f.stem: f for f in list_recipe_files()}
    if spec not in by_name:
        raise UserError(
            f"{path}: unknown base '{spec}'{did_you_mean(spec, by_name)} (a recipe name in "
            f"{recipes_dir()}: {', '.join(sorted(by_name))}; or a path relative to this file)"
        )
    return by_name[spec]


def merge_over(base: dict, child: dict) -> dict:
    """`child` over `base`: mappings merge key by key, anything else (lists included) replaces; an empty
    mapping written as a bare `section:` (null) keeps the base's."""
    merged = copy.deepcopy(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_over(merged[key], value)
        elif value is None and isinstance(merged.get(key), dict):
            continue
        else:
            merged[key] = copy.deepcopy(value)
    return merged


_ROCM_DEVICE = Path("/dev/kfd")  # the AMD driver's device node


def visible_gpu_count() -> int:
    """CUDA GPUs this process may use, counted as torch.cuda.device_count() counts them before CUDA starts
    (NVML's devices, less those CUDA_VISIBLE_DEVICES hides) but without importing torch, so that finding
    a recipe stays fast. torch answers only where NVML cannot (GPU/MIG UUIDs, no NVML on a ROCm machine)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ordinals = None if visible is None else _visible_ordinals(visible)
    if ordinals == []:
        return 0
    physical = _nvml_device_count()
    if physical is None:  # no NVIDIA driver: no GPU, unless ROCm's (torch counts its HIP devices)
        return _torch_gpu_count() if _ROCM_DEVICE.exists() else 0
    if visible is None:
        return physical
    if ordinals is None:  # UUIDs: only the driver maps them to devices
        return _torch_gpu_count()
    # listed devices count up to the first this machine does not have
    return next((i for i, ordinal in enumerate(ordinals) if ordinal >= physical), len(ordinals))


def _visible_ordinals(visible: str) -> Optional[list[int]]:
    """CUDA_VISIBLE_DEVICES read as CUDA reads it: leading digits of each entry up to the first invalid
    one, a repeated ordinal hiding every device. None for UUIDs (GPU-..., MIG-...), which need a driver call."""
    if visible.strip().startswith(("GPU-", "MIG-")):
        return None
    ordinals: list[int] = []
    for entry in visible.split(","):
        digits = re.match(r"\s*\+?(\d+)", entry)
        if digits is None:
            break
        if int(digits.group(1)) in ordinals:
            return []
        ordinals.append(int(digits.group(1)))
    return ordinals


def _nvml_device_count() -> Optional[int]:
    """NVIDIA GPUs on this machine through the driver's NVML library, None without a working one."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        count = ctypes.c_uint(0)
        if nvml.nvmlInit_v2() != 0:
            return None
        try:
            return int(count.value) if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else None
        finally:
            nvml.nvmlShutdown()  # every successful init is paired with a shutdown
    except (OSError, AttributeError):  # no driver library, or one without these symbols
        return None


def _torch_gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA setup means "no GPUs" for recipe choice
        return 0


def resolve_recipe_path(spec: str, gpus: Optional[int] = None) -> Path:
    """A file path, a recipe name (file stem) or a family name. A family selects the variant whose
    `parallel.world_size` equals the number of visible GPUs, else its 8-GPU (largest) variant."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise UserError(f"recipe file {spec} does not exist")
        return path
    files = list_recipe_files()
    by_name = {f.stem: f for f in files}
    if spec in by_name:
        return by_name[spec]
    resolved = [(f, read_recipe_file(f)) for f in files]
    family = [(f, raw) for f, raw in resolved if raw.get("family") == spec]
    if family:
        sizes: dict[int, Path] = {}
        for f, raw in family:
            size = int((raw.get("parallel") or {}).get("world_size", 1))
            if size in sizes:
                raise UserError(
                    f"family {spec!r} has two recipes for {size} GPU(s): {sizes[size].name} and {f.name}; "
                    "give one of them another family (or none)"
                )
            sizes[size] = f
        if len(sizes) == 1:
            return next(iter(sizes.values()))
        gpus = visible_gpu_count() if gpus is None else gpus
        return sizes.get(gpus) or sizes[max(sizes)]
    families = sorted({raw.get("family") for _, raw in resolved if raw.get("family")})
    raise UserError(
        f"no recipe named '{spec}'{did_you_mean(spec, list(by_name) + families)} "
        f"(known: {', '.join(sorted(by_name))}; families: {', '.join(families)})"
    )
