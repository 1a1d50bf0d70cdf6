"""Stand-in images (standins.py): the pattern map (unit), and against a real engine the families
built from the base image, used only where the real image cannot be had (``pull='never'`` makes
"cannot be had" deterministic), in spec images and Dockerfile FROM lines, and reported."""

from __future__ import annotations

import logging
import secrets
import subprocess
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from miles_engine.errors import ConfigError, SandboxError
from miles_engine.sandbox.protocol import BuildContext, SandboxSpec
from miles_sandbox_docker.images import from_refs
from miles_sandbox_docker.options import DockerSandboxOptions
from miles_sandbox_docker.standins import FAMILIES, StandInMap, family_tag

from .real_engine import ENGINE, backend, run

TB_PYTHON = "ghcr.io/laude-institute/t-bench/python-3-13:20250620"


# ------------------------------------------------------------------ the pattern map (no engine)
@pytest.mark.parametrize(("ref", "family"), [
    ("python:3.11-slim", "python"),
    ("python:3.8-slim-bookworm", "python"),
    ("docker.io/library/python:3.13-slim@sha256:" + "0" * 64, "python"),
    ("python:3.12", "python-full"),
    ("python", "python-full"),
    ("ubuntu:22.04", "ubuntu"),
    ("debian:trixie-slim", "debian"),
    ("buildpack-deps:bookworm-scm", "buildpack-deps"),
    ("alpine:3.20", "alpine"),
    (TB_PYTHON, "tb-python"),
    ("ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest", "tb-ubuntu"),
])
def test_default_patterns_name_the_family(ref, family):
    assert StandInMap.build({}).match(ref)[1] == family


def test_unmatched_refs_have_no_stand_in():
    m = StandInMap.build({})
    assert m.match("nginx:1.27") is None
    assert m.match("ghcr.io/someone/python:3.11-slim") is None  # only docker.io's python is the python image
    assert StandInMap.build({}, defaults=False).match("python:3.11-slim") is None


def test_user_patterns_come_first_and_may_name_an_image():
    m = StandInMap.build({"python:3.11-*": "debian", "myorg/*": "mirror.local/base:1"})
    assert m.match("python:3.11-slim") == ("python:3.11-*", "debian")
    assert m.match("python:3.12-slim")[1] == "python"
    assert m.match("myorg/tool:2") == ("myorg/*", "mirror.local/base:1")


def test_user_families_and_bad_targets():
    m = StandInMap.build({"node:*": "node"}, {"node": ["nodejs", "npm"]})
    assert "apt-get install" in m.dockerfile("node", "miles-base:bookworm")
    assert "nodejs npm" in m.dockerfile("node", "miles-base:bookworm")
    with pytest.raises(ValidationError, match=r"stand-in for 'node:\*': unknown family 'nodee' \(families: alpine"):
        DockerSandboxOptions(stand_ins={"node:*": "nodee"})
    with pytest.raises(ValidationError, match=r"stand_in_families\['bad'\]: \['rm -rf'\]"):
        DockerSandboxOptions(stand_in_families={"bad": ["rm -rf"]})


def test_stand_ins_from_the_environment(monkeypatch):
    monkeypatch.setenv("MILES_DOCKER_STAND_INS", "myorg/py:*=python, corp/base:*=mirror.local/debian:12")
    opts = DockerSandboxOptions()
    assert opts.stand_ins == {"myorg/py:*": "python", "corp/base:*": "mirror.local/debian:12"}
    monkeypatch.setenv("MILES_DOCKER_STAND_INS", "myorg/py:*")
    with pytest.raises(ConfigError, match=r"MILES_DOCKER_STAND_INS: entry 'myorg/py:\*' is not PATTERN=FAMILY_OR_IMAGE"):
        DockerSandboxOptions()


def test_family_dockerfiles_carry_what_the_originals_do():
    py = FAMILIES["python"].dockerfile("B", "python")
    assert py.startswith("FROM B\n")
    for pkg in ("python3-pip", "python3-venv", "python-is-python3"):
        assert pkg in py
    assert "EXTERNALLY-MANAGED" in py
    for fam in ("tb-python", "tb-ubuntu"):
        assert "tmux asciinema" in FAMILIES[fam].dockerfile("B", fam)
    assert "build-essential" in FAMILIES["buildpack-deps"].dockerfile("B", "buildpack-deps")
    # the tag follows the content and the base's id
    assert family_tag("python", py, "sha256:1") != family_tag("python", py, "sha256:2")


def test_from_refs_skips_stages_scratch_and_args():
    text = textwrap.dedent("""\
        ARG BASE=debian:bookworm
        FROM python:3.11-slim AS build
        FROM --platform=linux/amd64 ${BASE}
        FROM build
        FROM scratch
        from ubuntu:24.04
    """)
    assert from_refs(text) == ["python:3.11-slim", "ubuntu:24.04"]


# ------------------------------------------------------------------ against a real engine
def _exec(be, spec: SandboxSpec, command: str):
    async def go():
        sb = await be.create(spec)
        try:
            return await sb.exec(command, timeout_s=120)
        finally:
            await sb.close()

    return run(go(), timeout=900)


