"""Embeddings: a prompt's final hidden states pooled into one vector.

An embedding request (``SamplingParams.pooling``) is scheduled as a prompt
that samples nothing: each step computing some of its prompt sends the
worker a ``PoolSpec``, the worker sums those rows in float32
(``pool_rows``), and the engine adds the sums up (``add_pooled``) until the
step computing the prompt's last position completes it (``finish``). Only
sums cross, never ``[T, hidden]`` states, so a chunked prompt costs one
vector a chunk, and mean pooling needs no state on the worker.

Which rows a step pools (``pool_range``): ``last``, the prompt's last
position once; ``cls``, position 0 once; ``mean``, every position once,
however often a recompute after preemption runs it again. ``mean`` and
``cls`` read no prefix cache: a position the cache supplied is never
computed (``PoolingParams.reads_cache``).

A score (``/score``, ``/rerank``, ``LLM.score``) is the cosine of two such
vectors (``cosine``), the texts paired as ``score_pairs`` says.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from fluidserve.engine.sampling_params import POOLING_TYPES, PoolingParams
from fluidserve.kvcache.config import json_object


def pool_range(params: PoolingParams, start: int, end: int, prompt_len: int, pooled: int) -> tuple[int, int]:
    """Positions ``[lo, hi)`` of the chunk ``[start, end)`` to pool, given
    the ``pooled`` positions already counted (an empty range: none)."""
    kind = params.pooling_type
    if kind == "last":
        return (prompt_len - 1, prompt_len) if end == prompt_len else (end, end)
    if kind == "cls":
        return (0, 1) if start == 0 and pooled == 0 else (end, end)
    lo = max(start, pooled)  # mean: a recompute repeats positions already summed
    return lo, max(lo, end)


def pool_rows(hidden, specs) -> dict:
    """Request id -> (float32 sum of its rows as a list, or None when it has
    none this step; the row count; whether the vector is complete). One
    device-to-host copy for the step."""
    import torch

    counted = [s for s in specs if s.count]
    sums = None
    if counted:
        sums = torch.stack([hidden[s.first_index:s.first_index + s.count].float().sum(dim=0) for s in counted])
        sums = sums.tolist()
    out: dict = {}
    it = iter(sums or ())
    for s in specs:
        out[s.request_id] = (next(it) if s.count else None, s.count, s.final)
    return out


def add_pooled(total: list[float] | None, part: list[float] | None) -> list[float] | None:
    if part is None:
        return total
    if total is None:
        return part
    return [a + b for a, b in zip(total, part)]


def finish(params: PoolingParams, total: list[float] | None, count: int,
           classifier: Classifier | None = None) -> list[float]:
    """The request's embedding from its summed rows: the mean for ``mean``,
    the first ``dimensions`` kept, then scaled to unit length if asked. On a
    classifier, its class probabilities instead (``Classifier.classify``)."""
    if total is None or count == 0:
        raise ValueError("embedding: no prompt position was pooled")
    vec = [x / count for x in total] if params.pooling_type == "mean" else total
    if classifier is not None:
        return classifier.classify(vec, bool(params.normalize))
    if params.dimensions is not None:
        vec = vec[:params.dimensions]
    if params.normalize:
        norm = math.sqrt(math.fsum(x * x for x in vec))
        # torch.nn.functional.normalize's floor: a zero vector stays zero.
        vec = [x / max(norm, 1e-12) for x in vec]
    return vec



# -- scores from vectors (vLLM's bi-encoder scoring) --------------------------------


def score_pairs(num_1: int, num_2: int) -> list[tuple[int, int]]:
    """Which vectors of two sides are scored against each other, in reply
    order: 1:1, 1:N (the one text of side 1 against each of side 2) or N:N
    (pairwise). Anything else is a ``ValueError``."""
    if num_1 == 0 or num_2 == 0:
        raise ValueError("each side must hold at least one text")
    if num_1 > 1 and num_1 != num_2:
        raise ValueError(f"the two sides must be 1:1, 1:N or N:N, got {num_1}:{num_2}")
    return [(0 if num_1 == 1 else i, i) for i in range(num_2)]


def pair_ids(tokenizer, first: str, second: str, use_sep_token: bool, template: str | None = None) -> list[int]:
    """A cross-encoder's prompt of two texts, as vLLM builds it: rendered
    through a score ``template`` (``--chat-template``: a ``query`` and a
    ``document`` message, Qwen3-Reranker's instruction format), else
    tokenized as a pair (the tokenizer's own separators), or
    (``use_sep_token`` false in the config: an LLM as reranker) the texts joined."""
    if template is not None:
        messages = [{"role": "query", "content": first}, {"role": "document", "content": second}]
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
        return list(tokenizer(text=text, add_special_tokens=True)["input_ids"])
    if use_sep_token:
        return list(tokenizer(text=first, text_pair=second, add_special_tokens=True)["input_ids"])
    return list(tokenizer(text=first + second, add_special_tokens=True)["input_ids"])


def cosine(a: list[float], b: list[float]) -> float:
    """Cosine similarity, with torch's floor on each norm (a zero vector
    scores 0): the pair's score whether or not the vectors are normalized."""
    norm_a = math.sqrt(math.fsum(x * x for x in a))
    norm_b = math.sqrt(math.fsum(x * x for x in b))
    return math.fsum(x * y for x, y in zip(a, b)) / (max(norm_a, 1e-8) * max(norm_b, 1e-8))

# -- what the served model pools ---------------------------------------------------

# vLLM's --pooler-config keys that we read; the others it defines are refused by name.
_POOLER_KEYS = ("pooling_type", "use_activation", "dimensions", "task")
_ST_POOLING_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                     ("pooling_mode_cls_token", "cls"))


