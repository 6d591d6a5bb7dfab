"""The distribution: its name, its wheel, and the warning about the other one.

The wheel is built offline (`pip wheel --no-build-isolation`, the setuptools
already installed) from a copy of the checkout, so that setuptools' build/
and egg-info land in a temporary folder, and every module is then imported
from the unpacked wheel alone, in a fresh process.
"""

import importlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import warnings
import zipfile

import pytest

import replicate
from replicate import _identity

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT = 120

API_CLIENT_METADATA = """\
Metadata-Version: 2.1
Name: replicate
Version: 1.0.4
Summary: Python client for Replicate
Author-email: "Replicate, Inc." <team@replicate.com>
Requires-Dist: httpx
"""
OLD_NAME_METADATA = """\
Metadata-Version: 2.4
Name: replicate
Version: 0.1.0
Summary: Train one tf.estimator model_fn on every device of a machine.
"""

# Run in the unpacked wheel's process: imports every module of the package
# and prints where each came from, and the distribution's metadata.
IMPORT_ALL = r"""
import importlib, importlib.metadata, json, pkgutil
import replicate
modules = {"replicate": replicate.__file__}
for found in pkgutil.walk_packages(replicate.__path__, "replicate."):
  modules[found.name] = importlib.import_module(found.name).__file__
metadata = importlib.metadata.metadata("replicate-model-fn")
print(json.dumps({"modules": modules, "name": metadata["Name"],
                  "license": metadata["License"]}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  """The wheel built from a copy of this checkout."""
  source = tmp_path_factory.mktemp("source") / "checkout"
  # Not what other test processes write while this copies (`make test`
  # runs two at once): caches, and Hypothesis' example database.
  shutil.copytree(REPOSITORY, source, ignore=shutil.ignore_patterns(
      ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
      ".pytest_cache", ".hypothesis", "output", "results"))
  output = tmp_path_factory.mktemp("wheel")
  # An absolute path: a bare name would be looked up as a package on PyPI.
  subprocess.run(
      [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
       "--no-build-isolation", "--no-index", "--wheel-dir", str(output),
       str(source)], check=True, timeout=TIMEOUT, capture_output=True)
  [built] = output.glob("*.whl")
  return built


def source_modules():
  """replicate/**/*.py of this checkout, as paths inside a wheel."""
  return {path.relative_to(REPOSITORY).as_posix()
          for path in (REPOSITORY / "replicate").rglob("*.py")}


def test_the_wheel_is_replicate_model_fn_with_every_module(wheel):
  assert wheel.name == "replicate_model_fn-{}-py3-none-any.whl".format(
      replicate.__version__)
  with zipfile.ZipFile(wheel) as archive:
    names = set(archive.namelist())
    info = "replicate_model_fn-{}.dist-info/".format(replicate.__version__)
    metadata = archive.read(info + "METADATA").decode().splitlines()
  modules = source_modules()
  assert "replicate/_identity.py" in modules and len(modules) > 30
  assert modules <= names, "missing from the wheel: {}".format(
      sorted(modules - names))
  # Nothing but the package and its metadata: no tests, benchmarks, examples.
  assert {name.split("/")[0] for name in names} == {"replicate",
                                                    info.rstrip("/")}
  assert info + "LICENSE" in names
  assert "Name: replicate-model-fn" in metadata
  assert "License: Apache-2.0" in metadata
  # The SPDX expression alone: a license classifier beside it is deprecated
  # (setuptools >= 77 prints a page of warnings on every install).
  assert not [line for line in metadata
              if line.startswith("Classifier: License ::")]
  # Extras that install what the wheel uses: TensorFlow's builds only (the
  # examples, which a "demo" extra was for, are not in the wheel).
  assert sorted(line.split(": ")[1] for line in metadata
                if line.startswith("Provides-Extra: ")) == ["cpu", "gpu"]


def test_the_long_description_links_only_to_absolute_addresses(wheel):
  with zipfile.ZipFile(wheel) as archive:
    info = "replicate_model_fn-{}.dist-info/".format(replicate.__version__)
    text = archive.read(info + "METADATA").decode()
  description = text.split("\n\n", 1)[1]
  assert description.startswith("# replicate\n")
  links = re.findall(r"\]\(([^)]+)\)", description)
  assert len(links) >= 10
  prefix = "https://github.com/replicate-model-fn/replicate-model-fn/blob/main/"
  relative = [link for link in links if not link.startswith("https://")]
  assert relative == []
  for link in links:  # each names a file of this checkout (a section too)
    assert link.startswith(prefix), link
    assert (REPOSITORY / link[len(prefix):].split("#")[0]).is_file(), link


def test_every_module_imports_from_the_unpacked_wheel(wheel, tmp_path):
  site = tmp_path / "site"
  with zipfile.ZipFile(wheel) as archive:
    archive.extractall(site)
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  env = {key: value for key, value in os.environ.items()
         if key != "PYTHONPATH"}
  result = subprocess.run(
      [sys.executable, "-c", IMPORT_ALL], cwd=elsewhere, capture_output=True,
      text=True, timeout=TIMEOUT,
      env={**env, "PYTHONPATH": str(site), "TF_CPP_MIN_LOG_LEVEL": "2"})
  assert result.returncode == 0, result.stderr[-3000:]
  found = json.loads(result.stdout.splitlines()[-1])

  assert found["name"] == "replicate-model-fn"
  assert found["license"] == "Apache-2.0"
  expected = {path[:-len(".py")].replace("/", ".").replace(".__init__", "")
              for path in source_modules()}
  assert set(found["modules"]) == expected
  for module, path in found["modules"].items():
    assert pathlib.Path(path).is_relative_to(site), (module, path)


def write_distribution(folder, metadata):
  """A `replicate-<version>.dist-info` in `folder`, as pip would leave it."""
  version = metadata.split("Version: ")[1].split()[0]
  info = folder / "replicate-{}.dist-info".format(version)
  info.mkdir()
  (info / "METADATA").write_text(metadata)


def test_the_api_client_installed_beside_it_warns_at_import(tmp_path,
                                                            monkeypatch):
  write_distribution(tmp_path, API_CLIENT_METADATA)
  monkeypatch.syspath_prepend(str(tmp_path))  # where metadata is looked up
  with pytest.warns(UserWarning) as caught:
    importlib.reload(replicate)
  [warning] = [w for w in caught if "Replicate.com" in str(w.message)]
  message = str(warning.message)
  for words in ("the Replicate.com API client (`pip install replicate`), "
                "not this library", "both provide the module `replicate`",
                "Run `pip uninstall replicate`",
                "install this library again as `replicate-model-fn`"):
    assert words in message
  assert pathlib.Path(warning.filename).name == "__init__.py"


def test_this_library_under_its_old_name_is_no_api_client(tmp_path,
                                                         monkeypatch):
  write_distribution(tmp_path, OLD_NAME_METADATA)
  monkeypatch.syspath_prepend(str(tmp_path))
  assert [d.metadata["Version"] for d in importlib.metadata.distributions(
      name="replicate")][0] == "0.1.0"  # the one written, found first
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    importlib.reload(replicate)
  assert not _identity.api_client_installed()


class _Distribution:

  def __init__(self, summary):
    self.metadata = {"Summary": summary}


@pytest.mark.parametrize("summaries, expected", [
    ([], False),
    (["Train one tf.estimator model_fn on every device of a machine."],
     False),
    (["Python client for Replicate"], True),
    ([None], True),  # no summary: not this library
    (["Train one tf.estimator model_fn ...", "Python client for Replicate"],
     True),
])
def test_the_api_client_is_any_replicate_distribution_but_this_one(
    summaries, expected):
  asked = []

  def distributions(name):
    asked.append(name)
    return [_Distribution(summary) for summary in summaries]

  assert _identity.api_client_installed(distributions) is expected
  assert asked == ["replicate"]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _identity.warn_if_api_client(distributions)
  assert [str(w.message) for w in caught] == (
      [_identity.MESSAGE] if expected else [])


# A copy of the package as pip leaves it, then `replicate/__init__.py` as the
# Replicate.com client's install leaves it (its own) or its uninstall (none).
FAKE_CLIENT_INIT = '''"""The Replicate.com client's module (a stand-in)."""
from replicate.client import Client
default_client = Client()
'''


def _broken_install(folder, how):
  site = folder / "site"
  shutil.copytree(REPOSITORY / "replicate", site / "replicate",
                  ignore=shutil.ignore_patterns("__pycache__"))
  init = site / "replicate" / "__init__.py"
  if how == "overwritten":
    init.write_text(FAKE_CLIENT_INIT)
    (site / "replicate" / "client.py").write_text("class Client:\n  pass\n")
  else:
    init.unlink()
  return site


def _run(site, *arguments):
  env = {key: value for key, value in os.environ.items()
         if key != "PYTHONPATH"}
  return subprocess.run(
      [sys.executable] + list(arguments), cwd=site.parent,
      capture_output=True, text=True, timeout=TIMEOUT,
      env={**env, "PYTHONPATH": str(site), "TF_CPP_MIN_LOG_LEVEL": "3"})


@pytest.mark.parametrize("how, what", [
    ("overwritten", "replicate/__init__.py` at {site}/replicate/__init__.py "
     "is another project's"),
    ("deleted", "replicate/__init__.py` is missing (an empty namespace "
     "package was imported)"),
])
def test_a_broken_install_is_an_import_error_with_the_recipe(tmp_path, how,
                                                             what):
  site = _broken_install(tmp_path, how)
  # The launcher (no TensorFlow) and a module of the library (TensorFlow).
  for arguments in (["-m", "replicate.launch", "--help"],
                    ["-c", "import replicate.model_fn"]):
    result = _run(site, *arguments)
    assert result.returncode == 1, (arguments, result.stdout)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: The package `replicate` in this "
                           "environment is not the library "
                           "`replicate-model-fn`"), (arguments, last)
    assert what.format(site=site) in last
    assert "installed after this library or uninstalled after it" in last
    assert last.endswith(_identity.RECIPE)
  # The warning about the client gives the same recipe.
  assert _identity.MESSAGE.endswith(_identity.RECIPE)
  assert _identity.RECIPE == (
      "Run `pip uninstall replicate`, then install this library again as "
      "`replicate-model-fn` (from its checkout: `pip install '.[cpu]'`).")


def test_the_docs_give_the_recipe_of_the_warning():
  # The README names the other project and links to docs/api.md's
  # "Installing", which gives the symptoms and the recipe.
  readme = " ".join((REPOSITORY / "README.md").read_text().split())
  assert "Replicate.com API client" in readme
  assert "(docs/api.md#installing)" in readme
  api = " ".join((REPOSITORY / "docs" / "api.md").read_text().split())
  assert _identity.RECIPE in api
  assert "AttributeError: module 'replicate' has no attribute" in api


def test_without_tensorflow_import_replicate_names_the_extras(tmp_path):
  # -S: no site-packages, so no TensorFlow, as after `pip install .`.
  result = subprocess.run(
      [sys.executable, "-S", "-c", "import replicate"], cwd=tmp_path,
      capture_output=True, text=True, timeout=TIMEOUT,
      env={**os.environ, "PYTHONPATH": str(REPOSITORY)})
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      "ModuleNotFoundError: " + _identity.NO_TENSORFLOW_MESSAGE)
  for words in ("No module named 'tensorflow'", "pip install '.[cpu]'",
                "pip install '.[gpu]'", "'replicate-model-fn[cpu]'",
                "'replicate-model-fn[gpu]'"):
    assert words in _identity.NO_TENSORFLOW_MESSAGE


def test_import_replicate_imports_no_tensorflow_and_shows_public_names():
  result = subprocess.run(
      [sys.executable, "-c", IMPORT_ONLY], capture_output=True, text=True,
      timeout=TIMEOUT, env={**os.environ, "PYTHONPATH": str(REPOSITORY),
                            "TF_CPP_MIN_LOG_LEVEL": "3"})
  assert result.returncode == 0, result.stderr[-3000:]
  found = json.loads(result.stdout.splitlines()[-1])
  # The contract's names (a name added to it is one line of __init__.py's
  # table, and shows up here without a change).
  public = sorted(replicate.__all__)
  assert {"replicate_model_fn", "TowerOptimizer", "tower_local_scope",
          "loss_denominator", "start_server", "__version__"} <= set(public)
  assert found["before"] == {"tensorflow": False, "dir": public}
  # Every public name resolves (importing TensorFlow), and dir() still shows
  # no sub-package the imports brought in.
  assert found["after"] == {"tensorflow": True, "dir": public}
  assert sorted(found["names"]) == [name for name in public
                                    if name != "__version__"]
  assert found["names"]["TowerOptimizer"] == "class"
  assert found["names"]["replicate_model_fn"] == "function"
  assert found["missing"] == ["AttributeError", "module 'replicate' has no "
                              "attribute 'no_such_name'"]


IMPORT_ONLY = r"""
import inspect, json, sys
import replicate
seen = lambda: {"tensorflow": "tensorflow" in sys.modules,
                "dir": [n for n in dir(replicate) if n in replicate.__all__
                        or not n.startswith("__")]}
before = seen()
names = {name: "class" if inspect.isclass(getattr(replicate, name))
         else "function" for name in replicate.__all__
         if name != "__version__"}
from replicate import replicate_model_fn
try:
  replicate.no_such_name
except AttributeError as error:
  missing = (type(error).__name__, str(error))
print(json.dumps({"before": before, "after": seen(), "names": names,
                  "missing": missing}))
"""
