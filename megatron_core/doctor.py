"""What this machine can run: torch, CUDA, NCCL, Apex, Triton and the libraries around them.

`report()` probes (never raises for a missing piece) and returns a plain dict; `format_report()` turns it
into the lines `invoke doctor` and the image build print, each missing piece followed by what it disables:

    python -m megatron_core.doctor                 # the report
    python -m megatron_core.doctor --json          # the same, as JSON
    python -m megatron_core.doctor --require apex,triton   # exit 2 when a named piece is missing
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import sys

from megatron_core.errors import UserError

# Distributions whose version is reported without importing them (megatron.core's import is slow and warns).
_DISTRIBUTIONS = {
    "triton": ("triton", "pytorch-triton"),
    "transformers": ("transformers",),
    "megatron-core": ("megatron-core",),
    "docker": ("docker",),
    "megatron-recipes": ("megatron-recipes",),
}

# The transformers range evaluation needs, and the one pyproject.toml requires (a test keeps them equal):
# 5.24 renamed the KV cache to `cache=` / `.cache` (evaluate/generate.py) and 5.x loads with
# from_pretrained(dtype=...) (evaluate/runner.py); 5.23 has no `cache` argument, so generation fails there.
TRANSFORMERS_FLOOR = (5, 24)
TRANSFORMERS_BELOW = (6,)  # the next major: untested
TRANSFORMERS_REQUIREMENT = ">={},<{}".format(*(".".join(map(str, v)) for v in (TRANSFORMERS_FLOOR, TRANSFORMERS_BELOW)))

# What each --require name checks in the report.
REQUIREMENTS = {
    "cuda": lambda r: r["cuda"]["available"],
    "nccl": lambda r: r["nccl"]["available"],
    "apex": lambda r: r["apex"]["usable"],
    "triton": lambda r: r["triton"]["version"] is not None,
    "transformers": lambda r: r["transformers"]["version"] is not None and r["transformers"]["ok"],
    "megatron-core": lambda r: r["megatron-core"]["version"] is not None,
}


def _distribution_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: '5.24.0' -> (5, 24, 0), '4.56.1+ali' -> (4, 56, 1),
    '5.25.0.dev0' -> (5, 25, 0)."""
    parts = []
    for piece in version.split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != piece:  # '1+ali', '0rc1': the release ends here
            break
    return tuple(parts)


def _transformers_section() -> dict:
    version = _distribution_version(_DISTRIBUTIONS["transformers"])
    ok = None if version is None else TRANSFORMERS_FLOOR <= release(version) < TRANSFORMERS_BELOW
    return {"version": version, "required": TRANSFORMERS_REQUIREMENT, "ok": ok}


def _torch_section() -> tuple[dict, dict, dict]:
    """(torch, cuda, nccl) sections."""
    import torch
    import torch.distributed as dist

    torch_info = {"version": torch.__version__, "cuda_build": torch.version.cuda, "git": torch.version.git_version}
    available = torch.cuda.is_available()
    devices = []
    if available:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(
                {
                    "name": props.name,
                    "capability": f"{props.major}.{props.minor}",
                    "memory_gib": round(props.total_memory / 2**30, 1),
                }
            )
    cuda = {
        "available": available,
        "devices": devices,
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cudnn": torch.backends.cudnn.version() if available else None,
    }
    nccl_version = None
    if available and dist.is_nccl_available():
        nccl_version = ".".join(str(part) for part in torch.cuda.nccl.version())
    nccl = {
        "built": dist.is_available() and dist.is_nccl_available(),
        "available": nccl_version is not None,
        "version": nccl_version,
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "env": {key: value for key, value in sorted(os.environ.items()) if key.startswith(("NCCL_", "TORCH_NCCL_"))},
    }
    return torch_info, cuda, nccl


def _apex_section() -> dict:
    from megatron_core.fusions.apex import apex_status

    status = apex_status()
    modules = {name: ok for name, ok in status.items() if name != "errors"}
    return {
        "version": _distribution_version(("apex",)),
        "modules": modules,
        "errors": dict(status["errors"]),
        "usable": all(modules.values()),
    }


def _triton_section(cuda_available: bool) -> dict:
    version = _distribution_version(_DISTRIBUTIONS["triton"])
    interpreter = os.environ.get("TRITON_INTERPRET") == "1"
    if version is None:
        runs_on = None
    elif cuda_available:
        runs_on = "cuda"
    else:
        runs_on = "cpu interpreter" if interpreter else None
    return {"version": version, "interpreter": interpreter, "runs_on": runs_on}


def consequences(r: dict) -> list[str]:
    """One line per missing piece: what it is and what it disables."""
    lines = []
    if not r["cuda"]["available"]:
        lines.append(
            "CUDA: not available -> fused Triton kernels, Apex and NCCL disabled; training runs on CPU with gloo"
        )
    else:
        if not r["nccl"]["available"]:
            lines.append("NCCL: not available -> multi-GPU runs cannot use the nccl backend")
        if not r["apex"]["usable"]:
            missing = ", ".join(name for name, ok in r["apex"]["modules"].items() if not ok)
            lines.append(
                f"Apex: {missing} missing -> the opt-in `optimizer: apex` (FusedAdam) and `fusions: apex` "
                "(LayerNorm) are refused; the defaults, torch's AdamW and PyTorch LayerNorm, run"
            )
        if r["triton"]["version"] is None:
            lines.append("Triton: not installed -> fused Triton kernels disabled; PyTorch reference ops run")
    if r["cuda"]["available"] is False and r["triton"]["version"] and not r["triton"]["interpreter"]:
        lines.append("Triton: installed, no GPU -> its kernels run on CPU only under TRITON_INTERPRET=1 (tests)")
    if r["transformers"]["version"] is None:
        lines.append("transformers: not installed -> Hugging Face conversion checks and evaluation disabled")
    elif not r["transformers"]["ok"]:
        lines.append(
            f"transformers: {r['transformers']['version']} is outside {TRANSFORMERS_REQUIREMENT} -> "
            "evaluation and HumanEval generation fail (they use the 5.24 KV-cache API, `cache=`) "
            f"or load the model in the wrong dtype; pip install 'transformers{TRANSFORMERS_REQUIREMENT}'"
        )
    if r["megatron-core"]["version"] is None:
        lines.append("megatron-core: not installed -> conformance tests against Megatron's own code are skipped")
    if r["docker"]["version"] is None:
        lines.append("docker SDK: not installed -> invoke docker.build / docker.run disabled")
    return lines


