"""Packaging: the distribution `replicate-model-fn`, the import package `replicate`.

Install from a checkout with `pip install '.[cpu]'` (or `'.[gpu]'`). The
distribution is not called `replicate`: on PyPI that name is the unrelated
Replicate.com API client, which also provides a module `replicate` (the
package warns at import if it finds it; see replicate/_identity.py).
"""

import pathlib
import re

import setuptools

_HERE = pathlib.Path(__file__).parent
_VERSION = re.search(r'^__version__ = "([^"]+)"',
                     (_HERE / "replicate" / "__init__.py").read_text(),
                     re.MULTILINE).group(1)
_URL = "https://github.com/replicate-model-fn/replicate-model-fn"
# A link of the README to a file of the repository (`docs/api.md`), made
# absolute for the package index, where relative links lead nowhere.
_RELATIVE_LINK = re.compile(r"\]\((?!https?://|#)([^)\s]+)\)")


def long_description():
  """The README, its links to the repository's files made absolute."""
  return _RELATIVE_LINK.sub(
      lambda link: "]({}/blob/main/{})".format(_URL, link.group(1)),
      (_HERE / "README.md").read_text())


setuptools.setup(
    name="replicate-model-fn",
    version=_VERSION,
    description=("Train one tf.estimator model_fn on every device of a "
                 "machine: towers, one update per step."),
    long_description=long_description(),
    long_description_content_type="text/markdown",
    author="The replicate authors",
    # An SPDX expression, the only statement of the license: a "License ::"
    # classifier beside it makes setuptools >= 77 print a page of
    # deprecation warnings on every install.
    license="Apache-2.0",
    url=_URL,
    project_urls={
        "Source": _URL,
        "Issues": _URL + "/issues",
        "Changelog": _URL + "/blob/main/CHANGELOG.md",
    },
    keywords=["tensorflow", "estimator", "model_fn", "multi-gpu",
              "data-parallel", "towers", "distributed-training",
              "parameter-server"],
    # Every package under replicate/, so a sub-package added later ships too.
    packages=setuptools.find_packages(include=["replicate", "replicate.*"]),
    python_requires=">=3.11,<3.12",
    install_requires=["tensorflow-estimator==2.15.*", "six"],
    extras_require={
        # TensorFlow comes through an extra, so a machine keeps the build it
        # has (CPU-only or with CUDA).
        "cpu": ["tensorflow-cpu==2.15.*"],
        "gpu": ["tensorflow[and-cuda]==2.15.*"],
        # No "demo" extra: the examples are not in the wheel; a checkout
        # runs them with requirements-test.txt (`make demo`).
    },
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: Software Development :: Libraries :: Python Modules",
    ],
)
