"""The benchmark's expected failure, told in one line instead of TensorFlow's.

One cell of the default grid fails every time: MirroredStrategy's default
(collective) all-reduce on the DNNClassifier's dynamic pipeline (see
`benchmarks.__main__`). Its row still says it failed, with TensorFlow's
cause; but TensorFlow's C++ runtime also writes its own E-level lines
(`... E tensorflow/core/...`) straight to file descriptor 2 as the
collective aborts, where `TF_CPP_MIN_LOG_LEVEL`, read once at import, can no
longer be raised. So that cell runs with descriptor 2 captured
(`captured_stderr`); if it failed as expected, TensorFlow's E-level lines are
dropped and the rest is written back (`error_lines`), and the run prints one
line with the reason (`WHY`). Any other outcome writes back all it caught.
"""

import contextlib
import os
import re
import sys
import tempfile
from typing import List, Optional, Tuple

# What TensorFlow's error says, and why it is expected.
CAUSE = "Shape mismatch in the collective instance"
WHY = ("MirroredStrategy's collective all-reduce needs the same shape on "
       "every replica, and the hashed embedding column's gradient is "
       "IndexedSlices of a different length on each")
# An E-level line: TensorFlow's C++ log (`2026-11-27 02:45:37.123456: E
# tensorflow/...`, or glog's `E1127 02:45:37.123 ...`) or its Python
# logger's (`ERROR:tensorflow:...`, `E1127 ... ]` through absl).
_ERROR_LINE = re.compile(r"^(?:\S+ \S+: E |E\d{4} |ERROR:tensorflow:)")


def is_expected(model: str, config) -> bool:
  """Whether `config` on `model` is the cell that fails by design."""
  return (model == "dnn_classifier" and config.kind == "mirrored" and
          config.variant == "default" and config.pipeline == "dynamic" and
          config.towers > 1)


def failed_as_expected(model: str, config, cause: Optional[str]) -> bool:
  """Whether a cell's failure (`cause`, or None) is the expected one."""
  return bool(cause) and is_expected(model, config) and CAUSE in cause


def error_lines(text: str) -> Tuple[str, int]:
  """`text` without its E-level lines, and how many were dropped."""
  lines = text.splitlines(keepends=True)
  kept = [line for line in lines if not _ERROR_LINE.match(line)]
  return "".join(kept), len(lines) - len(kept)


@contextlib.contextmanager
def captured_stderr():
  """Descriptor 2 (C++ and Python alike) into a list's one string.

  Yields an empty list; on exit, descriptor 2 is restored and the list
  holds what was written meanwhile. The caller writes back what it keeps
  (`write_back`).
  """
  caught: List[str] = []
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode="w+b") as sink:
    os.dup2(sink.fileno(), 2)
    try:
      yield caught
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      sink.seek(0)
      caught.append(sink.read().decode("utf-8", "replace"))


def write_back(text: str) -> None:
  """Writes captured text to stderr, as it would have appeared."""
  if text:
    sys.stderr.write(text)
    sys.stderr.flush()
