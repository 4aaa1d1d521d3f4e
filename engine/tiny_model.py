"""Tiny random-weight checkpoints, built locally and saved like real ones.

Owns the models that tests, benchmarks and ``fluidserve serve`` without
``--model`` use: a Hugging Face config, seeded random weights written as
safetensors, and a byte-level tokenizer with a chat template. Nothing is
downloaded; the directory loads through exactly the path a real checkpoint
takes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Byte-level vocabulary: 256 byte tokens, then the specials.
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "opt", "mixtral", "qwen2_moe", "qwen3_moe", "gemma3", "phi3", "granite",
         "olmo2", "olmo3", "smollm3", "gemma2", "glm4", "glm4_moe", "granitemoe", "granitemoeshared",
         "ernie4_5", "exaone4")

# A thinking model's markers, added after the specials (ids 261 and 262) in
# ``build_tiny_thinking_model``, and its Qwen3-style template: the reply
# thinks unless ``enable_thinking`` is false (then the prompt closes an empty
# thinking), and an earlier turn's reasoning is written back.
THINK_TOKENS = ["<think>", "</think>"]
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "<think>{{ message['reasoning_content'] }}</think>{% endif %}"
    "{{ message['content'] or '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def save_byte_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer with no merges: one token per UTF-8 byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fluidserve.engine.detokenizer import byte_level_alphabet

    vocab = dict(byte_level_alphabet())  # the character that spells each byte -> that byte's id
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def tiny_config(arch: str = "llama", **overrides):
    """A small transformers config of the given family."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    common = dict(vocab_size=BYTE_VOCAB_SIZE, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    if arch == "opt":
        kw = dict(
            hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
            max_position_embeddings=512, word_embed_proj_dim=64, do_layer_norm_before=True,
            enable_bias=True, dropout=0.0, attention_dropout=0.0, activation_function="relu",
        )
        kw.update(common)
        kw.update(overrides)
        return transformers.OPTConfig(**kw)
    kw = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, head_dim=16,
    )
    # Mixture-of-experts kin: 8 small experts (Mixtral: 4), two a token.
    if arch == "mixtral":
        kw.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
    elif arch in ("qwen2_moe", "qwen3_moe"):
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                  norm_topk_prob=arch == "qwen3_moe")
        if arch == "qwen2_moe":
            kw.update(shared_expert_intermediate_size=48)
    elif arch == "glm4_moe":  # a dense layer, then 8 experts in 4 groups of which 2 are kept, one shared
        kw.update(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                  first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                  attention_bias=True)
    elif arch in ("granite", "granitemoe", "granitemoeshared"):  # Granite 3's multipliers, in their proportions
        kw.update(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1 / 16, logits_scaling=8.0)
        if arch != "granite":  # 8 experts of 32 features, two a token (and a shared expert of 48)
            kw.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)
            if arch == "granitemoeshared":
                kw.update(shared_intermediate_size=48)
    elif arch in ("gemma2", "gemma3"):  # one full-attention layer after a sliding one, a short window
        kw.update(layer_types=["sliding_attention", "full_attention"], sliding_window=16, query_pre_attn_scalar=16,
                  tie_word_embeddings=True)
    elif arch == "olmo3":  # a sliding layer then a full one, a short window
        kw.update(layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    elif arch == "exaone4":  # EXAONE 4 32B's hybrid attention: a sliding layer (rope) then a full one (no rope)
        kw.update(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    elif arch == "smollm3":  # a NoPE layer every second layer (SmolLM3-3B: every fourth)
        kw.update(no_rope_layer_interval=2)
    kw.update(common)
    kw.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mixtral": transformers.MixtralConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "gemma3": transformers.Gemma3TextConfig,
        "phi3": transformers.Phi3Config,
        "granite": transformers.GraniteConfig,
        "olmo2": transformers.Olmo2Config,
        "olmo3": transformers.Olmo3Config,
        "smollm3": transformers.SmolLM3Config,
        "gemma2": transformers.Gemma2Config,
        "glm4": transformers.Glm4Config,
        "glm4_moe": transformers.Glm4MoeConfig,
        "granitemoe": transformers.GraniteMoeConfig,
        "granitemoeshared": transformers.GraniteMoeSharedConfig,
        "ernie4_5": transformers.Ernie4_5Config,
        "exaone4": transformers.Exaone4Config,
    }[arch]
    return cls(**kw)


def build_tiny_model(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> Path:
    """Write config, seeded random weights (safetensors) and a byte tokenizer
    to ``path``; return it. Weights are scaled up from the default init so a
    random model's greedy choices are decisive rather than near-ties."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    _save(transformers.AutoModelForCausalLM.from_config(config, dtype=dtype), path, arch, seed)
    return path


def build_tiny_classifier(path: str | Path, arch: str = "llama", labels: tuple[str, ...] = ("no", "yes"),
                          seed: int = 0, **overrides) -> Path:
    """A sequence classifier (``...ForSequenceClassification``) of the tiny
    model, one output per label, saved as ``build_tiny_model`` saves."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, num_labels=len(labels), id2label=dict(enumerate(labels)),
                         label2id={name: i for i, name in enumerate(labels)}, **overrides)
    torch.manual_seed(seed)
    _save(transformers.AutoModelForSequenceClassification.from_config(config), path, arch, seed)
    return path


def _save(model, path: Path, arch: str, seed: int) -> None:
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM-4.5's routing bias: zeros would test nothing
                b.normal_(0.0, 0.1)
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name or "layer_norm" in name:
                p.uniform_(0.8, 1.2) if "weight" in name else p.normal_(0.0, 0.02)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(str(path), safe_serialization=True)
    save_byte_tokenizer(path)
    (path / "fluidserve_tiny.json").write_text(json.dumps({"arch": arch, "seed": seed}))


def default_tiny_model_dir() -> Path:
    """The built-in model ``fluidserve serve`` uses without ``--model``:
    built once per seed into the user's cache directory."""
    root = Path.home() / ".cache" / "fluidserve" / "tiny-llama-seed0"
    if not (root / "config.json").exists() or not (root / "tokenizer_config.json").exists():
        build_tiny_model(root, "llama", seed=0)
    return root


def build_tiny_thinking_model(path: str | Path, arch: str = "qwen3", **overrides) -> Path:
    """A tiny model whose vocabulary also holds ``<think>`` and ``</think>``
    (plain added tokens, as Qwen3's and DeepSeek-R1's are) and whose chat
    template is ``THINKING_TEMPLATE``: for ``--reasoning-parser``."""
    from transformers import AutoTokenizer

    path = build_tiny_model(path, arch, vocab_size=BYTE_VOCAB_SIZE + len(THINK_TOKENS), **overrides)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(THINK_TOKENS)
    tok.chat_template = THINKING_TEMPLATE
    tok.save_pretrained(path)
    return path


def build_random_adapter(model_dir: str | Path, path: str | Path, seed: int = 0, r: int = 4,
                         targets: str | list[str] = "all-linear", scale: float = 0.15,
                         rank_pattern: dict[str, int] | None = None, **config) -> Path:  # fmt: skip
    """A LoRA adapter of the checkpoint in ``model_dir`` in PEFT's format
    (``adapter_config.json``, ``adapter_model.safetensors``), written to
    ``path``, its A and B random (normal, deviation ``scale``; PEFT starts
    B at zero, which would change no token). ``targets``: module names, or
    ``"all-linear"`` (every linear but the LM head, as PEFT reads it);
    ``rank_pattern``: a rank per module name suffix; ``config``: further
    ``LoraConfig`` fields written as given (``use_rslora``, ``use_dora``,
    ``bias``, ...). Written without PEFT, so a machine without it (a GPU
    node) can make one; PEFT reads it (tests/lora_utils.py)."""
    import transformers
    from safetensors.torch import save_file
    from torch import nn

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    head = model.get_output_embeddings()
    rng = torch.Generator().manual_seed(seed)
    tensors, names = {}, []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        wanted = (isinstance(module, nn.Linear) and module is not head) if targets == "all-linear" else leaf in targets
        if not wanted or not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        rank = next((k for key, k in (rank_pattern or {}).items() if name == key or name.endswith("." + key)), r)
        key = f"base_model.model.{name}"
        if isinstance(module, nn.Embedding):  # PEFT's names and shapes for an embedding's adapter
            tensors[f"{key}.lora_embedding_A"] = torch.randn(rank, module.num_embeddings, generator=rng) * scale
            tensors[f"{key}.lora_embedding_B"] = torch.randn(module.embedding_dim, rank, generator=rng) * scale
        else:
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=rng) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=rng) * scale
        names.append(name)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir), "r": r,
                "lora_alpha": 2 * r, "lora_dropout": 0.0, "bias": "none", "target_modules": names,
                "rank_pattern": rank_pattern or {}, "alpha_pattern": {}, "fan_in_fan_out": False,
                "inference_mode": True, "use_rslora": False, "use_dora": False, **config}
    (path / "adapter_config.json").write_text(json.dumps(settings, indent=2))
    return path
