"""FedDecomp's settings and wire spec.

Shared: every state-dict entry except the factors ``lora_A``/``lora_B`` and BatchNorm's batch
counters, i.e. exactly FedAvg's keys and bytes (``sigma`` keeps the original weight names):
``sigma`` of every Linear/Conv2d, their biases, and BatchNorm affine parameters and running
statistics (as in the paper's code; ``feddecomp.bn-stats = "personal"`` keeps the running
statistics on the client). ``tau``'s factors never leave the client.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from common.config import ConfigError, KeyGroup, RunSettings, key, leaves_shared_epochs
from models.feddecomp import TAU_SCALES, is_personal_key
from strategies.wire import WireSpec, is_running_stat, state_keys


@dataclass(frozen=True)
class FedDecompSettings(KeyGroup):
    rank_conv: float = key("feddecomp.rank-conv", low=0, high=1, low_open=True)
    rank_linear: float = key("feddecomp.rank-linear", low=0, low_open=True)  # see linear_rank
    lora_epochs: int = key("feddecomp.lora-epochs")
    weighting: str = key("feddecomp.weighting", choices=("uniform", "examples"))
    tau_scale: str = key("feddecomp.tau-scale", choices=TAU_SCALES)
    bn_stats: str = key("feddecomp.bn-stats", choices=("shared", "personal"))


def linear_rank(settings: RunSettings[FedDecompSettings]) -> int | float:
    """``feddecomp.rank-linear`` as written: an integer is a Linear's rank (the authors'
    ``--Linear_r``), a float in (0, 1] a ratio of ``min(I, O)``."""
    written = settings.raw["feddecomp.rank-linear"]
    if isinstance(written, int) and not isinstance(written, bool):
        return written
    if settings.method_settings.rank_linear > 1:
        raise ConfigError(f"feddecomp.rank-linear: {written} is out of range; allowed: a "
                          "ratio in (0, 1] or an integer rank >= 1")
    return settings.method_settings.rank_linear


def check(settings: RunSettings[FedDecompSettings], model: nn.Module) -> None:
    linear_rank(settings)
    leaves_shared_epochs("feddecomp.lora-epochs", settings.method_settings.lora_epochs,
                         settings.local_epochs)
    if settings.dp_mode == "central" and settings.method_settings.weighting != "uniform":
        raise ConfigError("feddecomp.weighting='examples' with dp.mode='central': the noise "
                          "is calibrated to a mean over clients; use "
                          "feddecomp.weighting='uniform'")


class SigmaShared(WireSpec[FedDecompSettings]):
    def select_shared(self, model: nn.Module) -> list[str]:
        personal_stats = self.settings.method_settings.bn_stats == "personal"
        return [k for k in state_keys(model) if not is_personal_key(k)
                and not (personal_stats and is_running_stat(k))]
