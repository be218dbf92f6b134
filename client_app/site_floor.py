"""A site's own privacy floor (docs/privacy.md, "A site's own floor").

The run config, which the server's operator writes, chooses ``dp.mode`` and
``dp.noise-multiplier``. A site states the least it accepts in its *node config*, which only
it writes (``flower-supernode --node-config "dp-min-noise-multiplier=1.0
dp-require-mode='local'"``; a simulation sets neither):

- ``dp-require-mode``: ``''`` no requirement (the default), ``'central'`` differential
  privacy required, central or local, ``'local'`` only local (the noise is added on the site
  itself; under ``central`` the site trusts the server to add it);
- ``dp-min-noise-multiplier``: ``0`` none (the default); ``> 0``: DP is required (a run with
  ``dp.mode = ''`` is refused) and the run's ``dp.noise-multiplier`` must be at least this.

A message of a run weaker than the floor is refused before anything is computed from the
site's data (``check_site_floor``, called for every message by ``Client.from_context``): its
error reply's reason is one line naming the floor and the run's setting, which the server
records as a dropped reply (and, when every client refuses at the preflight, as the line the
run stops with). A floor that does not parse is refused likewise, so that a typo never
silently leaves a site without the floor it meant to set.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.config import ConfigError, RunSettings, did_you_mean
from common.protocol import EXACT_EVALUATION

REQUIRE_MODE = "dp-require-mode"
MIN_NOISE_MULTIPLIER = "dp-min-noise-multiplier"
FLOOR_KEYS = (REQUIRE_MODE, MIN_NOISE_MULTIPLIER)
# every privacy key a site's node config may hold: its floor, and its opt-in to sending exact
# scores under local DP (client_app/runtime.py: Client.released)
SITE_DP_KEYS = (*FLOOR_KEYS, EXACT_EVALUATION)
REQUIRE_MODES = ("", "central", "local")


@dataclass(frozen=True)
class SiteFloor:
    """The least differential privacy a site trains under (its node config)."""

    require_mode: str = ""  # '', 'central' (central or local), 'local'
    min_noise_multiplier: float = 0.0

    def shortfall(self, dp_mode: str, noise_multiplier: float) -> str | None:
        """Why a run with ``dp_mode`` and ``noise_multiplier`` is below this floor, as
        ``"<floor> but the run has <setting>"``; None when it is not."""
        floor, run = [], []
        no_dp = dp_mode == ""
        if (self.require_mode == "local" and dp_mode != "local") or (
                self.require_mode == "central" and no_dp):
            floor.append(f"{REQUIRE_MODE}={self.require_mode}")
        if self.min_noise_multiplier > 0 and (no_dp
                                              or noise_multiplier < self.min_noise_multiplier):
            floor.append(f"{MIN_NOISE_MULTIPLIER}={self.min_noise_multiplier}")
            if not no_dp:
                run.append(f"dp.noise-multiplier={float(noise_multiplier)}")
        if not floor:
            return None
        if no_dp:
            run.insert(0, "dp.mode='' (no DP)")
        elif self.require_mode == "local" and dp_mode != "local":
            run.insert(0, f"dp.mode={dp_mode}")
        return f"{', '.join(floor)} but the run has {', '.join(run)}"


def _noise_floor(value: Any) -> float:
    key = f"node config: {MIN_NOISE_MULTIPLIER}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        quoted = " (a string: write the number without quotes)" if isinstance(value, str) else ""
        raise ConfigError(f"{key}: {value!r} is not a number{quoted}; allowed: a number >= 0 "
                          "(0: no floor)")
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{key}: {value!r} is out of range; allowed: a number >= 0 "
                          "(0: no floor)")
    return float(value)


def _mode_floor(value: Any) -> str:
    if value not in REQUIRE_MODES or not isinstance(value, str):
        hint = did_you_mean(value, REQUIRE_MODES[1:]) if isinstance(value, str) else ""
        raise ConfigError(f"node config: {REQUIRE_MODE}: {value!r} is not a mode; allowed: "
                          f"'' (no requirement), 'central' (central or local DP), 'local' "
                          f"(local DP only){hint}")
    return value


def site_floor(node_config: Mapping[str, Any]) -> SiteFloor:
    """The floor ``node_config`` states (none: no requirement), its values checked; a key
    that looks like a floor's but is none of them (``dp.min-noise-multiplier``,
    ``dp-min-noise``) is refused with one line too."""
    for key in node_config:
        if key.startswith(("dp-", "dp.", "dp_")) and key not in SITE_DP_KEYS:
            raise ConfigError(f"node config: unknown key {key!r}; a site's privacy keys are "
                              f"{', '.join(SITE_DP_KEYS)}{did_you_mean(key, SITE_DP_KEYS)}")
    return SiteFloor(_mode_floor(node_config.get(REQUIRE_MODE, "")),
                     _noise_floor(node_config.get(MIN_NOISE_MULTIPLIER, 0.0)))


def check_site_floor(node_config: Mapping[str, Any], settings: RunSettings,
                     client_id: str) -> None:
    """Raise a one-line ``ConfigError`` when the run (``settings``) is below the floor of
    the site whose node config is ``node_config`` (or when that floor does not parse)."""
    shortfall = site_floor(node_config).shortfall(settings.dp_mode,
                                                  settings.dp_noise_multiplier)
    if shortfall is not None:
        raise ConfigError(f"site floor: {shortfall}; this site (client {client_id}) does "
                          "not train below its floor")
