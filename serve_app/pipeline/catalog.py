"""The models a gateway serves, as clients name them: names, aliases and LoRA
adapters resolved to a configured model, who may use which, and each model's card
(OpenAI's model object with what its replicas report, learnt once per model)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray.serve.handle import DeploymentHandle

from contract.model_config import ModelConfig
from serve_app.errors import OpenAIError, unknown_model
from serve_app.identity.authentication import authorize
from serve_app.identity.keys import KeyRecord
from serve_app.pipeline.replica_calls import QueueTimeout, reach_replica

logger = logging.getLogger("ray.serve")


class ModelCatalog:
    """What the dialects and routes ask about models (``calls.ModelRegistry``)."""

    def __init__(self, configs: list[ModelConfig], describers: dict[str, DeploymentHandle]):
        # Handles for the gateway's own calls to a model (its description): the
        # ingress gives each model one apart from the clients' handles, a router of
        # its own, so a description waiting behind a busy replica never holds a slot
        # of the queue clients are admitted to (a queue of one refused a client for it).
        self._describers = describers
        self._configs = {config.name: config for config in configs}
        self._created = int(time.time())
        self._card_details: dict[str, dict[str, Any]] = {}
        self._describing: dict[str, asyncio.Future] = {}
        # What clients may send as `model`: each configured name and its aliases.
        self._names = {config.name: config.name for config in configs}
        self._names.update({alias: config.name for config in configs for alias in config.aliases})
        # Configured LoRA adapter names -> their base model.
        self._adapters = {adapter: config.name for config in configs if config.lora for adapter in config.lora.adapters}

    def config(self, name: str) -> ModelConfig:
        """A configured model's config."""
        return self._configs[name]

    def resolve(self, model: str) -> str:
        """The configured name behind ``model`` (a name, alias or adapter), or 404."""
        return self.target(model)[0]

    def authorized(self, key: KeyRecord, model: str) -> str:
        """The configured name behind ``model`` when ``key`` may use it; else the 404 of a
        model that does not exist (the same answer either way: ``unknown_model``)."""
        name = self.resolve(model)
        authorize(key, name, asked=model)
        return name

    def target(self, model: str) -> tuple[str, str | None]:
        """(configured model, LoRA adapter or None) for what a client sent as
        ``model``: a name, an alias, a configured adapter name, or
        '<model>:<adapter folder>' for a model with an adapter folder. 404 otherwise."""
        name = self._names.get(model)
        if name is not None:
            return name, None
        base = self._adapters.get(model) or model.partition(":")[0]
        if base not in self._configs or self._configs[base].adapter_named(model) is None:
            raise unknown_model(model)
        return base, model

    async def model_card(self, model: str) -> dict[str, Any]:
        """OpenAI's model object plus what vLLM reports (``max_model_len``, the
        operations it serves). The details come from a replica once, then stay
        cached: they are fixed by the model's config. An alias's card names the
        model it stands for in ``alias_of``, an adapter's its base in ``parent``
        (vLLM's field for it). A scale-to-zero model is never woken up to be
        described: its card has the details once one of its replicas served."""
        name, _ = self.target(model)
        if name not in self._card_details and not self._configs[name].scales_to_zero:
            await self._details_within_queue_timeout(name)
        return self._card(model)

    def _card(self, model: str) -> dict[str, Any]:
        """``model``'s card with what is known of it now."""
        name, adapter = self.target(model)
        card = {
            "id": name,
            "object": "model",
            "created": self._created,
            "owned_by": self._configs[name].owned_by,
            **self._card_details.get(name, {}),
        }
        if adapter is not None:
            card.update(id=model, parent=name)
        elif model != name:
            card.update(id=model, alias_of=name)
        return card

    async def _details_within_queue_timeout(self, name: str) -> None:
        """Learn ``name``'s details, waiting at most its queue timeout (its replicas
        may all be busy or still loading); every caller waits on one replica call.
        Past the bound the card goes without them: the next one tries again."""
        try:
            await asyncio.wait_for(asyncio.shield(self._describing_task(name)), self._configs[name].queue_timeout_s)
        except TimeoutError:
            logger.warning("model %s: no replica described it within its queue timeout", name)

    async def _learn_details(self, name: str) -> None:
        try:
            describe = self._describers[name].model_info.remote
            response = await reach_replica(describe, self._configs[name].queue_timeout_s)
            info = await response
        except QueueTimeout:
            return  # withdrawn: the next card or request tries again
        except Exception:
            logger.exception("could not describe model %s", name)
            return
        self._card_details[name] = {"max_model_len": info["max_model_len"], "capabilities": info["operations"]}

    def context_length(self, name: str) -> int | None:
        """The model's context length: what its replica reported, else its
        configured ``max_model_len``; None while neither is known."""
        learnt = self._card_details.get(name, {}).get("max_model_len")
        return learnt or self._configs[name].engine_kwargs.get("max_model_len")

    def describe_while_up(self, name: str) -> None:
        """A scale-to-zero model just answered, so a replica is up: learn its
        card details now, off the request's path."""
        if name not in self._card_details:
            self._describing_task(name)

    def described(self, name: str) -> bool:
        """Whether a replica of ``name`` has answered (with its details); if not,
        ask one now, off the caller's path (readiness probes poll this)."""
        if name in self._card_details:
            return True
        self._describing_task(name)
        return False

    def _describing_task(self, name: str) -> asyncio.Future:
        """The one running ``_learn_details(name)``, started if none runs."""
        if name not in self._describing:
            task = asyncio.ensure_future(self._learn_details(name))
            self._describing[name] = task  # a reference, or the loop may drop the task
            task.add_done_callback(lambda _: self._describing.pop(name, None))
        return self._describing[name]

    async def only_model_for(self, operation: str | None, key: KeyRecord | None = None) -> str:
        """The model for a request that names none (platforms such as SageMaker
        or Azure serve one model per endpoint): the only one serving
        ``operation`` (any operation when None) of those ``key`` may use, else a 400
        asking for it that names only those (none, when it may use none of them)."""
        if operation is not None:  # what each serves: every model described side by side
            await asyncio.gather(
                *(
                    self._details_within_queue_timeout(name)
                    for name, config in self._configs.items()
                    if (key is None or key.allows_model(name))
                    and name not in self._card_details
                    and not config.scales_to_zero
                )
            )
        served = [
            name
            for name in self._configs
            # A model not described (yet: scaled to zero, or busy past its queue timeout) may serve it.
            if operation is None or operation in self._card_details.get(name, {}).get("capabilities", [operation])
        ]
        names = [name for name in served if key is None or key.allows_model(name)]
        if len(names) == 1:
            return names[0]
        # With none of them the key's, the answer is an endpoint serving nothing for it:
        # which models exist is not this key's to learn.
        raise OpenAIError(
            400,
            f"Missing required parameter: 'model'. This endpoint serves "
            f"{', '.join(names) or 'no model for this operation'}.",
            param="model",
            code="missing_required_parameter",
        )

    def seen_by(self, key: KeyRecord) -> TenantCatalog:
        """This catalog as ``key``'s routes may ask it (a dialect's translation): a
        model it may not use is never picked nor named for it."""
        return TenantCatalog(self, key)

    async def model_cards(self, key: KeyRecord) -> list[dict[str, Any]]:
        """Every model ``key`` may use, each followed by its aliases and its
        configured adapters (adapters in a folder are loaded on demand, not listed).
        Models are described side by side: the list waits one queue timeout at most."""
        await asyncio.gather(
            *(
                self._details_within_queue_timeout(name)
                for name, config in self._configs.items()
                if key.allows_model(name) and name not in self._card_details and not config.scales_to_zero
            )
        )
        return [
            self._card(model)
            for name, config in self._configs.items()
            if key.allows_model(name)
            for model in (name, *config.aliases, *(config.lora.adapters if config.lora else ()))
        ]


class TenantCatalog:
    """The catalog as one tenant sees it (``ModelCatalog.seen_by``): what a dialect
    asks of it (serve_app/wire/calls.py ModelRegistry) never names a model the
    tenant's key or team may not use."""

    def __init__(self, catalog: ModelCatalog, key: KeyRecord):
        self._catalog, self._key = catalog, key

    async def only_model_for(self, operation: str | None) -> str:
        return await self._catalog.only_model_for(operation, self._key)

    async def model_card(self, model: str) -> dict[str, Any]:
        self._catalog.authorized(self._key, model)
        return await self._catalog.model_card(model)

    def resolve(self, model: str) -> str:
        return self._catalog.resolve(model)

    def authorized(self, key: KeyRecord, model: str) -> str:
        return self._catalog.authorized(key, model)

    def context_length(self, name: str) -> int | None:
        return self._catalog.context_length(name)
