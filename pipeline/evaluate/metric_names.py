"""Names of evaluate's per-type metrics, shared with the report (which must not import the models to
read them): `quant_<type>_{val_loss,val_loss_rise,kl,mb,ours_window_loss,llamacpp_window_loss}`."""

from __future__ import annotations

QUANT_PREFIX = "quant_"


def quant_types_of(metrics: dict[str, float]) -> list[str]:
    """The types a metrics dict holds quantized figures for, in the order they were measured."""
    suffix = "_val_loss"
    return [k[len(QUANT_PREFIX) : -len(suffix)] for k in metrics if k.startswith(QUANT_PREFIX) and k.endswith(suffix)]
