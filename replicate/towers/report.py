"""What a wrapped `model_fn` call says about the towers it builds.

On the lines: one INFO line per call (how many towers, on which devices,
which strategy), and a WARNING when one tower trains on a machine that has
more devices than the Estimator's session sees, with the fix: the usual
surprise is a CPU-only machine, whose cores TensorFlow counts as one device
unless the session config asks for more. With `sync_batch_norm=False`, one
more INFO line per TRAIN call names the batch-norm layers each tower
normalizes with its own shard's moments (none: no line), since their
training differs from one device's.
"""

import os
from typing import Optional, Sequence

import tensorflow as tf


def log_towers(tower_devices: Sequence[str], variable_strategy: str,
               mode: str, config) -> None:
  """One INFO line for the towers a call builds, and a WARNING for one tower
  on a machine that has more devices than the Estimator's session sees.

  `config` is the Estimator's RunConfig when the towers were chosen from its
  session's devices (no `devices` argument, no cluster), else None.
  """
  tf.compat.v1.logging.info(
      "replicate: %d tower%s (%s) on %s, variable_strategy=%r.",
      len(tower_devices), "" if len(tower_devices) == 1 else "s", mode,
      ", ".join(tower_devices), variable_strategy)
  if config is None or len(tower_devices) > 1 or mode != "train":
    return
  hint = _one_tower_hint(config.session_config)
  if hint:
    tf.compat.v1.logging.warning(
        "replicate: 1 tower, on %s: %s For one tower on purpose, pass "
        "devices=[%r] to replicate_model_fn.", tower_devices[0], hint,
        tower_devices[0])


def _one_tower_hint(session_config) -> Optional[str]:
  """Why a session sees one device where the machine has more, and the fix."""
  gpus = tf.config.list_physical_devices("GPU")  # allocates no memory
  if len(gpus) > 1:
    return ("this machine has {} GPUs but the session sees one; check "
            "the RunConfig's session_config (gpu_options.visible_device_list, "
            "device_count) and CUDA_VISIBLE_DEVICES.".format(len(gpus)))
  cores = os.cpu_count() or 1
  if not gpus and cores > 1:
    return ("this machine has no GPU and {} CPU cores, which TensorFlow "
            "counts as one device. For towers on CPU cores, give the "
            "Estimator tf.estimator.RunConfig(session_config=tf.compat.v1."
            "ConfigProto(device_count={{'CPU': {}}})).".format(cores, cores))
  return None


def log_per_tower_batch_norm(labels: Sequence[str], num_towers: int) -> None:
  """One INFO line naming the batch norms normalized per tower, if any."""
  if not labels:
    return
  tf.compat.v1.logging.info(
      "replicate: sync_batch_norm=False: %d batch-norm layer%s normalized "
      "per tower, each of the %d towers with its own shard's moments (not "
      "one device's; sync_batch_norm=True, the default, uses the whole "
      "batch's): %s.", len(labels), "" if len(labels) == 1 else "s",
      num_towers, ", ".join(labels))
