"""This library's distribution is `replicate-model-fn`, not `replicate`.

`pip install replicate` installs the client of the Replicate.com API, an
unrelated project that also provides the module `replicate`. With both in
one environment, `import replicate` loads one of them, or a mix of their
files. `replicate/__init__.py` calls `warn_if_api_client()`, so that such an
environment says so at import time, with the fix.

Both share one file, `replicate/__init__.py`. Installing the API client
after this library overwrites it with the client's, and uninstalling the
client deletes it: `import replicate` then loads the client, or an empty
namespace package, and `replicate.replicate_model_fn` is an AttributeError
that none of this library's code can see. Every other module of the library
can: importing this one (as `replicate._tf` and `replicate.launch` do) checks
that the package `replicate` is this library's, or raises ImportError with
the same fix (`check_package`).

`import replicate` also checks, without importing it, that TensorFlow is
installed: `pip install .` without the `cpu` or `gpu` extra installs none.

Up to 0.1.0 this library's own setup.py said `name="replicate"` too; an
install of it from then is told apart by its summary and not warned about.
"""

import importlib.metadata
import importlib.util
import sys
import warnings

DISTRIBUTION = "replicate-model-fn"
_API_CLIENT = "replicate"
# A word of this library's summary (setup.py's `description`) that tells an
# install of it under its old name apart from the API client.
_OWN_SUMMARY = "model_fn"

# The fix for every mix of the two, quoted by the README: the uninstall
# removes the shared `replicate/__init__.py`, the reinstall puts it back.
RECIPE = (
    "Run `pip uninstall replicate`, then install this library again as `{}` "
    "(from its checkout: `pip install '.[cpu]'`).".format(DISTRIBUTION))

MESSAGE = (
    "The distribution 'replicate' is installed in this environment: that is "
    "the Replicate.com API client (`pip install replicate`), not this "
    "library, and both provide the module `replicate`, so `import "
    "replicate` may load either one or a mix of both. " + RECIPE)

BROKEN_MESSAGE = (
    "The package `replicate` in this environment is not the library `{}`: "
    "its `replicate/__init__.py` {{}}, which happens when the Replicate.com "
    "API client (`pip install replicate`), which provides a module "
    "`replicate` too, is installed after this library or uninstalled after "
    "it. " + RECIPE).format(DISTRIBUTION)

NO_TENSORFLOW_MESSAGE = (
    "No module named 'tensorflow': replicate needs TensorFlow 2.15, which "
    "`{}` installs only through an extra. From its checkout run `pip install "
    "'.[cpu]'` on a CPU-only machine, or `pip install '.[gpu]'` for "
    "TensorFlow with CUDA (or `pip install 'replicate-model-fn[cpu]'` / "
    "`'replicate-model-fn[gpu]'` from a package index).".format(DISTRIBUTION))


def check_tensorflow_installed(find_spec=importlib.util.find_spec):
  """Raises ModuleNotFoundError, naming the extras, if TensorFlow is absent.

  It looks TensorFlow up without importing it (its version is checked when
  it is imported, by `replicate._tf`).
  """
  if find_spec("tensorflow") is None:
    raise ModuleNotFoundError(NO_TENSORFLOW_MESSAGE, name="tensorflow")


def check_package(package=None):
  """Raises ImportError unless `package` is this library's `replicate`.

  `package` defaults to `sys.modules["replicate"]`. This library's
  `replicate/__init__.py` sets `__distribution__` first of all.
  """
  if package is None:
    package = sys.modules.get("replicate")
  if getattr(package, "__distribution__", None) == DISTRIBUTION:
    return
  if getattr(package, "__file__", None) is None:
    what = "is missing (an empty namespace package was imported)"
  else:
    what = "at {} is another project's".format(package.__file__)
  raise ImportError(BROKEN_MESSAGE.format(what))


def api_client_installed(distributions=None):
  """Whether a distribution named `replicate` that is not this one is here.

  `distributions` defaults to `importlib.metadata.distributions`, looked up
  at each call (tests give other metadata).
  """
  found = (distributions or importlib.metadata.distributions)(name=_API_CLIENT)
  return any(_OWN_SUMMARY not in (each.metadata["Summary"] or "")
             for each in found)


def warn_if_api_client(distributions=None):
  """Warns (UserWarning) if the Replicate.com API client is installed too."""
  if api_client_installed(distributions):
    warnings.warn(MESSAGE, UserWarning, stacklevel=2)


# Any module of the library other than `replicate/__init__.py` (which imports
# this one first) finds out here whether it was imported from a broken
# install, before it goes on.
check_package()
