"""replicate: train one Estimator `model_fn` on every device of a machine.

```python
estimator = tf.estimator.Estimator(
    model_fn=replicate.replicate_model_fn(model_fn), ...)
```
with the `model_fn`'s optimizer wrapped in `replicate.TowerOptimizer`.

The distribution is `replicate-model-fn`; `pip install replicate` is the
unrelated Replicate.com API client (see `replicate._identity`).

`import replicate` checks that TensorFlow is installed but does not import
it: each public name below imports its module, and so TensorFlow, the first
time it is used (PEP 562), so that `python -m replicate.launch`, which needs
no TensorFlow, starts at once. TensorFlow's version is checked when it is
imported (by `replicate._tf`), or at once if it was imported before.
"""

# Read by replicate._identity: this file is this library's, not the API
# client's (whose install may overwrite it).
__distribution__ = "replicate-model-fn"

import sys as _sys  # noqa: E402

from replicate import _identity  # noqa: E402

# First, so that a mix of the two `replicate`s says so before it breaks.
_identity.warn_if_api_client()
_identity.check_tensorflow_installed()
if "tensorflow" in _sys.modules:
  # TensorFlow is imported already (`import tensorflow as tf` first, as
  # usual): its version is checked now, as on its first use otherwise.
  from replicate import _tf  # noqa: F401,E402  pylint: disable=unused-import

__version__ = "0.1.0"

# Every public name, with the module that defines it: one line a name.
_PUBLIC = {
    "replicate_model_fn": "replicate.model_fn",
    "TowerOptimizer": "replicate.gradients.optimizer",
    "tower_local_scope": "replicate.variables.tower_local",
    "loss_denominator": "replicate.gradients.weighting",
    "start_server": "replicate.cluster.server",
    "all_rows": "replicate.towers.all_rows",
    "row_offset": "replicate.towers.all_rows",
    "rows_apart": "replicate.graph.declared",
    "check": "replicate.check",
}

__all__ = list(_PUBLIC) + ["__version__"]


def __getattr__(name):
  """Imports a public name's module the first time the name is used."""
  if name not in _PUBLIC:
    raise AttributeError("module 'replicate' has no attribute {!r}".format(
        name))
  import importlib  # pylint: disable=import-outside-toplevel
  value = getattr(importlib.import_module(_PUBLIC[name]), name)
  globals()[name] = value  # later uses skip this function
  return value


def __dir__():
  """The public names only, not the sub-packages imported so far."""
  return sorted(__all__)