def resolve_runner(runner: str, convert: str, hf_config) -> str:
    """``generate`` or ``pooling``: what ``--runner`` and ``--convert`` ask
    of this checkpoint (auto: pooling for a base model saved without its LM
    head, whose every architecture is ``...Model``, and for a classifier)."""
    if is_classifier(hf_config):
        if runner == "generate" or convert == "embed":
            raise ValueError(f"runner: {hf_config.architectures[0]} is a classifier (no LM head): it serves "
                             "/classify, /score and /rerank with --runner pooling")
        return "pooling"
    if convert == "embed":
        if runner == "generate":
            raise ValueError("convert: embed serves embeddings, which --runner generate does not")
        return "pooling"
    if runner != "auto":
        return runner
    archs = getattr(hf_config, "architectures", None) or []
    return "pooling" if archs and all(a.endswith("Model") for a in archs) else "generate"


def is_classifier(hf_config) -> bool:
    """A sequence classifier (``...ForSequenceClassification``): the base
    model with a ``score`` head over the last token, as a reward model or a
    decoder reranker is saved."""
    archs = getattr(hf_config, "architectures", None) or []
    return bool(archs) and all(a.endswith("ForSequenceClassification") for a in archs)


def model_pooling(model_dir: str | Path, pooler_config: str | None, task: str = "embed") -> PoolingParams:
    """The served model's pooling: ``--pooler-config`` over the checkpoint's
    sentence-transformers pooling (``modules.json``), over LAST, normalized
    (a decoder model's embedding: vLLM's default too)."""
    kind = _sentence_transformers_pooling(Path(model_dir)) or "last"
    normalize, dimensions = True, None
    if pooler_config:
        given = json_object(pooler_config, "pooler_config")
        if "normalize" in given:
            raise ValueError("pooler_config: normalize is vLLM's removed key; use use_activation")
        unknown = sorted(set(given) - set(_POOLER_KEYS))
        if unknown:
            raise ValueError(f"pooler_config: {unknown[0]} is not supported (supported: {', '.join(_POOLER_KEYS)})")
        if given.get("task", task) != task:
            raise ValueError(f"pooler_config: task {given['task']!r} is not this model's ({task})")
        if given.get("pooling_type") is not None:
            kind = str(given["pooling_type"]).lower()
            if kind not in POOLING_TYPES:
                raise ValueError(f"pooler_config: pooling_type {given['pooling_type']!r} is not served "
                                 f"(LAST, MEAN or CLS)")
        if given.get("use_activation") is not None:
            normalize = bool(given["use_activation"])
        dimensions = given.get("dimensions")
        if dimensions is not None and task != "embed":
            raise ValueError("pooler_config: dimensions cut an embedding; a classifier has none")
    return PoolingParams(kind, normalize, dimensions)


def _sentence_transformers_pooling(model_dir: Path) -> str | None:
    """The pooling a sentence-transformers checkpoint declares, if one."""
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    for module in modules if isinstance(modules, list) else []:
        if isinstance(module, dict) and str(module.get("type", "")).endswith("models.Pooling"):
            try:
                config = json.loads((model_dir / module.get("path", "") / "config.json").read_text())
            except (OSError, ValueError):
                return None
            for key, kind in _ST_POOLING_MODES:
                if config.get(key):
                    return kind
            modes = sorted(k for k, v in config.items() if k.startswith("pooling_mode") and v)
            raise ValueError(f"{model_dir}: sentence-transformers pooling {modes} is not served (last, mean or cls)")
    return None


# vLLM's reading of a classifier's activation: the problem type, else the
# cross-encoder's sentence-transformers function, else by the label count.
_ACTIVATIONS = {"regression": "identity", "single_label_classification": "softmax",
                "multi_label_classification": "sigmoid"}
