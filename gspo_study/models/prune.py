"""Prune a local Qwen3-MoE checkpoint (Qwen3-30B-A3B or any) to N decoder layers and E experts per MoE layer, so
a one-GPU researcher trains a model whose routers are pretrained ones.

`python -m gspo_study prune SRC DST --layers N --experts E [--layer-select ...] [--expert-select ...]
[--calibration FILE] [--top-k K]`

Which layers (`--layer-select`):
- `first` (default): layers 0 … N−1. The pruned model computes exactly the full model's first N layers: its
  hidden states after each of them equal the full model's (then the final norm and LM head follow).
- `spaced`: N layers evenly spaced over the depth, first and last included (round(i·(L−1)/(N−1))).
- a comma list of source layer indices (`0,5,47`, N of them).
Kept layers are renumbered 0 … N−1 in source order; the pruned model equals the full model with the other
layers removed from its stack (the residual stream skips them).

Which experts, per MoE layer (`--expert-select`), E of them, kept in source order (renumbered 0 … E−1):
- `usage` (the default with `--calibration`): the E experts the *full* model selects most often (top-k counts)
  at that layer on the calibration text, every source layer run (dropped ones included), ties to the lower id.
- `norm` (the default without): the E router rows with the largest L2 norm — a data-free proxy (a larger row
  gives larger-magnitude logits); prefer `usage`.
- a comma list of expert ids (the same in every layer), or a JSON file `{"<source layer>": [ids], ...}`.

What the pruned router computes: the router keeps the rows of the kept experts, so its softmax runs over the
kept experts' logits only. The pruned MoE block is exactly the full block with the dropped experts' router
logits set to −inf (top-k among the kept experts; `--top-k K`, default min(source top-k, E)). With
`norm_topk_prob: true` (Qwen3-30B-A3B) the gates are the chosen experts' softmax renormalised over those K —
for a token whose full-model top-k experts are all kept (and K unchanged), gates and block output equal the
full model's. With `norm_topk_prob: false` the gates are softmax over the kept experts, i.e. the full model's
gate divided by the kept experts' probability mass (≥ the full model's gate). The flag is copied unchanged.

Memory: the source is read tensor by tensor (safetensors `safe_open`, one shard handle per file, expert rows
sliced without reading the dropped ones) and the pruned model is written one shard per kept layer
(+ one for embeddings, final norm and LM head) with an index, so the peak is about one source layer's kept
tensors (≈ 1.2 GB per layer in bf16 for Qwen3-30B-A3B with all 128 experts kept), plus, for `usage`, one
layer in float32 and the calibration hidden states. Dtypes are kept. The result is committed with the
project's atomic directory write (`checkpoint.atomic_directory`): nothing under DST until it is complete.
"""

from __future__ import annotations

import json
import re
import shutil
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gspo_study.models.checkpoint import CheckpointError, atomic_directory, fingerprint

LAYER_METHODS = ("first", "spaced")
EXPERT_METHODS = ("usage", "norm")
# tokenizer and generation files copied from SRC (weights, config and run files are not)
COPIED = re.compile(
    r"^(tokenizer.*|vocab\..*|merges\.txt|special_tokens_map\.json|added_tokens\.json|"
    r"generation_config\.json|chat_template.*|.*\.tiktoken)$"
)
_LAYER_KEY = re.compile(r"^(model\.layers\.)(\d+)\.(.+)$")
_EXPERT_KEY = re.compile(r"^mlp\.experts\.(\d+)\.(.+)$")
_FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
ROUTER = "mlp.gate.weight"
MAX_CALIBRATION_TOKENS = 2048  # per calibration sample


class PruneError(CheckpointError):
    """A pruning request that cannot be met (bad N, E, top-k, selection, source or destination)."""


@dataclass
class PrunePlan:
    layers: list[int]  # source decoder layers kept, ascending
    experts: dict[int, list[int]]  # source MoE layer -> kept expert ids, ascending
    top_k: int
    selection: dict = field(default_factory=dict)  # how layers and experts were chosen (written to prune.json)


