"""`invoke docker.build` / `docker.run`: what the engine is asked for, the dry-run command lines, the no-engine error.

No Docker engine runs on the CI machines, so the requests go to an inspectable stand-in with the SDK's
method names; the request objects use the real SDK's types (DeviceRequest, Ulimit) and the no-engine test
goes through the real `docker.from_env()`.
"""

from __future__ import annotations

import os
from pathlib import Path

import docker
import pytest
from docker.types import DeviceRequest, Ulimit

from megatron_core import containers
from megatron_core.containers import ContainerError, EngineUnreachable

ROOT = Path(__file__).resolve().parents[1]
NGC_TAG = containers.dockerfile_ngc_tag()
NGC_DIGEST = containers.dockerfile_ngc_digest()
IMAGE = f"megatron-recipes:ngc{NGC_TAG}"
USER = f"{os.getuid()}:{os.getgid()}"  # the caller's: the container's files in /work are its
OTHER_DIGEST = "sha256:" + "ab" * 32
ULIMITS = [Ulimit(name="memlock", soft=-1, hard=-1), Ulimit(name="stack", soft=67108864, hard=67108864)]


class FakeContainer:
    def __init__(self, lines, status=0, fail_while_streaming=None):
        self.lines, self.status, self.fail = lines, status, fail_while_streaming
        self.removed = None

    def logs(self, stream, follow):
        assert stream and follow
        yield from self.lines
        if self.fail:
            raise self.fail

    def wait(self):
        return {"StatusCode": self.status}

    def remove(self, force=False):
        self.removed = {"force": force}


class FakeClient:
    """The SDK surface containers.py uses, recording every call."""

    def __init__(self, build_chunks=(), images=(IMAGE,), container=None):
        self.calls = []
        self.container = container or FakeContainer([b"hello from the container\n"])
        client = self

        class API:
            def build(self, **kwargs):
                client.calls.append(("api.build", kwargs))
                return iter(build_chunks)

        class Images:
            def get(self, name):
                client.calls.append(("images.get", name))
                if name not in images:
                    raise docker.errors.ImageNotFound(f"No such image: {name}")
                return object()

        class Containers:
            def run(self, **kwargs):
                client.calls.append(("containers.run", kwargs))
                return client.container

        self.api, self.images, self.containers = API(), Images(), Containers()


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path / "work", tmp_path / "cache"


# ----------------------------------------------------------------------------------------------
# build
# ----------------------------------------------------------------------------------------------


def test_build_request_defaults_come_from_the_dockerfile():
    request = containers.build_request()
    assert request.ngc_tag == NGC_TAG and request.tag == IMAGE and request.context == ROOT
    assert request.ngc_digest == NGC_DIGEST
    assert request.command_line() == (
        f"docker build -f docker/Dockerfile --build-arg NGC_TAG={NGC_TAG} "
        f"--build-arg NGC_DIGEST={NGC_DIGEST} -t {IMAGE} {ROOT}"
    )


def test_another_ngc_tag_needs_its_own_digest():
    # Docker pulls the digest when both are given: the Dockerfile's would silently build the pinned release.
    with pytest.raises(
        ContainerError,
        match=r"^--ngc-tag 25.11 needs its --ngc-digest \(the Dockerfile pins "
        rf"{NGC_TAG}'s\); `docker buildx imagetools inspect "
        r"nvcr.io/nvidia/pytorch:25.11-py3` prints it$",
    ):
        containers.build_request(ngc_tag="25.11")
    request = containers.build_request(ngc_tag="25.11", ngc_digest=OTHER_DIGEST)
    assert request.buildargs == {"NGC_TAG": "25.11", "NGC_DIGEST": OTHER_DIGEST}
    with pytest.raises(ContainerError, match="--ngc-digest 'sha256:abc' is not an image digest"):
        containers.build_request(ngc_digest="sha256:abc")


def test_build_builds_the_checkout_with_its_pins_and_streams_output():
    chunks = [
        {"stream": "Step 1/9 : ARG NGC_TAG=25.05\n"},
        {"stream": "\n"},
        {"aux": {"ID": "sha256:abc"}},
        {"stream": "Successfully tagged x:y\n"},
    ]
    client, echoed = FakeClient(build_chunks=chunks), []
    image_id = containers.build(tag="x:y", ngc_tag="25.05", ngc_digest=OTHER_DIGEST, client=client, echo=echoed.append)
    assert image_id == "sha256:abc"
    ((call, kwargs),) = client.calls
    assert call == "api.build" and kwargs["tag"] == "x:y"
    assert (Path(kwargs["path"]) / kwargs["dockerfile"]).is_file()  # the checkout's own Dockerfile
    assert kwargs["buildargs"] == {"NGC_TAG": "25.05", "NGC_DIGEST": OTHER_DIGEST}  # the base image, pinned
    assert echoed == ["Step 1/9 : ARG NGC_TAG=25.05", "Successfully tagged x:y", "built x:y (sha256:abc)"]


