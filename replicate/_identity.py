"""This library's distribution is `replicate-model-fn`, not `replicate`.

`pip install replicate` installs the client of the Replicate.com API, an
unrelated project that also provides the module `replicate`. With both in
one environment, `import replicate` loads one of them, or a mix of their
files. `replicate/__init__.py` calls `warn_if_api_client()`, so that such an
environment says so at import time, with the fix.

Up to 0.1.0 this library's own setup.py said `name="replicate"` too; an
install of it from then is told apart by its summary and not warned about.
"""

import importlib.metadata
import warnings

DISTRIBUTION = "replicate-model-fn"
_API_CLIENT = "replicate"
# A word of this library's summary (setup.py's `description`) that tells an
# install of it under its old name apart from the API client.
_OWN_SUMMARY = "model_fn"

MESSAGE = (
    "The distribution 'replicate' is installed in this environment: that is "
    "the Replicate.com API client (`pip install replicate`), not this "
    "library, and both provide the module `replicate`, so `import "
    "replicate` may load either one or a mix of both. Run `pip uninstall "
    "replicate`, then install this library again as `{}` (from its "
    "checkout: `pip install '.[cpu]'`).".format(DISTRIBUTION))


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
