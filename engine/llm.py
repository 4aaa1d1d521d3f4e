"""LLM: the offline Python API (``LLM(model=...).generate(prompts, params)``)."""

from __future__ import annotations

import dataclasses
import json

from fluidserve.engine.config import EngineConfig
from fluidserve.engine.engine import LLMEngine, next_request_id
from fluidserve.engine.heap import frozen_heap
from fluidserve.engine.lora import LoRARequest
from fluidserve.engine.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from fluidserve.engine.pooling import cosine, pair_ids, score_pairs
from fluidserve.engine.sampling_params import PoolingParams, SamplingParams


class GenerationFailedError(RuntimeError):
    """Some requests of a ``generate`` call failed (a step that raised):
    ``outputs`` holds every request's output, in prompt order, the failed
    ones with finish reason "error" and their ``error``."""

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        """``kwargs``: any setting of the config tree by its flat name
        (``max_num_seqs``, ``block_size``, ``tensor_parallel_size``, ...);
        ``speculative_config`` may be a dict, as vLLM's LLM takes it."""
        if isinstance(kwargs.get("speculative_config"), dict):
            kwargs["speculative_config"] = json.dumps(kwargs["speculative_config"])
        try:
            config = EngineConfig.create(model=model, **kwargs)
        except TypeError as exc:
            raise ValueError(f"unknown LLM argument(s): {exc}") from None
        self.engine = LLMEngine(config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. A bad
        prompt raises ValueError before any of them runs; requests that
        failed raise GenerationFailedError once all have ended (the engine
        serves on). ``lora_request`` (vLLM's; with ``enable_lora``): the
        adapter of every prompt, or one per prompt, loaded on first use."""
        prompts, params_list = _per_prompt(prompts, sampling_params or SamplingParams(), "sampling_params")
        if lora_request is not None:
            params_list = self._with_adapters(params_list, lora_request)
        with frozen_heap():  # no step pays for a full collection of torch's objects
            return self._run(prompts, params_list, use_tqdm)

    def embed(
        self,
        prompts: str | list[str] | list[list[int]],
        pooling_params: PoolingParams | list[PoolingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Embed every prompt (an engine of ``runner="pooling"``): each
        output's ``embedding``, in prompt order. ``pooling_params``: the
        model's pooling where None, or fields of it overridden."""
        prompts, pooling_list = _per_prompt(prompts, pooling_params or PoolingParams(), "pooling_params")
        return self.generate(prompts, [SamplingParams(pooling=p) for p in pooling_list], use_tqdm, lora_request)

    def classify(
        self,
        prompts: str | list[str] | list[list[int]],
        use_tqdm: bool = False,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify`` on a sequence classifier: each prompt's
        label probabilities (``out.outputs.probs``), in prompt order."""
        if self.engine.classifier is None:
            raise ValueError(f"model: {self.engine.model_name} is no sequence classifier")
        outs = self.embed(prompts, use_tqdm=use_tqdm, lora_request=lora_request)
        return [ClassificationRequestOutput(o.request_id, ClassificationOutput(o.embedding), o.prompt_token_ids)
                for o in outs]

    def score(
        self,
        data_1: str | list[str] | list[int] | list[list[int]],
        data_2: str | list[str] | list[int] | list[list[int]],
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
        chat_template: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``, the sides paired 1:1, 1:N or N:N, in
        ``data_2``'s order. On an embedding model the cosine of each pair's
        vectors (each text embedded once); on a classifier of one label (a
        cross-encoder) its output for each pair of texts, tokenized as a pair
        or rendered through ``chat_template`` (a score template, vLLM's)."""
        one, _ = _per_prompt(data_1, None, "data_1")
        two, _ = _per_prompt(data_2, None, "data_2")
        pairs = score_pairs(len(one), len(two))
        classifier = self.engine.classifier
        if classifier is not None:
            if len(classifier.labels) != 1 or not all(isinstance(t, str) for t in one + two):
                raise ValueError("data_1: a classifier scores pairs of texts, and only with one label")
            prompts = [pair_ids(self.tokenizer, one[i], two[j], classifier.use_sep_token, chat_template)
                       for i, j in pairs]
            outs = self.embed(prompts, use_tqdm=use_tqdm, lora_request=lora_request)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(o.embedding[0]), o.prompt_token_ids)
                    for o in outs]
        outs = self.embed(one + two, use_tqdm=use_tqdm, lora_request=lora_request)
        return [ScoringRequestOutput(f"{outs[i].request_id}_{outs[len(one) + j].request_id}",
                                     ScoringOutput(cosine(outs[i].embedding, outs[len(one) + j].embedding)),
                                     outs[i].prompt_token_ids + outs[len(one) + j].prompt_token_ids)
                for i, j in pairs]

    def _with_adapters(self, params_list: list[SamplingParams],
                       lora_request: LoRARequest | list[LoRARequest | None]) -> list[SamplingParams]:  # fmt: skip
        """Each prompt's params naming its adapter, loaded where it is not."""
        requests = lora_request if isinstance(lora_request, list) else [lora_request] * len(params_list)
        if len(requests) != len(params_list):
            raise ValueError("lora_request: one per prompt, or a single one for all")
        served = self.engine.lora_names()
        for req in {r for r in requests if r is not None}:
            if req.lora_name not in served:
                served[req.lora_name] = self.engine.add_lora(req.lora_name, req.lora_path).path
        return [p if r is None else dataclasses.replace(p, lora=r.lora_name) for p, r in zip(params_list, requests)]

    def _run(self, prompts: list, params_list: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        ids = [next_request_id("llm") for _ in prompts]
        try:
            for rid, prompt, p in zip(ids, prompts, params_list):
                self.engine.add_request(rid, prompt, p, final_only=True)
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        bar = _progress(len(prompts)) if use_tqdm else None
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        outputs = [final[rid] for rid in ids]
        failed = [out for out in outputs if out.error is not None]
        if failed:
            raise GenerationFailedError(f"{len(failed)} of {len(outputs)} requests failed, the first with "
                                        f"{failed[0].error}", outputs)
        return outputs


def _per_prompt(prompts, given, name: str) -> tuple[list, list]:
    """The prompts as a list (one prompt, a string or token ids, alone),
    and ``given`` (one for all, or a list of one per prompt) as one per prompt."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    each = given if isinstance(given, list) else [given] * len(prompts)
    if len(each) != len(prompts):
        raise ValueError(f"{name}: one per prompt, or a single one for all")
    return prompts, each


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