def report() -> dict:
    """Everything the doctor knows, as a JSON-able dict. Probes only; nothing here raises for a missing piece."""
    torch_info, cuda, nccl = _torch_section()
    r = {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "platform": platform.platform(),
        "torch": torch_info,
        "cuda": cuda,
        "nccl": nccl,
        "apex": _apex_section(),
        "triton": _triton_section(cuda["available"]),
    }
    r["transformers"] = _transformers_section()
    for key in ("megatron-core", "docker", "megatron-recipes"):
        r[key] = {"version": _distribution_version(_DISTRIBUTIONS[key])}
    r["pip_constraint"] = os.environ.get("PIP_CONSTRAINT") or None
    r["consequences"] = consequences(r)
    return r


def _yes(value) -> str:
    return "missing" if value is None or value is False else str(value)


def _transformers_line(section: dict) -> str:
    if section["version"] is None:
        return "missing"
    verdict = "ok" if section["ok"] else "NOT SUPPORTED"
    return f"{section['version']} (needs {section['required']}: {verdict})"


def format_report(r: dict) -> str:
    """The human-readable report: one line per component, then what the missing ones disable."""
    cuda = r["cuda"]
    if cuda["available"]:
        names = ", ".join(f"{d['name']} (sm {d['capability']}, {d['memory_gib']} GiB)" for d in cuda["devices"])
        cuda_line = f"{len(cuda['devices'])} device(s): {names}; cuDNN {cuda['cudnn']}"
    else:
        cuda_line = "not available"
    nccl = r["nccl"]
    if nccl["available"]:
        nccl_line = nccl["version"]
    else:
        nccl_line = "built into torch, no GPU to run it" if nccl["built"] else "not built into torch"
    nccl_line += "; gloo " + ("available" if nccl["gloo"] else "missing")
    apex = r["apex"]
    apex_line = ", ".join(f"{name} {'ok' if ok else 'missing'}" for name, ok in apex["modules"].items())
    if apex["version"]:
        apex_line = f"{apex['version']}: {apex_line}"
    triton = r["triton"]
    triton_line = _yes(triton["version"])
    if triton["version"]:
        triton_line += f" (runs on: {triton['runs_on'] or 'nothing here'})"
    rows = [
        ("python", f"{r['python']['version']} ({r['python']['executable']})"),
        ("torch", f"{r['torch']['version']} (CUDA build: {r['torch']['cuda_build'] or 'none'})"),
        ("CUDA", cuda_line),
        ("NCCL", nccl_line),
        ("Apex", apex_line),
        ("Triton", triton_line),
        ("transformers", _transformers_line(r["transformers"])),
        ("megatron-core", _yes(r["megatron-core"]["version"])),
        ("docker SDK", _yes(r["docker"]["version"])),
        ("megatron-recipes", _yes(r["megatron-recipes"]["version"])),
        ("pip constraint", r["pip_constraint"] or "none"),
    ]
    if nccl["env"]:
        rows.append(("NCCL env", " ".join(f"{k}={v}" for k, v in nccl["env"].items())))
    width = max(len(name) for name, _ in rows)
    lines = [f"{name.ljust(width)}  {value}" for name, value in rows]
    if r["consequences"]:
        lines.append("")
        lines.append("what is missing disables:")
        lines.extend(f"  - {line}" for line in r["consequences"])
    else:
        lines.append("")
        lines.append("everything is here: fused kernels, Apex and NCCL are all usable")
    return "\n".join(lines)


def check_requirements(r: dict, required: list[str]) -> None:
    """Raise UserError naming every required piece the report lacks."""
    unknown = [name for name in required if name not in REQUIREMENTS]
    if unknown:
        raise UserError(f"--require names unknown pieces {unknown}; choose from {', '.join(REQUIREMENTS)}")
    missing = [name for name in required if not REQUIREMENTS[name](r)]
    if missing:
        raise UserError(
            f"required but missing here: {', '.join(missing)}; see the report above for what "
            "each disables and install the missing piece (in the image: rebuild docker/Dockerfile)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_core.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--require", default="", help=f"comma-separated pieces that must be present: {', '.join(REQUIREMENTS)}"
    )
    args = parser.parse_args(argv)
    try:
        r = report()
    except ImportError as exc:  # without torch nothing else can be probed (or trained): say so in one line
        if (exc.name or "").partition(".")[0] != "torch":
            raise
        print(
            f"error: torch does not import in {sys.executable} ({exc}): install it (bash ci/bootstrap.sh makes "
            ".venv with the CPU wheel) or use the Python that has it (. .venv/bin/activate)",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(r, indent=2) if args.json else format_report(r), flush=True)
    try:
        check_requirements(r, [name.strip() for name in args.require.split(",") if name.strip()])
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