# ------------------------------------------------------------------------------------------------ source
class Source:
    """Lazy tensor access to a safetensors checkpoint directory (single file or sharded with an index)."""

    def __init__(self, path: str | Path, stack: ExitStack):
        self.path = Path(path)
        if not self.path.is_dir() or not (self.path / "config.json").is_file():
            raise PruneError(f"source {self.path} is not a Hugging Face checkpoint directory (no config.json)")
        try:
            self.config = json.loads((self.path / "config.json").read_text())
        except json.JSONDecodeError:
            raise PruneError(f"{self.path / 'config.json'} is not valid JSON") from None
        if self.config.get("model_type") != "qwen3_moe":
            raise PruneError(
                f"source {self.path} holds model_type {self.config.get('model_type')!r}; "
                "a Qwen3-MoE checkpoint ('qwen3_moe') is required"
            )
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise PruneError(f"source {self.path} has no .safetensors weights")
            weight_map = {}
            for f in files:
                with safe_open(str(f), "pt") as h:
                    weight_map.update({k: f.name for k in h.keys()})
        self.weight_map: dict[str, str] = weight_map
        self._handles = {
            name: stack.enter_context(safe_open(str(self.path / name), "pt")) for name in set(weight_map.values())
        }

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def get(self, key: str) -> torch.Tensor:
        return self._handles[self.weight_map[key]].get_tensor(key)

    def rows(self, key: str, ids: list[int]) -> torch.Tensor:
        """`tensor[ids]` along dim 0, reading only those rows."""
        sl = self._handles[self.weight_map[key]].get_slice(key)
        return torch.cat([sl[i : i + 1] for i in ids])

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def num_experts(self) -> int:
        return int(self.config.get("num_experts", self.config.get("num_local_experts", 0)) or 0)

    @property
    def top_k(self) -> int:
        return int(self.config["num_experts_per_tok"])

    def moe_layers(self) -> list[int]:
        """Decoder layers with a sparse MoE block (transformers' Qwen3MoeDecoderLayer rule)."""
        dense = set(self.config.get("mlp_only_layers") or [])
        step = int(self.config.get("decoder_sparse_step", 1) or 1)
        return [i for i in range(self.num_layers) if i not in dense and self.num_experts > 0 and (i + 1) % step == 0]

    def layer_keys(self, layer: int) -> list[str]:
        prefix = f"model.layers.{layer}."
        return [k for k in self.weight_map if k.startswith(prefix)]


# ------------------------------------------------------------------------------------------------ planning
def _int_list(text: str) -> list[int] | None:
    if not re.fullmatch(r"\s*-?\d+\s*(,\s*-?\d+\s*)*", text):
        return None
    return [int(x) for x in text.split(",")]


def select_layers(num_layers: int, n: int, how: str) -> list[int]:
    if not 1 <= n <= num_layers:
        raise PruneError(f"--layers {n} is out of range: the source has {num_layers} layers (allowed 1..{num_layers})")
    if how == "first":
        return list(range(n))
    if how == "spaced":
        return [0] if n == 1 else [int(i * (num_layers - 1) / (n - 1) + 0.5) for i in range(n)]
    ids = _int_list(how)
    if ids is None:
        raise PruneError(f"--layer-select {how!r}: allowed first, spaced or a comma list of layer indices")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad or len(set(ids)) != len(ids) or len(ids) != n:
        raise PruneError(
            f"--layer-select {how!r} must list {n} distinct layer indices in 0..{num_layers - 1} (--layers {n})"
        )
    return sorted(ids)


def check_experts(e: int, num: int) -> None:
    if not 1 <= e <= num:
        raise PruneError(f"--experts {e} is out of range: the source has {num} experts per layer (allowed 1..{num})")


def _top(scores: torch.Tensor, e: int) -> list[int]:
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))  # ties to the lower id
    return sorted(order[:e])


def select_experts(
    src: Source, layers: list[int], e: int, how: str, usage: dict[int, torch.Tensor] | None
) -> dict[int, list[int]]:
    num = src.num_experts
    check_experts(e, num)
    moe = [i for i in layers if i in set(src.moe_layers())]
    if how == "usage":
        if usage is None:
            raise PruneError("--expert-select usage needs --calibration FILE (or use norm or an explicit list)")
        return {i: _top(usage[i], e) for i in moe}
    if how == "norm":
        return {i: _top(src.get(f"model.layers.{i}.{ROUTER}").float().norm(dim=1), e) for i in moe}
    if (ids := _int_list(how)) is not None:
        per_layer = {i: ids for i in moe}
    elif Path(how).is_file():
        try:
            raw = json.loads(Path(how).read_text())
            per_layer = {i: [int(x) for x in raw[str(i)]] for i in moe}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise PruneError(
                f'--expert-select {how}: expected a JSON object {{"<source layer>": [expert ids]}} naming every '
                f"kept MoE layer {moe} ({type(exc).__name__}: {exc})"
            ) from None
    else:
        raise PruneError(
            f"--expert-select {how!r}: allowed usage, norm, a comma list of expert ids or a JSON file of them"
        )
    for i, ids in per_layer.items():
        if len(ids) != e or len(set(ids)) != e or not all(0 <= x < num for x in ids):
            raise PruneError(
                f"--expert-select for layer {i} gives {ids}: "
                f"need {e} distinct expert ids in 0..{num - 1} (--experts {e})"
            )
    return {i: sorted(ids) for i, ids in per_layer.items()}


