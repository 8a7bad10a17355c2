"""The image and a recipe inside it, through the Docker SDK (what `invoke docker.build` / `docker.run` call).

Each request is a plain, frozen object built by a pure function: it knows the exact keyword arguments the
SDK is called with and the equivalent `docker` command line (what `--dry-run` prints). `build()` and `run()`
then send one request to a client: `docker.from_env()` in the product, any object with the same
`api.build` / `images.get` / `containers.run` methods in the tests (no engine runs on the CI machines).

The run flags are NVIDIA's recommendations for its PyTorch containers: all (or N) GPUs, the host's IPC
namespace (PyTorch workers and NCCL share memory through /dev/shm), unlimited locked memory (RDMA) and a
64 MiB stack; and the caller's uid:gid, so the run's files in the mounted work directory are the caller's.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Union

from megatron_core.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = "docker/Dockerfile"
IMAGE_NAME = "megatron-recipes"
CONTAINER_WORKDIR = "/work"  # the image links its ./work (the tasks' default --workdir) here
CONTAINER_CACHE = "/cache"  # HF_HOME and HF_DATASETS_CACHE live under it (see the Dockerfile)
DEFAULT_TASK = "train"
DEFAULT_RECIPE = "codeparrot-small"
STACK_BYTES = 67108864
DEFAULT_SOCKET = "unix:///var/run/docker.sock"

Gpus = Union[str, int]
Echo = Callable[[str], None]


class ContainerError(UserError):
    """A docker build/run request that cannot be carried out, with what to do about it."""


class EngineUnreachable(ContainerError):
    """No Docker engine answers on the socket the SDK tried."""


# ----------------------------------------------------------------------------------------------
# Build
# ----------------------------------------------------------------------------------------------


def _dockerfile_arg(name: str, dockerfile: Path) -> str:
    try:
        text = dockerfile.read_text()
    except OSError as exc:
        raise ContainerError(
            f"cannot read {dockerfile} ({exc.strerror}); run from a checkout of the repository"
        ) from None
    match = re.search(rf"^ARG\s+{name}=(\S+)\s*$", text, re.MULTILINE)
    if not match:
        raise ContainerError(f"{dockerfile} has no `ARG {name}=...` line; restore it from git")
    return match.group(1)


def dockerfile_ngc_tag(dockerfile: Path = REPO_ROOT / DOCKERFILE) -> str:
    """The NGC PyTorch tag pinned by the Dockerfile's `ARG NGC_TAG=...` (the one place it is written)."""
    return _dockerfile_arg("NGC_TAG", dockerfile)


def dockerfile_ngc_digest(dockerfile: Path = REPO_ROOT / DOCKERFILE) -> str:
    """The digest of that tag, pinned by the Dockerfile's `ARG NGC_DIGEST=sha256:...`."""
    return _dockerfile_arg("NGC_DIGEST", dockerfile)


def default_image(ngc_tag: str | None = None) -> str:
    return f"{IMAGE_NAME}:ngc{ngc_tag or dockerfile_ngc_tag()}"


@dataclass(frozen=True)
class BuildRequest:
    tag: str
    ngc_tag: str
    ngc_digest: str
    context: Path
    dockerfile: str = DOCKERFILE
    no_cache: bool = False
    pull: bool = False

    @property
    def buildargs(self) -> dict:
        return {"NGC_TAG": self.ngc_tag, "NGC_DIGEST": self.ngc_digest}

    def sdk_kwargs(self) -> dict:
        """Keyword arguments for `client.api.build` (streamed, decoded progress)."""
        return {
            "path": str(self.context),
            "dockerfile": self.dockerfile,
            "tag": self.tag,
            "buildargs": self.buildargs,
            "rm": True,
            "decode": True,
            "nocache": self.no_cache,
            "pull": self.pull,
        }

    def command_line(self) -> str:
        args = ["docker", "build", "-f", self.dockerfile]
        for key, value in self.buildargs.items():
            args += ["--build-arg", f"{key}={value}"]
        args += ["-t", self.tag]
        args += ["--no-cache"] * self.no_cache + ["--pull"] * self.pull
        return shlex.join(args + [str(self.context)])


