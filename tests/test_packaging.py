"""The distribution: its name, and the warning about the other `replicate`."""

import importlib
import pathlib
import warnings

import pytest

import replicate
from replicate import _identity

API_CLIENT_METADATA = """\
Metadata-Version: 2.1
Name: replicate
Version: 1.0.4
Summary: Python client for Replicate
Author-email: "Replicate, Inc." <team@replicate.com>
Requires-Dist: httpx
"""
OLD_NAME_METADATA = """\
Metadata-Version: 2.4
Name: replicate
Version: 0.1.0
Summary: Train one tf.estimator model_fn on every device of a machine.
"""


def write_distribution(folder, metadata):
  """A `replicate-<version>.dist-info` in `folder`, as pip would leave it."""
  version = metadata.split("Version: ")[1].split()[0]
  info = folder / "replicate-{}.dist-info".format(version)
  info.mkdir()
  (info / "METADATA").write_text(metadata)


def test_the_api_client_installed_beside_it_warns_at_import(tmp_path,
                                                            monkeypatch):
  write_distribution(tmp_path, API_CLIENT_METADATA)
  monkeypatch.syspath_prepend(str(tmp_path))  # where metadata is looked up
  with pytest.warns(UserWarning) as caught:
    importlib.reload(replicate)
  [warning] = [w for w in caught if "Replicate.com" in str(w.message)]
  message = str(warning.message)
  for words in ("the Replicate.com API client (`pip install replicate`), "
                "not this library", "both provide the module `replicate`",
                "Run `pip uninstall replicate`",
                "install this library again as `replicate-model-fn`"):
    assert words in message
  assert pathlib.Path(warning.filename).name == "__init__.py"


def test_this_library_under_its_old_name_is_no_api_client(tmp_path,
                                                         monkeypatch):
  write_distribution(tmp_path, OLD_NAME_METADATA)
  monkeypatch.syspath_prepend(str(tmp_path))
  assert [d.metadata["Version"] for d in importlib.metadata.distributions(
      name="replicate")][0] == "0.1.0"  # the one written, found first
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    importlib.reload(replicate)
  assert not _identity.api_client_installed()


class _Distribution:

  def __init__(self, summary):
    self.metadata = {"Summary": summary}


@pytest.mark.parametrize("summaries, expected", [
    ([], False),
    (["Train one tf.estimator model_fn on every device of a machine."],
     False),
    (["Python client for Replicate"], True),
    ([None], True),  # no summary: not this library
    (["Train one tf.estimator model_fn ...", "Python client for Replicate"],
     True),
])
def test_the_api_client_is_any_replicate_distribution_but_this_one(
    summaries, expected):
  asked = []

  def distributions(name):
    asked.append(name)
    return [_Distribution(summary) for summary in summaries]

  assert _identity.api_client_installed(distributions) is expected
  assert asked == ["replicate"]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _identity.warn_if_api_client(distributions)
  assert [str(w.message) for w in caught] == (
      [_identity.MESSAGE] if expected else [])
