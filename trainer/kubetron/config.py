"""The trainer's run configuration: the contract's schema (kubetron.contract.config: sections, overrides,
validation, `derive`) extended with what reads the place the trainer runs.

This module defines only the trainer's side: `ConfigContainer` and `TokenizerConfig` (subclasses of the
contract's) and `load_yaml_file`. Everything else of the schema (the other sections, `apply_overrides`,
`parse_data_path`, `config_reference_markdown`, ...) is imported from kubetron.contract.config itself.

`ConfigContainer.from_yaml(path, overrides)` reads the YAML file; `finalize(world_size)` is the one
entry the trainer calls at start: the contract's pure `derive(world_size)`, then `resolve()`, which
reads a file-based tokenizer's vocabulary (from the pod's volume or S3), the KUBETRON_* environment
defaults and the logger's optional packages, and checks the input paths exist. The operator imports
the schema only, and runs `derive` at admission.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Self

import yaml
from pydantic import Field

from kubetron.contract import config as schema
from kubetron.contract.config import apply_overrides, is_remote, parse_data_path
from kubetron.contract.errors import ConfigError


class TokenizerConfig(schema.TokenizerConfig):
    """The contract's tokenizer section, which here can read a file-based tokenizer's files."""

    def base_vocab_size(self) -> int:
        """The tokenizer's own vocabulary size, before padding (file-based tokenizers read their files)."""
        if not self.file_based:
            return super().base_vocab_size()
        from kubetron.data.tokenizer import build_tokenizer

        return build_tokenizer(self).vocab_size


class ConfigContainer(schema.ConfigContainer):
    """The contract's ConfigContainer, resolved where the trainer runs."""

    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="The tokenizer.")

    @classmethod
    def from_yaml(cls, path: str | None, overrides: list[str] | tuple[str, ...] = (),
                  check_paths: bool = True) -> Self:
        """Load `path` (None: defaults only), apply overrides, validate, check the input paths exist."""
        data = load_yaml_file(path) if path else {}
        data = apply_overrides(data, overrides)
        cfg = cls.from_dict(data)
        if check_paths:
            cfg.check_paths()
        return cfg

    def finalize(self, world_size: int = 1, cuda_available: bool | None = None,
                 environ: Mapping[str, str] | None = None, check_paths: bool = True) -> Self:
        """`derive(world_size, cuda_available)` then `resolve(environ, check_paths)`: what the trainer runs
        at start (idempotent); returns self."""
        self.derive(world_size, cuda_available)
        return self.resolve(environ, check_paths)

    def resolve(self, environ: Mapping[str, str] | None = None, check_paths: bool = True) -> Self:
        """The trainer's side of finalize(), after derive(): what reads the files, S3 objects, environment and
        packages of the place the trainer runs. A file-based tokenizer's vocabulary (model.vocab_size),
        the KUBETRON_* defaults from `environ` (default os.environ), the logger's optional packages and,
        with `check_paths`, the local input paths. Returns self."""
        if self.tokenizer.file_based:
            self.derive_vocab_size()
        self._resolve_environ(os.environ if environ is None else environ)
        for key, module in (("wandb_project", "wandb"), ("mlflow_experiment", "mlflow")):
            if getattr(self.logger, key) and importlib.util.find_spec(module) is None:
                raise ConfigError(f"logger.{key}", f"needs the {module} package: pip install 'kubetron[{module}]'")
        self.validate()
        if check_paths:
            self.check_paths()
        return self

    def _resolve_environ(self, env: Mapping[str, str]) -> None:
        """The defaults docs/CONTRACT.md lets the pod's environment supply."""
        t, c = self.train, self.checkpoint
        if c.expected_resume_iteration is None and env.get("KUBETRON_EXPECTED_ITERATION", "").strip():
            raw = env["KUBETRON_EXPECTED_ITERATION"].strip()
            try:
                c.expected_resume_iteration = int(raw)
            except ValueError:
                raise ConfigError("checkpoint.expected_resume_iteration",
                                  f"env KUBETRON_EXPECTED_ITERATION={raw!r} is not an integer") from None
            if c.expected_resume_iteration < 0:
                raise ConfigError("checkpoint.expected_resume_iteration",
                                  f"env KUBETRON_EXPECTED_ITERATION={raw!r} is negative")
        if t.status_port is None and env.get("KUBETRON_STATUS_PORT", "").strip():
            raw = env["KUBETRON_STATUS_PORT"].strip()
            try:
                port = int(raw)
            except ValueError:
                port = -1
            if not 0 <= port <= 65535:
                raise ConfigError("train.status_port", f"env KUBETRON_STATUS_PORT={raw!r} is not a port number")
            t.status_port = port
        if t.termination_log is None:
            from kubetron.supervisor.termination_log import termination_log_path

            t.termination_log = termination_log_path(None, env)

    def check_paths(self) -> None:
        """Inputs on the local filesystem exist: dataset prefixes, pretrained checkpoint, required load."""
        d, c = self.dataset, self.checkpoint
        for name, paths in (("data_path", d.data_path), *((f"{k}_data_path", v) for k, v in d.blends().items())):
            for _, prefix in parse_data_path(paths, f"dataset.{name}") if paths is not None else ():
                if is_remote(prefix):
                    continue
                missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
                if missing:
                    names = " and ".join(prefix + e for e in missing)
                    raise ConfigError(f"dataset.{name}", f"{prefix!r}: missing {names}")
        for name in ("data_path", "valid_data_path"):
            value = getattr(self.finetuning, name)
            for path in [value] if isinstance(value, str) else value or ():
                if not (is_remote(path) or any(c in path for c in "*?[") or os.path.exists(path)):
                    raise ConfigError(f"finetuning.{name}", f"{path}: no such file or directory")
        if c.pretrained_checkpoint and not is_remote(c.pretrained_checkpoint) \
                and not os.path.exists(c.pretrained_checkpoint):
            raise ConfigError("checkpoint.pretrained_checkpoint", f"{c.pretrained_checkpoint}: no such directory")
        if c.load and c.exit_on_missing_checkpoint and not is_remote(c.load) and not os.path.isdir(c.load):
            raise ConfigError("checkpoint.load", f"{c.load}: no such directory (exit_on_missing_checkpoint is set)")


def load_yaml_file(path: str) -> dict:
    """The YAML mapping in `path` (an empty file is {}); errors name `--config`."""
    if not os.path.exists(path):
        raise ConfigError("--config", f"{path}: no such file")
    if os.path.isdir(path):
        raise ConfigError("--config", f"{path}: is a directory, expected a YAML file")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError("--config", f"{path}: invalid YAML{where}: {problem}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("--config", f"{path}: cannot read: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("--config", f"{path}: expected a mapping of sections, got {type(data).__name__}")
    return data


__all__ = [
    "ConfigContainer",
    "TokenizerConfig",
    "load_yaml_file",
]
