"""Tests of `python -m benchmarks.build_time`: its arithmetic, and that the
Transformer it builds has the padding removal it is meant to measure."""

import pytest

from benchmarks import build_time


def test_the_table_divides_by_n_unwrapped_builds():
  # 2 towers in 3.0 s against 1.0 s unwrapped: 3.0 / (2 * 1.0) = 1.50;
  # 180 ops against 100: 180 / 200 = 0.90.
  text = build_time.table([("tiny", 2, 3.0, 180, 1.0, 100)])
  assert text.splitlines()[-1] == "| tiny | 2 | 3.00 | 2.00 | 1.50 | 0.90 |"


@pytest.mark.parametrize("ffn_pad, removals", [(True, 2), (False, 0)])
def test_the_encoder_runs_its_ffn_on_real_tokens_only(ffn_pad, removals):
  # tiny: 2 encoder layers, each with one gather_nd and one scatter_nd.
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from benchmarks import transformer_model  # pylint: disable=import-outside-toplevel
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.get_or_create_global_step()
    inputs = tf.compat.v1.placeholder(tf.int32, [None, None])
    transformer_model.model_fn(
        {"inputs": inputs}, tf.compat.v1.placeholder(tf.int32, [None, None]),
        tf.estimator.ModeKeys.TRAIN,
        transformer_model.params_of("tiny", allow_ffn_pad=ffn_pad))
    types = [op.type for op in graph.get_operations()
             if "gradients" not in op.name]
  assert types.count("ScatterNd") == removals
  assert types.count("GatherNd") == removals