_NGC_TAG = re.compile(r"^\d{2}\.\d{2}(\.\d+)?$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def build_request(
    tag: str | None = None,
    ngc_tag: str | None = None,
    context: str | os.PathLike | None = None,
    no_cache: bool = False,
    pull: bool = False,
    ngc_digest: str | None = None,
) -> BuildRequest:
    """Validate the build inputs; defaults: the Dockerfile's NGC tag and digest, image megatron-recipes:ngc<tag>.
    Another tag needs its own digest (with both, Docker pulls the digest: the Dockerfile's would be 25.10)."""
    context = Path(context or REPO_ROOT).resolve()
    dockerfile = context / DOCKERFILE
    if not dockerfile.is_file():
        raise ContainerError(f"build context {context} has no {DOCKERFILE}; pass the repository root as context")
    pinned_tag = dockerfile_ngc_tag(dockerfile)
    ngc_tag = ngc_tag or pinned_tag
    if not _NGC_TAG.match(ngc_tag):
        raise ContainerError(
            f"--ngc-tag {ngc_tag!r} is not an NGC release tag; use YY.MM such as 25.10 "
            "(the image is nvcr.io/nvidia/pytorch:<tag>-py3)"
        )
    if ngc_digest is None:
        if ngc_tag != pinned_tag:
            raise ContainerError(
                f"--ngc-tag {ngc_tag} needs its --ngc-digest (the Dockerfile pins {pinned_tag}'s); "
                f"`docker buildx imagetools inspect nvcr.io/nvidia/pytorch:{ngc_tag}-py3` prints it"
            )
        ngc_digest = dockerfile_ngc_digest(dockerfile)
    if not _DIGEST.match(ngc_digest):
        raise ContainerError(
            f"--ngc-digest {ngc_digest!r} is not an image digest; use sha256:<64 hex digits> "
            f"(docker buildx imagetools inspect nvcr.io/nvidia/pytorch:{ngc_tag}-py3)"
        )
    return BuildRequest(
        tag=tag or default_image(ngc_tag),
        ngc_tag=ngc_tag,
        ngc_digest=ngc_digest,
        context=context,
        no_cache=no_cache,
        pull=pull,
    )


def send_build(request: BuildRequest, client, echo: Echo = print) -> str:
    """Build through `client.api.build`, echoing the build's output; returns the image id."""
    image_id = ""
    for chunk in client.api.build(**request.sdk_kwargs()):
        if "stream" in chunk:
            text = chunk["stream"].rstrip("\n")
            if text:
                echo(text)
        if "error" in chunk:
            raise ContainerError(
                f"docker build of {request.tag} failed: {chunk['error'].strip()}; the build output is above"
            )
        image_id = (chunk.get("aux") or {}).get("ID", image_id)
    echo(f"built {request.tag} ({image_id or 'id not reported'})")
    return image_id


# ----------------------------------------------------------------------------------------------
# Run
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    source: str  # absolute host path
    target: str  # absolute container path
    read_only: bool = False

    @property
    def spec(self) -> str:
        return f"{self.source}:{self.target}" + (":ro" if self.read_only else "")


def parse_mount(spec: str, must_exist: bool = True) -> Mount:
    """'SRC:DST' or 'SRC:DST:ro'; SRC is made absolute (a relative one would name a Docker volume instead)."""
    parts = spec.split(":")
    if len(parts) == 3 and parts[2] in ("ro", "rw"):
        source, target, mode = parts
    elif len(parts) == 2:
        (source, target), mode = parts, "rw"
    else:
        raise ContainerError(f"--mount {spec!r} is not SRC:DST or SRC:DST:ro; e.g. --mount ./data:/data:ro")
    if not source or not target.startswith("/"):
        raise ContainerError(f"--mount {spec!r}: the container path must be absolute, e.g. ./data:/data")
    host = Path(source).expanduser().resolve()
    if must_exist and not host.exists():
        raise ContainerError(f"--mount {spec!r}: {host} does not exist on this machine; create it or fix the path")
    return Mount(str(host), target, mode == "ro")


def parse_gpus(gpus: Gpus) -> int | None:
    """'all' -> -1 (every GPU), N -> N, 'none'/0 -> None (no GPU request: a CPU run in the container)."""
    text = str(gpus).strip().lower()
    if text == "all":
        return -1
    if text in ("none", "0"):
        return None
    if text.isdigit():
        return int(text)
    raise ContainerError(f"--gpus {gpus!r} is not 'all', a GPU count or 'none'; e.g. --gpus all or --gpus 2")