_ST_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity",
                   "torch.nn.modules.activation.Softmax": "softmax"}


class Classifier:
    """A sequence classifier's head, on the engine: ``score.weight``
    (``[num_labels, hidden]``, float32, read from the checkpoint once) over
    the pooled hidden state, then the model's activation. The head is tiny
    beside the model, so it runs where the vector is finished rather than
    on every rank."""

    def __init__(self, weight, activation: str, labels: tuple[str, ...], use_sep_token: bool) -> None:
        self.weight = weight  # numpy float32 [num_labels, hidden]
        self.activation = activation  # softmax | sigmoid | identity
        self.labels = labels  # id2label, in label order
        self.use_sep_token = use_sep_token  # a pair is tokenized as a pair (else the two texts joined)

    def classify(self, vec: list[float], use_activation: bool) -> list[float]:
        import numpy as np

        logits = self.weight @ np.asarray(vec, dtype=np.float32)
        if use_activation and self.activation == "softmax" and len(logits) > 1:
            e = np.exp(logits - logits.max())
            logits = e / e.sum()
        elif use_activation and self.activation != "identity":
            logits = 1.0 / (1.0 + np.exp(-logits))
        return [float(x) for x in logits]


def load_classifier(model_dir: str | Path, hf_config, tokenizer) -> Classifier:
    """The head and activation of the classifier saved in ``model_dir``:
    its ``score`` weight, or, for a causal LM trained as a reranker
    (``classifier_from_token`` in the config, as vLLM reads it), its LM
    head's rows of those tokens (``method: from_2_way_softmax``, Qwen3-Reranker's:
    the second token's row less the first's, one label)."""
    import numpy as np

    weight = _head_weight(Path(model_dir), hf_config, tokenizer).float().numpy().astype(np.float32)
    num_labels = weight.shape[0]
    activation = _ACTIVATIONS.get(getattr(hf_config, "problem_type", None) or "")
    if activation is None:
        st = getattr(hf_config, "sentence_transformers", None) or {}
        name = st.get("activation_fn") or getattr(hf_config, "sbert_ce_default_activation_function", None)
        if name is not None and name not in _ST_ACTIVATIONS:
            raise ValueError(f"model: the activation {name!r} is not served (Sigmoid, Softmax or Identity)")
        activation = _ST_ACTIVATIONS.get(name) if name else ("sigmoid" if num_labels < 2 else "softmax")
    given = getattr(hf_config, "id2label", None) or {}
    labels = tuple(str(given.get(i, given.get(str(i), f"LABEL_{i}"))) for i in range(num_labels))
    return Classifier(weight, activation, labels, bool(getattr(hf_config, "use_sep_token", True)))


def _head_weight(model_dir: Path, hf_config, tokenizer):
    from fluidserve.engine.loader import checkpoint_tensor

    tokens = getattr(hf_config, "classifier_from_token", None)
    if not tokens:
        return checkpoint_tensor(model_dir, "score.weight")
    method = getattr(hf_config, "method", None)
    if method is None and getattr(hf_config, "is_original_qwen3_reranker", False):
        method = "from_2_way_softmax"
    if method not in (None, "from_2_way_softmax", "no_post_processing"):
        raise ValueError(f"hf_overrides: method {method!r} is not served (from_2_way_softmax or no_post_processing)")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"hf_overrides: from_2_way_softmax takes two classifier_from_token, got {tokens}")
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    vocab = int(hf_config.vocab_size)
    bad = next((t for t, i in zip(tokens, ids) if not isinstance(i, int) or not 0 <= i < vocab), None)
    if bad is not None:
        raise ValueError(f"hf_overrides: classifier_from_token {bad!r} is not a token of the tokenizer")
    tied = getattr(hf_config, "tie_word_embeddings", False)
    rows = checkpoint_tensor(model_dir, "model.embed_tokens.weight" if tied else "lm_head.weight", ids).float()
    return rows[1:] - rows[:1] if method == "from_2_way_softmax" else rows


def check_dimensions(dimensions: int | None, hf_config) -> None:
    """A request's ``dimensions``: only where the model was trained to be cut
    (Matryoshka), as vLLM answers; ValueError naming the field otherwise."""
    if dimensions is None:
        return
    allowed = getattr(hf_config, "matryoshka_dimensions", None)
    if not allowed and not getattr(hf_config, "is_matryoshka", False):
        raise ValueError("dimensions: the model does not support Matryoshka representation; changing the output "
                         "dimensions would give poor embeddings")
    if allowed and dimensions not in allowed:
        raise ValueError(f"dimensions: the model supports only {sorted(allowed)}, got {dimensions}")
    if dimensions > hf_config.hidden_size:
        raise ValueError(f"dimensions: at most the model's {hf_config.hidden_size}, got {dimensions}")
