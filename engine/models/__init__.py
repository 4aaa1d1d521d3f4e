"""Model families implemented over the flat token batch, one file each.
``MODEL_REGISTRY`` maps a Hugging Face ``architectures`` entry to its class."""

from __future__ import annotations

from .gemma3 import Gemma3ForCausalLM
from .glm4 import Glm4ForCausalLM
from .llama import LlamaForCausalLM
from .olmo2 import Olmo2ForCausalLM
from .opt import OPTForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
    "Ernie4_5ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Glm4MoeForCausalLM": LlamaForCausalLM,
    "GraniteMoeForCausalLM": LlamaForCausalLM,
    "GraniteMoeSharedForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo2ForCausalLM,
    "Exaone4ForCausalLM": Olmo2ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    # Checkpoints of the base model alone (sentence-transformers' decoder
    # embedders): served for embeddings only, with no LM head to load.
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": LlamaForCausalLM,
    "Qwen2Model": LlamaForCausalLM,
    "Qwen3Model": LlamaForCausalLM,
    # Sequence classifiers (reward models, decoder rerankers): the base model
    # runs here; the engine applies the ``score`` head (engine/pooling.py).
    "LlamaForSequenceClassification": LlamaForCausalLM,
    "MistralForSequenceClassification": LlamaForCausalLM,
    "Qwen2ForSequenceClassification": LlamaForCausalLM,
    "Qwen3ForSequenceClassification": LlamaForCausalLM,
}


def model_class(config):
    for arch in getattr(config, "architectures", None) or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    by_type = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM,
               "qwen3": LlamaForCausalLM, "phi3": LlamaForCausalLM, "granite": LlamaForCausalLM,
               "smollm3": LlamaForCausalLM, "ernie4_5": LlamaForCausalLM,
               "mixtral": LlamaForCausalLM, "qwen2_moe": LlamaForCausalLM, "qwen3_moe": LlamaForCausalLM,
               "glm4_moe": LlamaForCausalLM, "granitemoe": LlamaForCausalLM, "granitemoeshared": LlamaForCausalLM,
               "gemma2": Gemma3ForCausalLM, "gemma3_text": Gemma3ForCausalLM, "olmo2": Olmo2ForCausalLM,
               "exaone4": Olmo2ForCausalLM,
               "olmo3": Olmo2ForCausalLM, "glm4": Glm4ForCausalLM,
               "opt": OPTForCausalLM}
    if config.model_type in by_type:
        return by_type[config.model_type]
    raise ValueError(
        f"model architecture {getattr(config, 'architectures', None) or config.model_type!r} is not supported; "
        f"supported: {sorted(MODEL_REGISTRY)}"
    )
