"""What of the engine plugin (``engine_patches``) the twin engine runs: :class:`EnginePlugin`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine_patches.cadence import CadenceConfig
from engine_patches.retention_rule import RetentionConfig


@dataclass(frozen=True)
class EnginePlugin:
    """What of the engine plugin (``engine_patches``) the twin runs: off by default.

    ``retention``: the host tier honours ``kvroute`` hints (needs a host tier,
    ``cpu_kv_blocks`` > 0). ``cadence``: the bounded prefill cadence. Both take the plugin's
    own settings (:class:`RetentionConfig`, :class:`CadenceConfig`) by the plugin's names."""

    retention: RetentionConfig | None = None
    cadence: CadenceConfig | None = None

    @classmethod
    def from_settings(
        cls, retention: Mapping[str, Any] | None = None, cadence: Mapping[str, Any] | None = None
    ) -> EnginePlugin:
        """From the plugin's dicts: ``kv_connector_extra_config["retention"]`` (``ttl_s``,
        ``max_share``, ...) and ``--additional-config``'s ``kvroute.cadence`` (``interval``,
        ``max_defer_steps``, ``max_defer_ms``, ``backlog_scale``, ...); None: that part off."""
        return cls(
            RetentionConfig.from_dict(retention) if retention is not None else None,
            CadenceConfig.from_dict(cadence) if cadence is not None else None,
        )
