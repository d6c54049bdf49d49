"""Typed traceproxy settings from flags, TRACEPROXY_* environment variables, a TOML file and defaults.

Precedence, highest first: flags, environment, file, defaults. The file is read only when named by
--config or TRACEPROXY_CONFIG. Each key is declared once, as a field of its section's dataclass
(sections.py); SCHEMA, the flags, environment names, TOML keys and the shipped default file are all
derived from those fields. Loading has no side effects beyond reading that one file.

  kinds, addresses   how a raw value becomes a typed one, and how its form is said
  sections           the settings dataclasses, the schema derived from them, building Settings
  cross_checks       rules between keys (admin exposure, shared and clashing ports, upstream loops)
  sources, flags     the file, the environment and the command line
  render             config/traceproxy.toml and docs/configuration.md (python -m traceproxy.config)
  startup_checks     what serve checks at startup outside the settings: OTEL_* variables, writable files
"""

from ..lifecycle.stall import STALL_KINDS
from .addresses import HostPort, UpstreamURL, address, collector_endpoint, http_url, http_urls
from .errors import ConfigError
from .flags import FLAG_ALIASES, add_flags, listen_argument, seconds_argument
from .kinds import (MAX_SECONDS, Kind, boolean, choice, file_path, header_names, integer, ratio, seconds,
                    stall_kinds, text, url_path)
from .render import render_default_toml, render_reference_markdown
from .sections import (CONFIG_ENV, ENV_PREFIX, MAX_WORKERS, SCHEMA, AccessLog, Engines, Forwarding, Limits, Pool,
                       RequestIds, Setting, Settings, Stall, Timeouts, Tracing, default_settings, setting)
from .sources import load_settings, unknown_environment
from .startup_checks import check_appendable, check_otlp_endpoint, named_setting

__all__ = [
    "CONFIG_ENV", "ENV_PREFIX", "FLAG_ALIASES", "MAX_SECONDS", "MAX_WORKERS", "SCHEMA", "STALL_KINDS",
    "AccessLog", "ConfigError", "Engines", "Forwarding", "HostPort", "Kind", "Limits", "Pool", "RequestIds",
    "Setting", "Settings", "Stall", "Timeouts", "Tracing", "UpstreamURL",
    "add_flags", "address", "boolean", "check_appendable", "check_otlp_endpoint", "choice",
    "collector_endpoint", "default_settings", "file_path",
    "header_names", "http_url", "http_urls", "integer", "listen_argument", "load_settings", "named_setting", "ratio",
    "render_default_toml", "render_reference_markdown", "seconds", "seconds_argument", "setting",
    "stall_kinds", "text", "unknown_environment", "url_path",
]