def make_plan(
    src: Source,
    n_layers: int,
    n_experts: int,
    layer_select: str = "first",
    expert_select: str | None = None,
    top_k: int | None = None,
    calibration: str | Path | None = None,
) -> PrunePlan:
    """Validate the request and choose layers and experts (calibration forward included); writes nothing."""
    layers = select_layers(src.num_layers, n_layers, layer_select)
    check_experts(n_experts, src.num_experts)
    k = min(src.top_k, n_experts) if top_k is None else top_k
    if not 1 <= k <= n_experts:
        raise PruneError(f"--top-k {k} is out of range: allowed 1..{n_experts} (at most --experts)")
    how = expert_select or ("usage" if calibration else "norm")
    usage = None
    if how == "usage" and calibration is not None:
        usage = expert_usage(src, read_calibration(calibration), max(layers))
    experts = select_experts(src, layers, n_experts, how, usage)
    selection = {"layer_select": layer_select, "expert_select": how, "calibration": str(calibration or "")}
    if usage is not None:
        selection["usage"] = {str(i): usage[i].tolist() for i in experts}
    return PrunePlan(layers, experts, k, selection)


# ------------------------------------------------------------------------------------------------ calibration
def read_calibration(path: str | Path) -> list[str]:
    """Calibration texts: a `.jsonl` file's `text` (or `prompt` + `response`) fields, else one text a line."""
    path = Path(path)
    if not path.is_file():
        raise PruneError(f"--calibration {path}: file not found")
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if path.suffix == ".jsonl":
        try:
            rows = [json.loads(ln) for ln in lines]
            texts = [r["text"] if "text" in r else r["prompt"] + r.get("response", "") for r in rows]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise PruneError(f"--calibration {path}: each line needs a 'text' or 'prompt' field ({exc})") from None
    else:
        texts = lines
    if not texts:
        raise PruneError(f"--calibration {path} holds no text")
    return texts


