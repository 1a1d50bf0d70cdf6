"""``miles new plugin``: scaffold a plugin distribution that registers like the built-ins.

The package has a ``pyproject.toml`` with an entry point in group ``miles``, a ``plugin.py``
with the ``@hookimpl``, a component with a typed options model, a README and a ``tests/`` file
that runs the kind's contract suite (agents, which have no suite, get an episode test).
"""

from __future__ import annotations

import keyword
import re
import shutil
import tempfile
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from string import Template

from miles_engine.errors import ConfigError

KINDS = ("environment", "sandbox", "reward", "teacher", "agent")
NAME_RE = re.compile(r"^[a-z][a-z0-9]*(?:-[a-z0-9]+)*$")
MAX_NAME = 40


@dataclass(frozen=True)
class PluginNames:
    kind: str
    name: str  # the component's registered name (and the directory's)
    distribution: str
    package: str
    cls: str  # CamelCase stem of the generated classes

    @classmethod
    def of(cls, kind: str, name: str) -> PluginNames:
        if kind not in KINDS:
            raise ConfigError(f"unknown plugin kind '{kind}'; allowed: {', '.join(KINDS)}")
        if not NAME_RE.fullmatch(name) or len(name) > MAX_NAME:
            raise ConfigError(f"plugin name '{name}' is not valid: use lowercase letters, digits and single "
                              f"hyphens, starting with a letter, at most {MAX_NAME} characters (e.g. 'my-{kind}')")
        stem = name.replace("-", "_")
        if keyword.iskeyword(stem):
            raise ConfigError(f"plugin name '{name}' is a Python keyword")
        return cls(kind, name, f"miles-{kind}-{name}", f"miles_{kind}_{stem}",
                   "".join(part.capitalize() for part in name.split("-")))


def render_files(names: PluginNames) -> dict[str, str]:
    """Relative path → file text of the scaffold."""
    templates: dict[str, str] = import_module(f"miles_engine.scaffold.{names.kind}").FILES
    values = {"name": names.name, "kind": names.kind, "distribution": names.distribution,
              "package": names.package, "cls": names.cls}
    files = {path.replace("PACKAGE", names.package): Template(text).substitute(values)
             for path, text in templates.items()}
    files["pyproject.toml"] = Template(PYPROJECT).substitute(values)
    files[f"{names.package}/__init__.py"] = f'"""miles {names.kind} plugin \'{names.name}\'."""\n'
    return files


def scaffold_plugin(kind: str, name: str, dest: Path) -> Path:
    """Write the plugin to ``dest/name`` and return that directory; refuses to overwrite anything.

    The files are written into a temporary directory beside the target and renamed into place,
    so a failure leaves nothing half-written.
    """
    names = PluginNames.of(kind, name)
    dest = Path(dest)
    if not dest.is_dir():
        raise ConfigError(f"--dest '{dest}' is not an existing directory")
    target = dest / name
    if target.exists() or target.is_symlink():
        raise ConfigError(f"'{target}' already exists; refusing to overwrite it (pick another NAME or --dest)")
    files = render_files(names)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=dest))
    try:
        for rel, text in files.items():
            path = staging / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        staging.rename(target)  # atomic; fails if target appeared meanwhile
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


PYPROJECT = """\
[build-system]
requires = ["setuptools>=68", "wheel"]
build-backend = "setuptools.build_meta"

[project]
name = "$distribution"
version = "0.1.0"
description = "miles $kind plugin: $name"
readme = "README.md"
requires-python = ">=3.11"
dependencies = ["miles-engine"]

[project.optional-dependencies]
test = ["pytest", "pytest-timeout"]

# The hub discovers the plugin through this entry point (group `miles`).
[project.entry-points.miles]
$name = "$package.plugin"

[tool.setuptools.packages.find]
include = ["$package*"]

[tool.pytest.ini_options]
addopts = "--import-mode=importlib"
timeout = 300
"""


def readme(extra: str = "") -> str:
    return """\
# $distribution

A miles $kind plugin registering `$name`.

```bash
pip install -e .          # the hub finds it through the `miles` entry point
miles plugins             # lists $name ($kind)
pytest tests              # runs the $kind contract suite against it
```
""" + extra
