"""Everything the routes share: the config, the engine loop, served models, prompt encoder and metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core.async_engine import AsyncEngine
from gateway.config import ServerConfig
from gateway.metrics import GatewayMetrics
from gateway.models import ServedModels
from gateway.prompts import PromptEncoder
from gateway.responses import TokenTexts


@dataclass
class GatewayState:
    config: ServerConfig
    aeng: AsyncEngine
    models: ServedModels
    encoder: PromptEncoder
    texts: TokenTexts
    metrics: GatewayMetrics
    extra: dict[str, Any] = field(default_factory=dict)   # room for auth / admin / grammar state

    @staticmethod
    def build(config: ServerConfig, aeng: AsyncEngine) -> "GatewayState":
        engine = aeng.engine
        return GatewayState(
            config=config, aeng=aeng,
            models=ServedModels(config.served_model_name, root=config.model, registry=engine.registry),
            encoder=PromptEncoder(engine.tokenizer, engine.model_config.vocab_size),
            texts=TokenTexts(engine.tokenizer),
            metrics=GatewayMetrics(engine, config.max_loras))