def test_build_error_chunk_is_one_clear_error():
    client = FakeClient(build_chunks=[{"stream": "Step 1\n"}, {"error": "pull access denied for nvcr.io\n"}])
    with pytest.raises(ContainerError, match="docker build of x:y failed: pull access denied for nvcr.io;"):
        containers.build(tag="x:y", client=client, echo=lambda _: None)


def test_build_dry_run_prints_command_and_needs_no_engine(capsys):
    line = containers.build(tag="me/img:1", ngc_tag=NGC_TAG, dry_run=True, no_cache=True, pull=True)
    assert line == (
        f"docker build -f docker/Dockerfile --build-arg NGC_TAG={NGC_TAG} --build-arg "
        f"NGC_DIGEST={NGC_DIGEST} -t me/img:1 --no-cache --pull {ROOT}"
    )
    assert capsys.readouterr().out.strip() == line


@pytest.mark.parametrize("tag", ["latest", "25.1", "25.10-py3"])
def test_bad_ngc_tag(tag):
    with pytest.raises(ContainerError, match="is not an NGC release tag; use YY.MM"):
        containers.build_request(ngc_tag=tag)


def test_context_without_dockerfile(tmp_path):
    with pytest.raises(ContainerError, match="has no docker/Dockerfile"):
        containers.build_request(context=tmp_path)


# ----------------------------------------------------------------------------------------------
# run
# ----------------------------------------------------------------------------------------------


def test_run_trains_on_every_gpu_as_the_caller_streams_logs_and_removes(dirs):
    work, cache = dirs
    client, echoed = FakeClient(container=FakeContainer([b"iteration 1\n", b"done\n"], status=0)), []
    code = containers.run(client=client, echo=echoed.append, workdir=work, cache=cache)
    assert code == 0
    assert client.calls[0] == ("images.get", IMAGE)
    name, kwargs = client.calls[1]
    assert name == "containers.run" and kwargs["image"] == IMAGE
    assert kwargs["command"] == ["invoke", "train", "--recipe", "codeparrot-small"]
    assert kwargs["device_requests"] == [DeviceRequest(count=-1, capabilities=[["gpu"]])]  # every GPU
    # NCCL needs the host's shared memory and unlimited locked memory (NGC's documented run flags)
    assert kwargs["ipc_mode"] == "host" and ULIMITS[0] in kwargs["ulimits"]
    assert kwargs["volumes"] == {
        str(work): {"bind": "/work", "mode": "rw"},
        str(cache): {"bind": "/cache", "mode": "rw"},
    }
    assert kwargs["user"] == USER  # what it writes under /work is the caller's
    assert work.is_dir() and cache.is_dir()  # made here, not by the engine as root
    assert echoed[1:] == ["iteration 1", "done", "container exited with code 0"]
    assert echoed[0].startswith("+ docker run --rm --gpus all --ipc=host")
    assert client.container.removed == {"force": True}


def test_run_with_gpu_count_mounts_env_network_and_task(dirs, tmp_path):
    work, cache = dirs
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "w2").mkdir()
    client = FakeClient(images=("me/img:2",), container=FakeContainer([], status=3))
    code = containers.run(
        "smoke",
        task="pipeline",
        gpus=2,
        mounts=[f"{data}:/data:ro", f"{tmp_path}/w2:/work"],
        client=client,
        echo=lambda _: None,
        workdir=work,
        cache=cache,
        env=["NCCL_SOCKET_IFNAME=eth0"],
        network_host=True,
        task_args=["--set", "lr=1e-4"],
        image="me/img:2",
    )
    assert code == 3
    assert not work.exists()  # replaced by the --mount onto /work, so not made
    kwargs = client.calls[1][1]
    assert kwargs["image"] == "me/img:2"
    assert kwargs["command"] == ["invoke", "pipeline", "--recipe", "smoke", "--set", "lr=1e-4"]
    assert kwargs["device_requests"] == [DeviceRequest(count=2, capabilities=[["gpu"]])]
    assert kwargs["network_mode"] == "host"
    assert kwargs["environment"] == {"NCCL_SOCKET_IFNAME": "eth0"}
    # a --mount onto /work replaces the default work mount
    assert kwargs["volumes"] == {
        str(tmp_path / "w2"): {"bind": "/work", "mode": "rw"},
        str(cache): {"bind": "/cache", "mode": "rw"},
        str(data): {"bind": "/data", "mode": "ro"},
    }


