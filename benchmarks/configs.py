"""Benchmark configurations: what a name like `replicate-4-ps-static` means.

On configurations:

| name                    | what trains                                              |
| ----------------------- | -------------------------------------------------------- |
| `single`                | the unwrapped model_fn on one device                     |
| `replicate-N-ps`        | `replicate_model_fn`, N towers, `parameter_server`       |
| `replicate-N-rr`        | `replicate_model_fn`, N towers, `round_robin`            |
| `replicate-N-gather`    | N towers, `replicated`, `all_reduce="gather"`            |
| `replicate-N-ring`      | N towers, `replicated`, `all_reduce="ring"` (collective, |
|                         | TensorFlow's `CollectiveReduceV2`)                       |
| `replicate-N-handring`  | N towers, `replicated`, the ring built from graph ops    |
|                         | that `ring` was before (`benchmarks.hand_ring`)          |
| `replicate-N-nccl`      | N towers, `replicated`, `all_reduce="nccl"` (GPUs only)  |
| `replicate-N-V-sync`    | any replicate configuration above with                   |
|                         | `sync_batch_norm=True`, replicate's default (e.g.        |
|                         | `replicate-2-ps-sync`); without `-sync`, `False`         |
| `mirrored-N-default`    | `MirroredStrategy` over N devices, default cross-device ops |
| `mirrored-N-r1d`        | `MirroredStrategy` with `ReductionToOneDevice`           |

Every configuration trains on the same global batch; under MirroredStrategy
the `input_fn` batch is per replica, so it gets global / N rows.

On pipelines: a configuration reads the `dynamic` pipeline (the path users
take, `.batch(b)`, a partial batch each epoch) unless its name ends in
`-static` (one fixed batch of known shape); see `benchmarks.pipelines`. Under
MirroredStrategy the dynamic pipeline is the same `.batch(b)` without
`drop_remainder`: Estimator hands each replica the next batch in turn, and a
partial one runs as a smaller batch on that replica.

On A/A: a name ending in `-again` (`single-again`) is the same configuration
measured a second time in each repeat under another name; the ratio of the
twins is what the measurement alone moves a ratio by.
"""

import re
from typing import NamedTuple


_CONFIG = re.compile(r"^(?:single|replicate-(\d+)-"
                     r"(ps|rr|gather|ring|handring|nccl)(-sync)?|"
                     r"mirrored-(\d+)-(default|r1d))"
                     r"(-static)?(-again)?$")
CONFIG_FORMS = ("single, replicate-N-ps, replicate-N-rr, replicate-N-gather, "
                "replicate-N-ring, replicate-N-handring, replicate-N-nccl, "
                "mirrored-N-default, mirrored-N-r1d (N a number of towers); "
                "a replicate one may end in -sync (sync_batch_norm=True); "
                "each may then end in -static (the static pipeline) and then "
                "in -again (measured twice, for A/A)")

# A replicate configuration's variant: its replicate_model_fn arguments.
REPLICATE_ARGUMENTS = {
    "ps": {"variable_strategy": "parameter_server"},
    "rr": {"variable_strategy": "round_robin"},
    "gather": {"variable_strategy": "replicated", "all_reduce": "gather"},
    "ring": {"variable_strategy": "replicated", "all_reduce": "ring"},
    # "gather" with its dense sums built by the hand ring
    # (`benchmarks.hand_ring`): see `Config.uses_hand_ring`.
    "handring": {"variable_strategy": "replicated", "all_reduce": "gather"},
    "nccl": {"variable_strategy": "replicated", "all_reduce": "nccl"},
}


class Config(NamedTuple):
  name: str
  kind: str  # "single", "replicate" or "mirrored"
  towers: int
  variant: str  # ps/rr/gather/ring/handring/nccl, or default/r1d mirrored
  pipeline: str = "dynamic"  # or "static"
  is_again: bool = False  # an A/A twin: the configuration measured again
  sync_batch_norm: bool = False  # replicate's sync_batch_norm (else False)

  @property
  def measured(self) -> str:
    """The name of what is measured: the name without `-again`."""
    return self.name[:-len("-again")] if self.is_again else self.name

  @property
  def family(self) -> str:
    """The name without N, pipeline and -again: replicate-ps, mirrored-r1d."""
    if self.kind == "single":
      return "single"
    return "{}-{}{}".format(self.kind, self.variant,
                            "-sync" if self.sync_batch_norm else "")

  @property
  def uses_hand_ring(self) -> bool:
    """Whether the model_fn goes through `hand_ring.with_hand_ring`."""
    return self.kind == "replicate" and self.variant == "handring"

  @property
  def replicate_arguments(self) -> dict:
    """replicate_model_fn's keyword arguments, for a replicate variant."""
    arguments = dict(REPLICATE_ARGUMENTS[self.variant])
    # Explicit either way: True is replicate's default, and a name without
    # -sync means per-tower batch norm (SYNC_BN.md compares the two).
    arguments["sync_batch_norm"] = self.sync_batch_norm
    return arguments


def parse_config(name: str) -> Config:
  """A configuration from its name; a clear error for anything else."""
  match = _CONFIG.match(name)
  if not match:
    raise ValueError("Unknown configuration {!r}; the forms are: {}.".format(
        name, CONFIG_FORMS))
  (replicate_towers, strategy, sync, mirrored_towers, ops, static,
   again) = match.groups()
  options = dict(pipeline="static" if static else "dynamic",
                 is_again=bool(again))
  if name.startswith("single"):
    return Config(name, "single", 1, "", **options)
  towers = int(replicate_towers or mirrored_towers)
  if towers < 1:
    raise ValueError("Configuration {!r} asks for {} towers; use 1 or "
                     "more.".format(name, towers))
  if replicate_towers:
    return Config(name, "replicate", towers, strategy,
                  sync_batch_norm=bool(sync), **options)
  return Config(name, "mirrored", towers, ops, **options)


# The models of `python -m benchmarks` (`benchmarks.models.MODELS`, which
# imports TensorFlow, holds them): here for the command lines, which parse
# before TensorFlow is imported.
MODEL_NAMES = ("mlp", "wide", "convnet", "dnn_classifier", "bn_convnet",
               "bn_convnet_plain")
# What `python -m benchmarks` runs by default (RESULTS.md); the batch-norm
# models are for `sync_batch_norm` (SYNC_BN.md).
DEFAULT_MODELS = ("mlp", "wide", "convnet", "dnn_classifier")


def check_model(name: str) -> None:
  if name not in MODEL_NAMES:
    raise ValueError("Unknown model {!r}; the models are: {}.".format(
        name, ", ".join(MODEL_NAMES)))
