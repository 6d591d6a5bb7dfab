"""replicate: train one Estimator `model_fn` on every device of a machine.

```python
estimator = tf.estimator.Estimator(
    model_fn=replicate.replicate_model_fn(model_fn), ...)
```
with the `model_fn`'s optimizer wrapped in `replicate.TowerOptimizer`.
"""

from replicate.model_fn import replicate_model_fn
from replicate.gradients.optimizer import TowerOptimizer
from replicate.variables.tower_local import tower_local_scope
from replicate.gradients.weighting import loss_denominator

__version__ = "0.1.0"

__all__ = [
    "replicate_model_fn", "TowerOptimizer", "tower_local_scope",
    "loss_denominator", "__version__"
]
