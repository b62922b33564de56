"""The Ray workers' environment: ``rl_config.runtime_env_path`` (the seed's
``configs/envs/runtime_env.yaml``) read once, when the plan is built, so that a bad file stops
``posttrain plan`` too."""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from posttrain.config.run import RunConfig
from posttrain.errors import ConfigError
from posttrain.paths import shipped_file

log = logging.getLogger(__name__)


def runtime_env_vars(cfg: RunConfig) -> dict[str, str]:
    """The ``env_vars`` of ``rl_config.runtime_env_path`` (relative paths from the current directory,
    then the configs folders: :func:`posttrain.paths.shipped_file`), plus ``HCCL_BUFFSIZE`` (the
    seed's ``rl_config.hccl_buffersize``)."""
    env: dict[str, str] = {}
    path = Path(cfg.rl.runtime_env_path)
    found = shipped_file(path)
    found = found if found.is_file() else None
    if found is None:
        log.warning("rl_config.runtime_env_path %s not found; the workers get no extra env_vars", path)
    else:
        try:
            data = yaml.safe_load(found.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{found} (rl_config.runtime_env_path): not valid YAML ({err})") from None
        if not isinstance(data, dict) or not isinstance(data.get("env_vars", {}), dict):
            raise ConfigError(f"{found}: expected a mapping with an 'env_vars' mapping (name: value)")
        env.update({str(k): str(v) for k, v in (data.get("env_vars") or {}).items()})
    env["HCCL_BUFFSIZE"] = str(cfg.rl.hccl_buffersize)
    return env