def _layer_state(src: Source, layer: int) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors under the module's own names, experts fused as transformers 5 holds them."""
    prefix = f"model.layers.{layer}."
    state, per_expert = {}, {}
    for key in src.layer_keys(layer):
        name = key[len(prefix) :]
        m = _EXPERT_KEY.match(name)
        if m:
            per_expert[(int(m.group(1)), m.group(2))] = src.get(key)
        else:
            state[name] = src.get(key)
    if per_expert:
        ids = range(src.num_experts)
        gate_up = [torch.cat([per_expert[(e, "gate_proj.weight")], per_expert[(e, "up_proj.weight")]]) for e in ids]
        state["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        state["mlp.experts.down_proj"] = torch.stack([per_expert[(e, "down_proj.weight")] for e in ids])
    return {k: v.float() for k, v in state.items()}


def _keep_indices(store: list, _module, _inputs, out) -> None:
    store.append(out[2].flatten())  # the router's (logits, scores, indices)


@torch.no_grad()
def expert_usage(src: Source, texts: list[str], last_layer: int) -> dict[int, torch.Tensor]:
    """Top-k selection counts per expert at each MoE layer ≤ `last_layer` of the full model on `texts` (float32,
    one sample at a time, streamed layer by layer: one layer's weights in memory at once)."""
    from transformers import AutoTokenizer, Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeRotaryEmbedding

    config = Qwen3MoeConfig.from_pretrained(src.path, local_files_only=True)
    config._attn_implementation = "sdpa"  # causal without a mask (no padding: one sample at a time)
    tokenizer = AutoTokenizer.from_pretrained(src.path, local_files_only=True)
    embed = src.get("model.embed_tokens.weight").float()
    hidden = [embed[torch.tensor(tokenizer(t)["input_ids"][:MAX_CALIBRATION_TOKENS])][None] for t in texts]
    rotary = Qwen3MoeRotaryEmbedding(config)
    pos = [torch.arange(h.shape[1])[None] for h in hidden]
    rope = [rotary(h, p) for h, p in zip(hidden, pos)]
    moe = set(src.moe_layers())
    counts: dict[int, torch.Tensor] = {}
    for layer in range(last_layer + 1):
        with torch.device("meta"):
            module = Qwen3MoeDecoderLayer(config, layer)
        module.load_state_dict(_layer_state(src, layer), assign=True, strict=True)
        module.eval()
        chosen: list[torch.Tensor] = []
        hook = module.mlp.gate.register_forward_hook(partial(_keep_indices, chosen)) if layer in moe else None
        hidden = [module(h, position_ids=p, position_embeddings=r) for h, p, r in zip(hidden, pos, rope)]
        if hook is not None:
            hook.remove()
            counts[layer] = torch.bincount(torch.cat(chosen), minlength=src.num_experts)
        del module
    return counts


# ------------------------------------------------------------------------------------------------ writing
def pruned_config(src: Source, plan: PrunePlan) -> dict:
    cfg = dict(src.config)
    new_index = {old: new for new, old in enumerate(plan.layers)}
    dense = [new_index[i] for i in plan.layers if i not in set(src.moe_layers())]
    e = len(next(iter(plan.experts.values()))) if plan.experts else src.num_experts
    cfg.update(num_hidden_layers=len(plan.layers), num_experts_per_tok=plan.top_k, decoder_sparse_step=1)
    cfg["mlp_only_layers"] = dense  # renumbered layers: dense by list, not by the sparse step
    for key in ("num_experts", "num_local_experts"):
        if key in cfg or key == "num_experts":
            cfg[key] = e
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = min(int(cfg["max_window_layers"]), len(plan.layers))
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = [cfg["layer_types"][i] for i in plan.layers]
    return cfg


def _pruned_layer(src: Source, old: int, new: int, experts: list[int] | None) -> dict[str, torch.Tensor]:
    out, pos = {}, {e: j for j, e in enumerate(experts or [])}
    for key in src.layer_keys(old):
        name = _LAYER_KEY.match(key).group(3)
        target = f"model.layers.{new}.{name}"
        m = _EXPERT_KEY.match(name)
        if experts is None:
            out[target] = src.get(key)
        elif m:
            if int(m.group(1)) in pos:
                out[f"model.layers.{new}.mlp.experts.{pos[int(m.group(1))]}.{m.group(2)}"] = src.get(key)
        elif name == ROUTER or name.startswith(_FUSED_EXPERTS):
            out[target] = src.rows(key, experts)
        elif name.startswith("mlp.experts."):
            raise PruneError(f"source tensor {key} is an expert tensor of a layout this pruner does not know")
        else:
            out[target] = src.get(key)
    return {k: v.contiguous() for k, v in out.items()}


def write_pruned(src: Source, plan: PrunePlan, dst: Path) -> Path:
    """Stream the pruned tensors into DST, one shard per kept layer plus one for the rest, atomically."""
    shards = len(plan.layers) + 1
    weight_map: dict[str, str] = {}
    total = 0
    with atomic_directory(dst) as tmp:
        for new, old in enumerate(plan.layers):
            tensors = _pruned_layer(src, old, new, plan.experts.get(old))
            name = f"model-{new + 1:05d}-of-{shards:05d}.safetensors"
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, name))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
        rest = {k: src.get(k).contiguous() for k in src.keys() if not _LAYER_KEY.match(k)}
        name = f"model-{shards:05d}-of-{shards:05d}.safetensors"
        save_file(rest, str(tmp / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(rest, name))
        total += sum(t.numel() * t.element_size() for t in rest.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(pruned_config(src, plan), indent=2, sort_keys=True))
        for f in src.path.iterdir():
            if f.is_file() and COPIED.match(f.name):
                shutil.copy2(f, tmp / f.name)
        record = {
            "source": str(src.path.resolve()),
            "source_fingerprint": fingerprint(src.path),
            "layers": plan.layers,
            "experts": {str(i): ids for i, ids in plan.experts.items()},
            "top_k": plan.top_k,
            **plan.selection,
        }
        (tmp / "prune.json").write_text(json.dumps(record, indent=1))
    return dst


def prune(
    src: str | Path,
    dst: str | Path,
    layers: int,
    experts: int,
    layer_select: str = "first",
    expert_select: str | None = None,
    top_k: int | None = None,
    calibration: str | Path | None = None,
) -> PrunePlan:
    """Prune SRC into the new directory DST (see the module docstring); every check runs before anything is
    written, and DST appears only complete."""
    dst = Path(dst)
    if dst.exists():
        raise PruneError(f"destination {dst} already exists; name a new directory")
    with ExitStack() as stack:
        source = Source(src, stack)
        if source.num_experts < 1:
            raise PruneError(f"source {source.path} has no MoE experts (num_experts 0)")
        plan = make_plan(source, layers, experts, layer_select, expert_select, top_k, calibration)
        write_pruned(source, plan, dst)
    return plan