def parse_env(items) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise ContainerError(f"--env {item!r} is not KEY=VALUE; e.g. --env NCCL_SOCKET_IFNAME=eth0")
        pairs.append((key, value))
    return tuple(pairs)


@dataclass(frozen=True)
class RunRequest:
    image: str
    command: tuple[str, ...]
    gpu_count: int | None  # -1 = all, None = no GPU request
    mounts: tuple[Mount, ...] = ()
    environment: tuple[tuple[str, str], ...] = ()
    network_host: bool = False  # multi-node: NCCL and torchrun need the host's interfaces
    name: str | None = None
    make_dirs: tuple[str, ...] = ()  # host directories to create before the run (else Docker makes them as root)
    user: str | None = None  # uid:gid the container runs as (None: the image's default, root)

    def device_requests(self) -> list:
        from docker.types import DeviceRequest

        if self.gpu_count is None:
            return []
        return [DeviceRequest(count=self.gpu_count, capabilities=[["gpu"]])]

    def ulimits(self) -> list:
        from docker.types import Ulimit

        return [Ulimit(name="memlock", soft=-1, hard=-1), Ulimit(name="stack", soft=STACK_BYTES, hard=STACK_BYTES)]

    def sdk_kwargs(self) -> dict:
        """Keyword arguments for `client.containers.run` (detached, so its logs can be streamed)."""
        kwargs = {
            "image": self.image,
            "command": list(self.command),
            "detach": True,
            "device_requests": self.device_requests(),
            "ipc_mode": "host",
            "ulimits": self.ulimits(),
            "volumes": {m.source: {"bind": m.target, "mode": "ro" if m.read_only else "rw"} for m in self.mounts},
            "environment": dict(self.environment),
        }
        if self.user:
            kwargs["user"] = self.user
        if self.network_host:
            kwargs["network_mode"] = "host"
        if self.name:
            kwargs["name"] = self.name
        return kwargs

    def command_line(self) -> str:
        args = ["docker", "run", "--rm"]
        if self.gpu_count is not None:
            args += ["--gpus", "all" if self.gpu_count == -1 else str(self.gpu_count)]
        args += ["--ipc=host", "--ulimit", "memlock=-1", "--ulimit", f"stack={STACK_BYTES}"]
        if self.user:
            args += ["--user", self.user]
        if self.network_host:
            args.append("--network=host")
        if self.name:
            args += ["--name", self.name]
        for m in self.mounts:
            args += ["-v", m.spec]
        for key, value in self.environment:
            args += ["-e", f"{key}={value}"]
        return shlex.join(args + [self.image, *self.command])


def _check_recipe_name(recipe: str) -> None:
    """A plain recipe or family name must exist here too (the image bakes the same recipes/); paths are
    container paths and are left for the container to check."""
    if "/" in recipe or recipe.endswith((".yaml", ".yml")):
        return
    from megatron_core import config

    config.resolve_recipe_path(recipe, gpus=1)


def host_user() -> str | None:
    """This process's uid:gid, what the container runs as (None where the OS has no uids: Windows)."""
    if not hasattr(os, "getuid"):
        return None
    return f"{os.getuid()}:{os.getgid()}"


def run_request(
    recipe: str = DEFAULT_RECIPE,
    task: str = DEFAULT_TASK,
    gpus: Gpus = "all",
    mounts=(),
    image: str | None = None,
    workdir: str | os.PathLike = "./work",
    cache: str | os.PathLike | None = None,
    env=(),
    network_host: bool = False,
    task_args=(),
    name: str | None = None,
    user: str | None = None,
) -> RunRequest:
    """The container for `invoke <task> --recipe <recipe> [task_args...]`, with the host's `workdir` on /work
    and `cache` (default ~/.cache/megatron-recipes) on /cache; --mount entries add to (or replace, by
    container path) those two. It runs as `user` (default: the caller's uid:gid), so what it writes there
    is the caller's. Pure: the host directories are made only when the request is sent."""
    if not re.match(r"^[a-z][a-z0-9_.-]*$", task):
        raise ContainerError(f"--task {task!r} is not an invoke task name; e.g. train, pipeline, evaluate")
    _check_recipe_name(recipe)
    defaults = []
    for host, target in ((workdir, CONTAINER_WORKDIR), (cache or Path.home() / ".cache" / IMAGE_NAME, CONTAINER_CACHE)):
        defaults.append(parse_mount(f"{host}:{target}", must_exist=False))
    extra = [parse_mount(spec) for spec in mounts or ()]
    by_target = {m.target: m for m in defaults + extra}
    return RunRequest(
        image=image or default_image(),
        command=("invoke", task, "--recipe", recipe, *task_args),
        gpu_count=parse_gpus(gpus),
        mounts=tuple(by_target.values()),
        environment=parse_env(env),
        network_host=network_host,
        name=name,
        make_dirs=tuple(m.source for m in defaults if by_target[m.target] is m),
        user=user or host_user(),
    )


