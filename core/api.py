"""The Python API: ``specdec.LLM``."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import attrs

from .config import EngineConfig, SpeculativeConfig, build_engine_config, build_speculative_config, parse_json_text
from .engine import Engine, RequestOutput
from .model.resolve import DEFAULT_MODEL
from .sampling import SamplingParams

Prompt = Union[str, Sequence[int]]


class LLM:
    """Load a model once, then generate with speculative decoding.

    ``speculative_config`` takes what ``--speculative-config`` takes: a dict, a JSON string
    (or ``@file.json``), or a :class:`SpeculativeConfig`; ``None`` means plain decoding
    (``naive``)::

        llm = specdec.LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 5})
        out = llm.generate(["def add(a, b):"], specdec.SamplingParams(max_tokens=64))
        print(out[0].text, out[0].metrics.mean_acceptance_length)
    """

    def __init__(self, model: str = DEFAULT_MODEL, speculative_config=None, *,
                 config: Optional[EngineConfig] = None, plugins=None, progress: bool = True,
                 **engine_options):
        """``engine_options`` are the engine keys of docs/config.md (``max_num_seqs``,
        ``num_kv_blocks``, ``max_num_batched_tokens``, ``attention_backend``, ...)."""
        from .plugin_manager import get_plugins

        plugins = plugins if plugins is not None else get_plugins()
        if config is None:
            overrides = {"model": model, **engine_options}
            config = build_engine_config(None, overrides, None, plugins)
            if speculative_config is not None:
                config = attrs.evolve(config, speculative=_speculative(speculative_config, plugins))
        elif not config.speculative.is_resolved(plugins):
            config = attrs.evolve(config, speculative=config.speculative.resolved(plugins))
        self.engine = Engine(config, plugins=plugins, progress=progress)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def speculative_config(self) -> SpeculativeConfig:
        return self.engine.spec

    def set_speculative_config(self, speculative_config) -> None:
        """Switch the speculative method (dict, JSON or SpeculativeConfig; ``None`` for
        ``naive``) keeping the model."""
        self.engine.set_speculative_config(_speculative(speculative_config, self.engine.plugins))

    def reset_prefix_cache(self) -> None:
        """Forget the KV blocks cached for shared prompt prefixes (between runs only)."""
        self.engine.reset_prefix_cache()

    def encode_prompt(self, prompt: Prompt, use_chat_template: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if use_chat_template:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None, *,
                 use_chat_template: bool = False, progress: bool = False) -> list[RequestOutput]:
        """Generate for each prompt (text, or token ids); outputs come back in prompt order.

        With ``use_chat_template`` each text prompt is sent as one user message through the
        model's chat template.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        requests = [
            self.engine.add_request(self.encode_prompt(p, use_chat_template), sp,
                                    prompt=p if isinstance(p, str) else None)
            for p, sp in zip(prompts, sampling_params)
        ]
        return self.engine.run(requests, progress=progress)

    def chat(self, messages: list[dict], sampling_params: Optional[SamplingParams] = None) -> RequestOutput:
        """Answer one conversation (a list of ``{"role", "content"}`` messages)."""
        ids = self.tokenizer.encode_chat(messages)
        request = self.engine.add_request(ids, sampling_params or SamplingParams())
        return self.engine.run([request])[0]


def _speculative(speculative_config, plugins) -> SpeculativeConfig:
    """The resolved config for what ``LLM`` takes: a ``SpeculativeConfig`` (resolved as is, or
    validated if built by hand), a JSON string (or ``@file``), a dict, or ``None``."""
    if isinstance(speculative_config, SpeculativeConfig):
        if speculative_config.is_resolved(plugins):
            return speculative_config
        return speculative_config.resolved(plugins)
    if isinstance(speculative_config, str):
        speculative_config = parse_json_text(speculative_config, "speculative_config")
    return build_speculative_config(speculative_config or {}, plugins)
