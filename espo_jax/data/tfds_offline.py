"""Offline TFDS plumbing shared by the builders: a base class and a `prepare` helper.

The builders here generate or read local data only. They are written as
`GeneratorBasedBuilder`s with `file_format="array_record"`, so preparing and reading
(`as_data_source()`, random access) need no TensorFlow and no network.
"""

from __future__ import annotations

import logging
import os

import tensorflow_datasets as tfds
from etils import epath

from espo_jax import console


class OfflineBuilder(tfds.core.GeneratorBasedBuilder):
    """A `GeneratorBasedBuilder` that never downloads.

    `code_path` is overridden because TFDS 4.9.10 locates a builder's source through
    `importlib_resources`, a package it does not declare for Python >= 3.9; the file path of the
    subclass is what it would find anyway.
    """

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:  # noqa: D102
        import inspect

        return epath.Path(inspect.getfile(cls))

    # TFDS prints (not logs) a "Downloading and preparing dataset Unknown size" banner and a
    # "downloaded and prepared" line; nothing is downloaded here, so the log file says it.
    def _log_download_bytes(self) -> None:
        logging.info("preparing dataset %s (generated locally, nothing downloaded) in %s",
                     self.name, self.data_dir, extra=console.FILE_ONLY)

    def _log_download_done(self) -> None:
        logging.info("dataset %s prepared in %s", self.name, self.data_dir,
                     extra=console.FILE_ONLY)


def prepare(builder_cls: type[OfflineBuilder], data_dir: str | os.PathLike, config=None,
            ) -> OfflineBuilder:
    """Builds (once) and returns `builder_cls` under `data_dir` as ArrayRecord files.

    A second call with the same config reuses the prepared files.
    """
    kwargs = {} if config is None else {"config": config}
    if config is not None and config.name in {c.name for c in builder_cls.BUILDER_CONFIGS}:
        # TFDS refuses a config object named like a built-in one; names here are content
        # digests, so the same name is the same content: select the built-in by name.
        kwargs = {"config": config.name}
    builder = builder_cls(data_dir=os.fspath(data_dir), file_format="array_record", **kwargs)
    try:
        # `data_path.exists()` is what `download_and_prepare` tests; `is_prepared()` would warn
        # "has no dataset_info.json" for a dataset not yet prepared.
        if console.is_quiet() and not builder.data_path.exists():
            tfds.disable_progress_bar()  # the main job's quiet console
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    except FileExistsError:
        # Another process (a learner and its workers starting together) finished preparing
        # the same dataset first: its files are complete (TFDS renames them into place last).
        builder = builder_cls(data_dir=os.fspath(data_dir), file_format="array_record",
                              **kwargs)
        if not builder.is_prepared():
            raise
    return builder
