"""replicate: train one Estimator `model_fn` on every device of a machine.

```python
estimator = tf.estimator.Estimator(
    model_fn=replicate.replicate_model_fn(model_fn), ...)
```
with the `model_fn`'s optimizer wrapped in `replicate.TowerOptimizer`.

The distribution is `replicate-model-fn`; `pip install replicate` is the
unrelated Replicate.com API client (see `replicate._identity`).
"""

from replicate import _identity

# First, so that a mix of the two `replicate`s says so before it breaks.
_identity.warn_if_api_client()

from replicate.model_fn import replicate_model_fn  # noqa: E402
from replicate.gradients.optimizer import TowerOptimizer  # noqa: E402
from replicate.variables.tower_local import tower_local_scope  # noqa: E402
from replicate.gradients.weighting import loss_denominator  # noqa: E402
from replicate.cluster.server import start_server  # noqa: E402
from replicate.towers.all_rows import all_rows, row_offset  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "replicate_model_fn", "TowerOptimizer", "tower_local_scope",
    "loss_denominator", "start_server", "all_rows", "row_offset",
    "__version__"
]
