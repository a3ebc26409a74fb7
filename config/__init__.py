"""Configuration schema, loader and the shipped default YAML files."""

from config.loader import ConfigError, load_config
from config.schema import Config, EnginesConfig, EngineSpec, GatewayConfig, TenantQuota

__all__ = ["Config", "ConfigError", "EngineSpec", "EnginesConfig", "GatewayConfig",
           "TenantQuota", "load_config"]