@pytest.mark.usefixtures("real_engine")
def test_python_slim_dockerfile_gets_pip_and_venv(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    ctx = tmp_path / "env"
    (ctx / "hello").mkdir(parents=True)
    (ctx / "hello" / "setup.py").write_text("from setuptools import setup\nsetup(name='hello', version='1', py_modules=['hello'])\n")
    (ctx / "hello" / "hello.py").write_text("WORD = 'hi from a local package'\n")
    (ctx / "Dockerfile").write_text(textwrap.dedent("""\
        FROM python:3.11-slim
        COPY hello /src/hello
        RUN pip install --no-index --no-build-isolation /src/hello
        RUN python -m venv /opt/venv && /opt/venv/bin/pip --version
    """))
    be = backend(pull="never")
    with caplog.at_level(logging.WARNING, logger="miles_sandbox_docker.standins"):
        res = _exec(be, SandboxSpec(build=BuildContext(context_dir=str(ctx))),
                    "python -c 'import hello; print(hello.WORD)' && /opt/venv/bin/python -c 'import sys; print(sys.prefix)'")
    assert res.exit_code == 0, res
    assert res.stdout.split("\n")[:2] == ["hi from a local package", "/opt/venv"]
    stood = be.images_stood_in
    assert list(stood) == ["python:3.11-slim"] and stood["python:3.11-slim"].startswith("miles-standin-python:")
    assert be.describe()["images_stood_in"] == stood
    assert be.step_metrics()["sandbox/images_stood_in"] == 1.0
    assert any("image 'python:3.11-slim' cannot be had" in r.getMessage() and "family 'python'" in r.getMessage()
               for r in caplog.records)


@pytest.mark.usefixtures("real_engine")
def test_tb_python_base_has_tmux_and_asciinema():
    be = backend(pull="never")
    res = _exec(be, SandboxSpec(image=TB_PYTHON),
                "tmux -V && asciinema --version && python -c 'import venv' && pip --version >/dev/null && echo ok")
    assert res.exit_code == 0, res
    assert res.stdout.strip().splitlines()[0].startswith("tmux ")
    assert res.stdout.strip().endswith("ok")
    assert be.images_stood_in[TB_PYTHON].startswith("miles-standin-tb-python:")


@pytest.mark.usefixtures("real_engine")
def test_user_entry_overrides_the_default_family():
    be = backend(pull="never", stand_ins={"python:3.11-*": "debian"})
    res = _exec(be, SandboxSpec(image="python:3.11-slim"), "command -v pip || echo no-pip")
    assert res.stdout.strip() == "no-pip"
    assert be.images_stood_in["python:3.11-slim"].startswith("miles-standin-debian:")
    # and a user entry naming an image
    base = DockerSandboxOptions().stand_in_base
    be = backend(pull="never", stand_ins={"corp/tool:*": base})
    assert run(be.image_for(SandboxSpec(image="corp/tool:7"), "t")) == base
    assert be.images_stood_in == {"corp/tool:7": base}


@pytest.mark.usefixtures("real_engine")
def test_a_present_real_image_is_used_not_the_stand_in(tmp_path: Path):
    real = f"python:3.11-slim-h29test{secrets.token_hex(3)}"  # matches python:*slim*; created and removed here
    base = DockerSandboxOptions().stand_in_base
    subprocess.run([ENGINE, "tag", base, real], check=True, capture_output=True, timeout=60)
    try:
        be = backend(pull="never")
        assert run(be.image_for(SandboxSpec(image=real), "t")) == real
        (tmp_path / "Dockerfile").write_text(f"FROM {real}\nRUN test ! -e /usr/bin/pip\n")
        run(be.image_for(SandboxSpec(build=BuildContext(context_dir=str(tmp_path))), "t"), timeout=600)
        assert be.images_stood_in == {}
        assert be.step_metrics()["sandbox/images_stood_in"] == 0.0
        # pull='always' and the pull fails (no such tag on any registry): the engine's copy, not a stand-in
        be = backend(pull="always")
        assert run(be.image_for(SandboxSpec(image=real), "t")) == real
        assert be.images_stood_in == {}
    finally:
        subprocess.run([ENGINE, "rmi", real], capture_output=True, timeout=60)


@pytest.mark.usefixtures("real_engine")
def test_no_base_and_no_image_is_one_error_naming_both():
    be = backend(pull="never", stand_in_base="miles-no-such-base:x")
    with pytest.raises(SandboxError, match=r"image 'python:3.12-slim' cannot be had \(image 'python:3.12-slim' is not "
                                           r"present on the engine and pull='never'\) and the stand-in base "
                                           r"'miles-no-such-base:x'"):
        run(be.image_for(SandboxSpec(image="python:3.12-slim"), "t"))
    with pytest.raises(SandboxError, match="is not present on the engine and pull='never'"):
        run(be.image_for(SandboxSpec(image="nginx:1.27-h29test"), "t"))  # no pattern: the plain error


@pytest.mark.usefixtures("real_engine")
def test_alpine_is_a_debian_stand_in_with_sh():
    be = backend(pull="never")
    res = _exec(be, SandboxSpec(image="alpine:3.20"), "busybox true && sh -c 'echo sh-ok' && command -v apk || echo no-apk")
    assert res.stdout.split() == ["sh-ok", "no-apk"], res
    assert be.images_stood_in["alpine:3.20"].startswith("miles-standin-alpine:")


@pytest.mark.usefixtures("real_engine")
def test_a_family_that_fails_to_build_is_one_error_naming_it():
    be = backend(pull="never", stand_ins={"corp/app:*": "broken"},
                 stand_in_families={"broken": ["miles-no-such-package-h29"]})
    with pytest.raises(SandboxError) as exc:
        run(be.image_for(SandboxSpec(image="corp/app:1"), "t"), timeout=600)
    msg = str(exc.value)
    assert "building the stand-in family 'broken' (miles-standin-broken:" in msg, msg
    assert "apt-get" in msg and "miles-no-such-package-h29" in msg, msg
    assert be.images_stood_in == {}
