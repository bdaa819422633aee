"""The composed Hydra config as our typed dataclasses: OmegaConf's type errors and unknown keys
turned into the project's one line (the key, expected, found, a valid example)."""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from pipeline.config import PipelineConfig
from pipeline.errors import ConfigError, UnknownKeyError
from pipeline.gguf.quantize import K_QUANTS, require_llamacpp
from stages._run.overrides import unknown_key_message

T = TypeVar("T")


def typed_config(cfg: DictConfig) -> PipelineConfig:
    """Merge into the schema (types, unknown keys) and build the dataclasses (value checks); then what the
    values need installed (a K-quant export: llama-cpp-python), which the schemas themselves never check."""
    typed = structured_config(PipelineConfig, cfg)
    if typed.export.dtype in K_QUANTS:
        require_llamacpp(typed.export.dtype)
    for key, tokens in (("export.imatrix", typed.export.imatrix), ("train.qat_imatrix", typed.train.qat_imatrix)):
        if tokens:  # ggml's own quantizer, from llama-cpp-python's library
            require_llamacpp(typed.export.dtype, key=key)
    return typed


def structured_config(schema: type[T], cfg: DictConfig, source: str = "params.yaml") -> T:
    """`cfg` merged into the dataclass `schema` and built (its __post_init__ checks values);
    `source` names the config file for the one-line error."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as e:
        raise ConfigError(
            f"config key {e.full_key}: expected a value, found ??? (mandatory); fix: set {e.full_key}=... on the "
            f"command line or in {source}"
        ) from None
    except OmegaConfBaseException as e:
        msg = str(e.msg if hasattr(e, "msg") and e.msg else e).splitlines()[0]
        key = getattr(e, "full_key", None) or _section_given_a_value(OmegaConf.structured(schema), cfg) or "?"
        where = "conf/ or params.yaml" if source == "params.yaml" else source
        message = f"config key {key}: {msg}; fix: correct {key} in {where}"
        if isinstance(e, ConfigKeyError) and key != "?":
            raise UnknownKeyError(unknown_key_message(OmegaConf.structured(schema), key, where), key) from None
        raise ConfigError(mistyped(schema, cfg, key) or message) from None


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def mistyped(schema: type, cfg: DictConfig, key: str) -> str:
    """A value of the wrong type (`-S train.steps=abc`, `train.distill=0.5` for a group of keys) as the
    project's one line, with the schema's default as the valid example; "" when `key` has no typed default
    (OmegaConf's own wording is kept then)."""
    default = OmegaConf.select(OmegaConf.structured(schema), key, default=None) if key != "?" else None
    found = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False) if key != "?" else None
    if isinstance(default, DictConfig):
        first = next(iter(default), "key")
        expected = f"a group of keys ({', '.join(default)})"
        fix = f"set the keys inside it, e.g. {key}.{first}={_as_override(default[first])}"
    elif isinstance(default, ListConfig):
        expected, fix = "a list", f"write it in brackets, e.g. '{key}={_as_override(default)}'"
    elif type(default) in _KINDS:
        expected = _KINDS[type(default)]
        fix = f"set {key} to {expected}, e.g. {key}={_as_override(default)}"
    else:
        return ""
    shown = repr(found) if isinstance(found, str) else _as_override(found)
    return f"config key {key}: expected {expected}, found {shown}; fix: {fix}"


def _as_override(value: Any, quote: bool = False) -> str:
    """A value as it is typed after `key=` (true, [q,v], '' for the empty string, null); `quote`: a
    string with anything but letters, digits and _-. in double quotes (a list's item)."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    if isinstance(value, list):
        return "[" + ",".join(_as_override(v, quote=True) for v in value) + "]"
    if quote and isinstance(value, str) and not re.fullmatch(r"[\w.-]+", value):
        return json.dumps(value)
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return repr(value) if isinstance(value, str) and (not value or value != value.strip()) else str(value)


def _section_given_a_value(schema: DictConfig, cfg: Any, prefix: str = "") -> str:
    """The dotted key of a group of keys that `cfg` sets to a single value (OmegaConf names none)."""
    if not isinstance(cfg, DictConfig):
        return ""
    for name, node in schema.items_ex(resolve=False):
        if isinstance(node, DictConfig) and name in cfg:
            value = cfg._get_node(name)
            if not isinstance(value, DictConfig):
                return f"{prefix}{name}"
            if inner := _section_given_a_value(node, value, f"{prefix}{name}."):
                return inner
    return ""