def send_run(request: RunRequest, client, echo: Echo = print) -> int:
    """Start the container, stream its output until it exits, remove it; returns its exit code."""
    import docker.errors

    try:
        client.images.get(request.image)
    except docker.errors.ImageNotFound:
        raise ContainerError(
            f"image {request.image} is not on this Docker engine; build it first with "
            f"`invoke docker.build --tag {request.image}`"
        ) from None
    for directory in request.make_dirs:
        Path(directory).mkdir(parents=True, exist_ok=True)
    echo(f"+ {request.command_line()}")
    container = client.containers.run(**request.sdk_kwargs())
    try:
        for chunk in container.logs(stream=True, follow=True):
            echo(chunk.decode("utf-8", errors="replace").rstrip("\n"))
        status = container.wait()
    finally:
        container.remove(force=True)  # also stops it when we are interrupted
    code = int(status.get("StatusCode", 1))
    echo(f"container exited with code {code}")
    return code


# ----------------------------------------------------------------------------------------------
# The engine, and the one-call entry points the invoke tasks use
# ----------------------------------------------------------------------------------------------


def engine_socket() -> str:
    return os.environ.get("DOCKER_HOST") or DEFAULT_SOCKET


def docker_client():
    """`docker.from_env()`, checked with a ping; EngineUnreachable names the socket it tried."""
    import docker
    import requests

    socket = engine_socket()
    where = "from DOCKER_HOST" if os.environ.get("DOCKER_HOST") else "the default; DOCKER_HOST is not set"
    try:
        client = docker.from_env()
        client.ping()
        return client
    except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise EngineUnreachable(
            f"no Docker engine reachable at {socket} ({where}): {reason}; start the Docker daemon "
            "(e.g. `sudo systemctl start docker`) or set DOCKER_HOST to a running engine "
            "(e.g. DOCKER_HOST=ssh://user@gpu-node), or add --dry-run to print the docker command instead"
        ) from None


def build(
    tag: str | None = None,
    ngc_tag: str | None = None,
    context=None,
    client=None,
    dry_run: bool = False,
    no_cache: bool = False,
    pull: bool = False,
    echo: Echo = print,
    ngc_digest: str | None = None,
) -> str:
    """`invoke docker.build`: the dry-run command line, or the built image's id."""
    request = build_request(tag, ngc_tag, context, no_cache=no_cache, pull=pull, ngc_digest=ngc_digest)
    if dry_run:
        echo(request.command_line())
        return request.command_line()
    return send_build(request, client or docker_client(), echo)


def run(
    recipe: str = DEFAULT_RECIPE,
    task: str = DEFAULT_TASK,
    gpus: Gpus = "all",
    mounts=(),
    client=None,
    dry_run: bool = False,
    echo: Echo = print,
    **options,
) -> int | str:
    """`invoke docker.run`: the dry-run command line, or the container's exit code. `options` are
    run_request's (image, workdir, cache, env, network_host, task_args, name, user)."""
    request = run_request(recipe, task, gpus, mounts, **options)
    if dry_run:
        echo(request.command_line())
        return request.command_line()
    return send_run(request, client or docker_client(), echo)


__all__ = [
    "BuildRequest",
    "RunRequest",
    "Mount",
    "ContainerError",
    "EngineUnreachable",
    "build_request",
    "run_request",
    "send_build",
    "send_run",
    "build",
    "run",
    "docker_client",
    "engine_socket",
    "default_image",
    "dockerfile_ngc_tag",
    "dockerfile_ngc_digest",
    "host_user",
    "parse_mount",
    "parse_gpus",
    "parse_env",
]
