"""The package as installed: its version has one source, and the public names exist."""
import importlib.metadata
import json
import pathlib
import re
import tomllib

import pytest

import tabby

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_version_is_a_release_string():
    assert isinstance(tabby.__version__, str)
    assert re.fullmatch(r"\d+\.\d+\.\d+([a-z]+\d+)?", tabby.__version__), tabby.__version__


def test_pyproject_reads_the_version_from_the_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in project["project"].get("dynamic", []) and "version" not in project["project"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "tabby.__version__"
    expand = pytest.importorskip("setuptools.config.expand")
    # what setuptools writes into the distribution's metadata when it builds the package
    assert expand.read_attr(attr, root_dir=ROOT) == tabby.__version__


def test_installed_metadata_matches():
    try:
        dist = importlib.metadata.distribution("tabby")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("tabby is not installed (run from the source tree)")
    # an install of this checkout: editable (its record names this folder) or the metadata that
    # the editable build leaves beside the package
    direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
    here = direct_url.get("url") == ROOT.as_uri() or pathlib.Path(dist.locate_file("")).resolve() == ROOT
    if not here:
        pytest.skip(f"the installed tabby is not this checkout ({dist.locate_file('')})")
    assert dist.version == tabby.__version__


def test_public_names():
    for name in tabby.__all__:
        assert hasattr(tabby, name), name
    assert {"moe", "moe_reference", "MoEConfig", "Tuning", "check_errors", "free_workspaces", "MoEInputError",
            "TabbyDeviceError", "MoEDims", "check_inputs", "__version__"} <= set(tabby.__all__)
