"""Typed config schemas: one plain dataclass per concept, the whole of `params.yaml` in `PipelineConfig`.

The stages merge the composed Hydra config into these (OmegaConf checks types there) and
`__post_init__` rejects bad values, naming the key, before any work starts; the library takes the
objects as they are. The schemas import only the error shape and the pure-data tensor-name table,
so every layer may import them.
"""

from pipeline.config.data_schema import SOURCES, TEMPLATES, DataConfig, DonorConfig
from pipeline.config.model_schema import (
    FINETUNE_MODES,
    INITS,
    LAYER_RULES,
    TRAINABLE,
    LoraConfig,
    ModelConfig,
    RecipeConfig,
    SubcloneConfig,
    explicit_layers,
)
from pipeline.config.pipeline_schema import (
    EXPORT_TYPES,
    EvaluateConfig,
    ExportConfig,
    PipelineConfig,
    ReportConfig,
    TrackingConfig,
)
from pipeline.config.tools_schema import ChatConfig, GenerateConfig
from pipeline.config.train_schema import (
    DEVICES,
    DISTILL_MODES,
    OPTIMIZERS,
    PARALLEL,
    PRECISIONS,
    DistillConfig,
    OptimConfig,
    TrainConfig,
)

__all__ = [
    "DEVICES",
    "DISTILL_MODES",
    "EXPORT_TYPES",
    "FINETUNE_MODES",
    "INITS",
    "LAYER_RULES",
    "OPTIMIZERS",
    "PARALLEL",
    "PRECISIONS",
    "SOURCES",
    "TEMPLATES",
    "TRAINABLE",
    "explicit_layers",
    "DataConfig",
    "DistillConfig",
    "DonorConfig",
    "EvaluateConfig",
    "ExportConfig",
    "ChatConfig",
    "GenerateConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "PipelineConfig",
    "RecipeConfig",
    "ReportConfig",
    "SubcloneConfig",
    "TrackingConfig",
    "TrainConfig",
]
