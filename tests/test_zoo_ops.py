"""Every op type on the rows' path in the zoo is known to the rows rule.

`replicate.shard.rows_meet` fails closed: an op type on the path from tower
0's rows to the loss that it does not know is refused (off that path it
is computed on the whole batch's rows). Every model of the zoo (canned estimators included), wrapped on 2
towers in TRAIN, EVAL and PREDICT, must therefore build: graphs only, no
session (about half a minute for the whole zoo). A model the oracle expects
to be refused for another reason (oracle_harness.EXPECTED_REFUSALS) is
refused with that reason, before the rows rule runs.
"""

import os
import re
import sys
import tempfile

import pytest
import tensorflow as tf

# The zoo's modules, as tests/oracle/test_oracle.py imports them; here, so
# that `make test-oracle`'s two shards do not both run this file.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracle"))
# pylint: disable=wrong-import-position
import oracle_harness as harness  # noqa: E402
import oracle_pipelines  # noqa: E402
from oracle_zoo import ROWS, ZOO  # noqa: E402
from replicate.graph import op_types, row_ops, row_rules
from replicate.shard import rows_meet

_MODES = {"train": tf.estimator.ModeKeys.TRAIN,
          "eval": tf.estimator.ModeKeys.EVAL,
          "predict": tf.estimator.ModeKeys.PREDICT}


def _build(model, mode):
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    estimator = model.build(tempfile.mkdtemp(), harness.run_config(2),
                            {"variable_strategy": "parameter_server"})
    make, _, _ = oracle_pipelines.input_fn("batch", model, ROWS, ROWS,
                                           mode)
    batch = tf.compat.v1.data.make_one_shot_iterator(make()).get_next()
    features, labels = batch if isinstance(batch, tuple) else (batch, None)
    estimator.model_fn(features, labels, _MODES[mode], estimator.config)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_op_type_on_the_rows_path_is_known(name, monkeypatch):
  checked, asked = [], set()
  check, known = rows_meet.check, row_ops.keeps_rows_apart

  def recording_check(context, spec, *args, **kwargs):
    checked.append(spec.mode)
    return check(context, spec, *args, **kwargs)

  def recording_known(op_type):
    asked.add(op_type)
    return known(op_type)

  monkeypatch.setattr(rows_meet, "check", recording_check)
  monkeypatch.setattr(row_ops, "keeps_rows_apart", recording_known)
  for mode in _MODES:
    refusal = harness.expected_refusal(
        harness.Cell(name, "batch", "2", "parameter_server", mode))
    if refusal is not None:
      with pytest.raises(ValueError, match=re.escape(refusal)):
        _build(ZOO[name], mode)
      continue
    _build(ZOO[name], mode)  # an unknown op type would be refused here
    assert checked and checked[-1] == _MODES[mode]
  # Every type behind the outputs, and inside the functions they call; a
  # Python function only metrics read (a corpus score) is not refused but
  # computed on the whole batch's rows (replicate/outputs/metric_rows.py).
  assert asked <= row_ops.KEEPS_ROWS_APART | set(
      row_rules.ROW_COMBINING) | op_types.PY_FUNC_TYPES
