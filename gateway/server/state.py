"""Everything the routes share: the config, the engine loop, served models, prompt encoder and metrics,
who may call (keys, tenants), the admission limits and the server's lifecycle (draining)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core.engine.interface import ServingEngine
from gateway.errors import CUT_MESSAGE
from gateway.tenancy.auth import Authenticator
from gateway.server.config import ServerConfig
from gateway.server.lifecycle import Lifecycle
from gateway.tenancy.limits import QueueGate, TenantLimits
from gateway.observability.metrics import GatewayMetrics
from gateway.inputs.models import ServedModels
from gateway.inputs.prompts import PromptEncoder
from gateway.outputs.responses import TokenTexts
from gateway.inputs.sampling_defaults import RequestDefaults, load_request_defaults
from gateway.tenancy.tenants import load_tenant_file


@dataclass
class GatewayState:
    config: ServerConfig
    aeng: ServingEngine
    models: ServedModels
    encoder: PromptEncoder
    texts: TokenTexts
    metrics: GatewayMetrics
    extra: dict[str, Any] = field(default_factory=dict)   # room for auth / admin / grammar state
    auth: Authenticator | None = None                      # None: built from the config (keys, tenant file)
    limits: TenantLimits = field(default_factory=TenantLimits)
    queue: QueueGate | None = None                         # None: built from config.max_queue_len
    lifecycle: Lifecycle | None = None                     # None: built from config.shutdown_timeout
    defaults: RequestDefaults = field(default_factory=RequestDefaults)   # --generation-config, --max-logprobs

    def __post_init__(self) -> None:
        if self.auth is None:
            tenants = load_tenant_file(self.config.tenant_keys) if self.config.tenant_keys is not None else None
            self.auth = Authenticator(self.config.api_key, tenants)
        if self.queue is None:
            self.queue = QueueGate(self.config.max_queue_len)
        if self.lifecycle is None:
            self.lifecycle = Lifecycle(self.config.shutdown_timeout)
        if self.lifecycle.cut is None:
            self.lifecycle.cut = lambda: self.aeng.cut_all(CUT_MESSAGE)

    @staticmethod
    def build(config: ServerConfig, aeng: ServingEngine) -> "GatewayState":
        facts = aeng.facts
        return GatewayState(
            config=config, aeng=aeng,
            models=ServedModels(config.served_model_name, root=config.engine.model, registry=aeng.adapters,
                                aliases=config.served_model_aliases),
            encoder=PromptEncoder(aeng.tokenizer, facts.vocab_size, facts.max_model_len),
            texts=TokenTexts(aeng.tokenizer),
            metrics=GatewayMetrics(aeng, config.engine.lora.max_loras),
            defaults=load_request_defaults(config.generation_config, facts.model_dir, config.max_logprobs,
                                           facts.vocab_size, config.return_tokens_as_token_ids,
                                           dict(config.override_generation_config)))