def test_run_dry_run_line(dirs):
    work, cache = dirs
    line = containers.run(dry_run=True, echo=lambda _: None, workdir=work, cache=cache)
    assert not work.exists() and not cache.exists()  # a dry run changes nothing
    assert line == (
        f"docker run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 "
        f"--user {USER} -v {work}:/work -v {cache}:/cache {IMAGE} invoke train --recipe codeparrot-small"
    )


def test_run_as_another_user(dirs):
    work, cache = dirs
    request = containers.run_request("smoke", workdir=work, cache=cache, user="1234:5678")
    assert request.sdk_kwargs()["user"] == "1234:5678"
    assert " --user 1234:5678 " in request.command_line()


def test_run_dry_run_line_multi_node(dirs):
    work, cache = dirs
    line = containers.run(
        "codeparrot-small-8gpu",
        gpus="all",
        dry_run=True,
        echo=lambda _: None,
        workdir=work,
        cache=cache,
        network_host=True,
        env=["NCCL_SOCKET_IFNAME=ib0"],
        task_args=["--nnodes", "2", "--node-rank", "0", "--master-addr", "node0"],
    )
    assert line == (
        f"docker run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 "
        f"--user {USER} --network=host -v {work}:/work -v {cache}:/cache -e NCCL_SOCKET_IFNAME=ib0 {IMAGE} "
        "invoke train --recipe codeparrot-small-8gpu --nnodes 2 --node-rank 0 --master-addr node0"
    )


def test_cpu_only_run_has_no_gpu_request(dirs):
    work, cache = dirs
    request = containers.run_request("smoke", gpus="none", workdir=work, cache=cache)
    assert request.sdk_kwargs()["device_requests"] == []
    assert "--gpus" not in request.command_line()


def test_missing_image_says_build_first(dirs):
    work, cache = dirs
    client = FakeClient(images=())
    with pytest.raises(ContainerError, match=f"image {IMAGE} is not on this Docker engine; build it first"):
        containers.run(client=client, echo=lambda _: None, workdir=work, cache=cache)
    assert [name for name, _ in client.calls] == ["images.get"]


def test_interrupted_run_still_removes_the_container(dirs):
    work, cache = dirs
    client = FakeClient(container=FakeContainer([b"x\n"], fail_while_streaming=KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        containers.run(client=client, echo=lambda _: None, workdir=work, cache=cache)
    assert client.container.removed == {"force": True}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gpus": "two"}, "--gpus 'two' is not 'all', a GPU count or 'none'"),
        ({"mounts": ["/nope/such/dir:/data"]}, "does not exist on this machine"),
        ({"mounts": ["./x"]}, "is not SRC:DST or SRC:DST:ro"),
        ({"mounts": [".:data"]}, "the container path must be absolute"),
        ({"env": ["NOEQUALS"]}, "--env 'NOEQUALS' is not KEY=VALUE"),
        ({"task": "Train;rm"}, "is not an invoke task name"),
        ({"recipe": "codeparot-small"}, "no recipe named 'codeparot-small'"),
    ],
)
def test_bad_run_input_is_one_clear_error(dirs, kwargs, message):
    work, cache = dirs
    with pytest.raises(containers.UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        containers.run_request(**{"workdir": work, "cache": cache, **kwargs})


def test_container_path_recipe_is_left_to_the_container(dirs):
    work, cache = dirs
    request = containers.run_request("/work/my-recipe.yaml", workdir=work, cache=cache)
    assert request.command[-1] == "/work/my-recipe.yaml"


# ----------------------------------------------------------------------------------------------
# the engine
# ----------------------------------------------------------------------------------------------


def test_no_engine_names_the_socket_tried(monkeypatch, tmp_path):
    socket = f"unix://{tmp_path}/no-docker.sock"
    monkeypatch.setenv("DOCKER_HOST", socket)
    with pytest.raises(EngineUnreachable) as info:
        containers.docker_client()
    message = str(info.value)
    assert message.startswith(f"no Docker engine reachable at {socket} (from DOCKER_HOST):")
    assert "start the Docker daemon" in message and "--dry-run" in message
    with pytest.raises(EngineUnreachable):  # the task path: build without a client asks the engine
        containers.build(echo=lambda _: None)


def test_default_socket_when_docker_host_unset(monkeypatch):
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    assert containers.engine_socket() == "unix:///var/run/docker.sock"


def test_docker_tasks_need_no_torch_on_the_host(tmp_path):
    # The GPU runner drives the image from a host venv without torch (torch lives in the image).
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from megatron_core import containers\n"
        f"containers.build(dry_run=True)\n"
        f"containers.run('smoke', gpus=1, dry_run=True, workdir={str(tmp_path / 'w')!r}, "
        f"cache={str(tmp_path / 'c')!r})\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1].startswith("docker run --rm --gpus 1 --ipc=host")
