"""Medusa heads: extra decoding heads on the target's last hidden state.

Medusa-1 (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads") freezes the model and adds ``K`` small heads. Head ``i`` reads the
final hidden state ``h`` (after the final norm) at the position that predicted ``t0``, the
token the target emitted last, and guesses the token ``i + 1`` steps after ``t0``:

    head_i(h) = W_i · ResBlock_i(h),     ResBlock(x) = x + SiLU(linear(x))

so one round drafts ``K`` tokens with no extra forward of the model: the hidden state
comes for free from the previous verification.

The published layout (the FasterDecoding/Medusa repository) is a folder with
``config.json`` (``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``)
and ``medusa_lm_head.safetensors`` (or the pickle ``medusa_lm_head.pt``) whose keys are
``{head}.{layer}.linear.weight`` / ``.bias`` for the residual blocks and
``{head}.{num_layers}.weight`` for each head's own LM head (no bias).

Candidates are verified as a chain (top-1 of each head, or a sample of each head's
processed distribution) or, with ``tree=True``, as a sparse tree of the heads' top-k
candidates (:func:`build_candidate_tree`), in the format of :class:`~selfspec.drafting.Draft`.
"""

from __future__ import annotations

import heapq
import json
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...artifacts import MEDUSA_HEADS, atomic_path, atomic_write_text, find_artifact, make_folder, model_cache
from ...core.sampling import SamplingParams, logits_to_probs, sample
from ...errors import (
    ConfigurationError,
    CorruptCheckpointError,
    ModelNotFoundError,
    UnsafeCheckpointError,
    one_line,
)
from ..base import DecodeState, Draft, Drafter, draft_autoregressively
from ..planning import BenchContext, BenchRow, DrafterBench, sampled, tree_rows
from ..registry import register_drafter
from .options import OPTIONS

#: File names of the published layout.
MEDUSA_CONFIG = "config.json"
MEDUSA_SAFETENSORS = "medusa_lm_head.safetensors"
MEDUSA_PICKLE = "medusa_lm_head.pt"
#: The subfolder of a model folder where ``selfspec train-medusa`` saves heads by default
#: and where ``drafter="medusa"`` without ``medusa_heads=`` looks for them.
MEDUSA_SUBFOLDER = "medusa"


class ResBlock(nn.Module):
    """``x + SiLU(linear(x))``; the linear starts at zero, so a new block is the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., hidden] -> [..., hidden]``."""
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """``K`` Medusa-1 heads: ``num_layers`` residual blocks and a bias-free LM head each.

    The module is a ``ModuleList`` of ``Sequential(ResBlock * num_layers, Linear)``, so its
    state dict has exactly the published Medusa keys.

    Args:
        num_heads: ``K``, the number of heads (head ``i`` predicts ``i + 1`` tokens past ``t0``).
        hidden_size: the model's hidden size.
        vocab_size: the model's vocabulary size.
        num_layers: residual blocks per head (Medusa's ``medusa_num_layers``, usually 1).
        base_model_name_or_path: the model the heads were trained on (saved in config.json).
    """

    def __init__(
        self,
        num_heads: int,
        hidden_size: int,
        vocab_size: int,
        num_layers: int = 1,
        base_model_name_or_path: str = "",
    ) -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ConfigurationError(f"Medusa needs >= 1 heads and >= 0 layers, got {num_heads} and {num_layers}")
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.base_model_name_or_path = base_model_name_or_path
        self.heads = nn.ModuleList(
            nn.Sequential(
                *[ResBlock(hidden_size) for _ in range(num_layers)], nn.Linear(hidden_size, vocab_size, bias=False)
            )
            for _ in range(num_heads)
        )

    def __repr__(self) -> str:
        return (
            f"MedusaHeads(num_heads={self.num_heads}, num_layers={self.num_layers}, "
            f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size})"
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` normed final states -> ``[K, ..., vocab]`` logits, one row per head."""
        return torch.stack([head(hidden) for head in self.heads])

    def init_from_lm_head(self, lm_head: nn.Module) -> None:
        """Copy the model's LM head into every head's linear (Medusa's recommended start)."""
        weight = lm_head.weight
        assert isinstance(weight, torch.Tensor)
        if tuple(weight.shape) != (self.vocab_size, self.hidden_size):
            raise ConfigurationError(f"lm_head shape {tuple(weight.shape)} does not fit {self!r}")
        with torch.no_grad():
            for head in self.heads:
                linear = head[-1]  # type: ignore[index]
                linear.weight.copy_(weight.to(linear.weight.dtype))

    def medusa_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under the published keys (``"0.0.linear.weight"``, ``"0.1.weight"``, ...)."""
        return {k: v.detach().contiguous() for k, v in self.heads.state_dict().items()}

    def config_json(self) -> dict[str, Any]:
        """The published ``config.json`` (plus the sizes, which Medusa infers from the model)."""
        return {
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "base_model_name_or_path": self.base_model_name_or_path,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }

    def save(self, folder: str | os.PathLike[str], dtype: torch.dtype = torch.float16) -> Path:
        """Write ``config.json`` and ``medusa_lm_head.safetensors`` into ``folder`` (each atomically)."""
        from safetensors.torch import save_file

        path = Path(folder)
        make_folder(path)
        tensors = {k: v.to(dtype).cpu() for k, v in self.medusa_state_dict().items()}
        with atomic_path(path / MEDUSA_SAFETENSORS) as partial:
            save_file(tensors, str(partial), metadata={"format": "pt"})
        atomic_write_text(path / MEDUSA_CONFIG, json.dumps(self.config_json(), indent=2) + "\n")
        return path


def has_medusa_heads(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds Medusa heads in the published layout."""
    path = Path(folder)
    return (path / MEDUSA_SAFETENSORS).is_file() or (path / MEDUSA_PICKLE).is_file()


def medusa_heads_folder(name_or_path: str | os.PathLike[str]) -> Path:
    """Where ``selfspec train-medusa`` saves a model's heads: ``<cache>/medusa_heads/<model key>/``."""
    return model_cache(name_or_path, MEDUSA_HEADS)


def find_medusa_heads(name_or_path: str | os.PathLike[str] | None) -> Path | None:
    """The heads ``drafter="medusa"`` loads for a model, or ``None``.

    :func:`medusa_heads_folder` (the user cache), then, read only, a local model folder's
    ``medusa/`` (shipped beside the bundled demo model, or published) and the model folder itself
    (a published Medusa repository).
    """
    return find_artifact(
        name_or_path,
        MEDUSA_HEADS,
        lambda folder: folder.is_dir() and has_medusa_heads(folder),
        beside=(MEDUSA_SUBFOLDER, ""),
    )


def load_medusa_heads(
    folder: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    hidden_size: int | None = None,
    vocab_size: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> MedusaHeads:
    """Load heads saved in the published Medusa layout.

    Args:
        folder: a folder with ``config.json`` and ``medusa_lm_head.safetensors`` (or
            ``medusa_lm_head.pt``, read only with ``allow_pickle=True``).
        allow_pickle: accept the pickle file when no safetensors file exists.
        hidden_size: when given, the model's hidden size the heads must read.
        vocab_size: when given, the model's vocabulary size the heads must produce.
        dtype: cast the heads to this dtype (the model's).
        device: move the heads here (the model's device).

    Raises:
        ModelNotFoundError: no such folder, or no weights or Medusa config in it.
        UnsafeCheckpointError: only a pickle file, and ``allow_pickle`` is off.
        CorruptCheckpointError: the weights or ``config.json`` cannot be read (truncated, not
            safetensors, not JSON); the message names the file.
        ConfigurationError: the weights do not fit the config or the model.
    """
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(f"no Medusa heads folder at {os.fspath(folder)!r}")
    config = read_medusa_config(path)
    if (path / MEDUSA_SAFETENSORS).is_file():
        state = _read_weights(path / MEDUSA_SAFETENSORS)
    elif (path / MEDUSA_PICKLE).is_file():
        if not allow_pickle:
            raise UnsafeCheckpointError(
                f"{path} holds only the pickle file {MEDUSA_PICKLE}, which can run arbitrary code when "
                "loaded. Convert it to safetensors, or pass allow_pickle=True if you trust the file."
            )
        state = _read_weights(path / MEDUSA_PICKLE)
    else:
        raise ModelNotFoundError(f"{path} has no {MEDUSA_SAFETENSORS} (or {MEDUSA_PICKLE})")
    # some exports keep the module name of the Medusa model ("medusa_head.0.0.linear.weight")
    state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
    num_heads, num_layers = config["medusa_num_heads"], config.get("medusa_num_layers", 1)
    head_key = f"0.{num_layers}.weight"
    if head_key not in state:
        raise ConfigurationError(
            f"{path}: no {head_key!r} in the weights; does medusa_num_layers={num_layers} match the file?"
        )
    vocab, hidden = state[head_key].shape
    if hidden_size is not None and hidden != hidden_size:
        raise ConfigurationError(
            f"the Medusa heads in {path} read hidden states of size {hidden}, but the model's hidden "
            f"size is {hidden_size}: these heads were trained for another model "
            f"({config.get('base_model_name_or_path') or 'unknown'})"
        )
    if vocab_size is not None and vocab != vocab_size:
        raise ConfigurationError(
            f"the Medusa heads in {path} predict {vocab} tokens, but the model's vocabulary has {vocab_size}"
        )
    heads = MedusaHeads(num_heads, int(hidden), int(vocab), num_layers, str(config.get("base_model_name_or_path", "")))
    try:
        heads.heads.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ConfigurationError(f"the Medusa weights in {path} do not match their config.json: {exc}") from exc
    heads.eval().requires_grad_(False)
    return heads.to(device=device, dtype=dtype)


#: What to do about a Medusa file that cannot be read.
_REDO = "train the heads again (`selfspec train-medusa --model M`) or download them again"


def read_medusa_config(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json`` of a Medusa heads folder, its sizes checked.

    Raises:
        ModelNotFoundError: no ``config.json``, or one without ``medusa_num_heads`` (not a Medusa folder).
        CorruptCheckpointError: ``config.json`` is not a JSON object (truncated, not UTF-8, not JSON).
        ConfigurationError: ``medusa_num_heads`` is not an int >= 1, or ``medusa_num_layers`` not an int >= 0.
    """
    config_path = Path(folder).expanduser() / MEDUSA_CONFIG
    if not config_path.is_file():
        raise ModelNotFoundError(f"{config_path.parent} has no config.json with medusa_num_heads / medusa_num_layers")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # json.JSONDecodeError is a ValueError
        raise CorruptCheckpointError(f"{config_path} is not valid JSON ({one_line(str(exc))}); {_REDO}") from None
    if not isinstance(config, dict):
        raise CorruptCheckpointError(f"{config_path} is not a JSON object (got {type(config).__name__}); {_REDO}")
    if "medusa_num_heads" not in config:
        raise ModelNotFoundError(f"{config_path} has no 'medusa_num_heads': not a Medusa heads folder")
    for field, low in (("medusa_num_heads", 1), ("medusa_num_layers", 0)):
        value = config.get(field, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigurationError(f"{config_path}: {field}={value!r} is invalid; it must be an int >= {low}")
    return config


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a Medusa weights file (safetensors, or the pickle with ``weights_only``).

    Raises:
        CorruptCheckpointError: the file is truncated, corrupt, or not a state dict; the message names it.
    """
    from safetensors import SafetensorError

    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(str(file))
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise CorruptCheckpointError(
            f"{file} is not a readable {'safetensors' if file.suffix == '.safetensors' else 'PyTorch'} file: "
            f"it is truncated or corrupt ({one_line(str(exc))}); {_REDO}"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CorruptCheckpointError(f"{file} does not hold a state dict of tensors; {_REDO}")
    return state


def build_candidate_tree(
    head_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    max_nodes: int,
    top_k: int = 4,
) -> Draft:
    """A sparse tree of the heads' candidates (Medusa's tree attention candidates).

    Greedy: best-first over the product of the heads' top-``top_k`` probabilities: the
    ``max_nodes`` most probable paths, each with its prefix (a child never scores above
    its parent, so a prefix always enters first). Deterministic picks: ``draft_probs`` is
    ``None`` (one-hot rows). Sampling: each node at depth ``d`` gets ``children[d]``
    children drawn i.i.d. from head ``d``'s processed distribution, breadth first, until
    ``max_nodes``; every node's ``draft_probs`` row is the distribution it was drawn from
    (siblings share one).

    Args:
        head_logits: ``[K, vocab]`` logits of the ``K`` heads (depth ``d`` uses head ``d``).
        params: the target's sampling parameters (the same processing as the target's).
        generator: the random source when sampling.
        max_nodes: the most nodes in the tree.
        top_k: candidates per head (greedy), or children of the root (sampling; halved
            at each depth, at least 1).

    Returns:
        A :class:`~selfspec.drafting.Draft` with ``tokens`` in topological order and
        ``parents`` (``-1`` for children of the root, ``state.last_token``).
    """
    num_heads = head_logits.shape[0]
    tokens: list[int] = []
    parents: list[int] = []
    if max_nodes <= 0 or num_heads == 0:
        return Draft(tokens=[], parents=[])
    if params.greedy:
        top = torch.topk(torch.log_softmax(head_logits.float(), dim=-1), top_k, dim=-1)
        log_probs, ids = top.values.tolist(), top.indices.tolist()  # [K, top_k]
        # heap of (-score, tiebreak, depth, rank, parent node index)
        heap: list[tuple[float, int, int, int, int]] = [(-log_probs[0][r], r, 0, r, -1) for r in range(top_k)]
        heapq.heapify(heap)
        counter = top_k
        while heap and len(tokens) < max_nodes:
            neg_score, _, depth, rank, parent = heapq.heappop(heap)
            tokens.append(ids[depth][rank])
            parents.append(parent)
            node = len(tokens) - 1
            if depth + 1 < num_heads:
                for r in range(top_k):
                    heapq.heappush(heap, (neg_score - log_probs[depth + 1][r], counter, depth + 1, r, node))
                    counter += 1
        return Draft(tokens=tokens, parents=parents)
    probs = logits_to_probs(head_logits, params)  # [K, vocab]
    rows: list[torch.Tensor] = []
    frontier = [(-1, 0)]  # (node, depth of its children)
    while frontier and len(tokens) < max_nodes:
        next_frontier = []
        for parent, depth in frontier:
            if depth >= num_heads:
                continue
            width = min(max(1, top_k >> depth), max_nodes - len(tokens))
            if width <= 0:
                break
            drawn = sample(probs[depth].expand(width, -1), generator).tolist()
            for token in drawn:
                tokens.append(int(token))
                parents.append(parent)
                rows.append(probs[depth])
                next_frontier.append((len(tokens) - 1, depth + 1))
        frontier = next_frontier
    return Draft(tokens=tokens, parents=parents, draft_probs=torch.stack(rows) if rows else None)


class MedusaDrafter(Drafter):
    """Drafts with Medusa heads on the target's last hidden state; no extra model forward.

    Head ``i`` applied to the final (normed) hidden state of the position before ``t0``
    (``state.last_hidden``, kept by the engine from the previous verification) proposes the
    token ``i + 1`` steps after ``t0``. Chain mode (the default) drafts the heads' top-1
    tokens, or when sampling one token from each head's processed distribution (the rows
    become ``draft_probs``, so verification stays lossless). With ``tree=True`` it proposes
    a sparse candidate tree (:func:`build_candidate_tree`) for tree verification.

    Args:
        heads: the loaded :class:`MedusaHeads` (on the model's device and dtype).
        tree: propose a candidate tree instead of a chain.
        tree_nodes: the most nodes of a tree.
        top_k: candidates per head in a tree.
    """

    name = "medusa"
    needs_hidden = True

    def __init__(self, heads: MedusaHeads, *, tree: bool = False, tree_nodes: int = 16, top_k: int = 4) -> None:
        self.heads = heads
        self.tree = tree
        self.tree_nodes = tree_nodes
        self.top_k = top_k

    def __repr__(self) -> str:
        tree = f", tree=True, tree_nodes={self.tree_nodes}, top_k={self.top_k}" if self.tree else ""
        return f"MedusaDrafter(num_heads={self.heads.num_heads}{tree})"

    def head_logits(self, state: DecodeState) -> torch.Tensor:
        """``[K, vocab]`` float32 logits of every head for the tokens after ``t0``."""
        if state.last_hidden is None:
            raise ConfigurationError("MedusaDrafter needs the engine to keep state.last_hidden (needs_hidden=True)")
        normed = state.runner.norm(state.last_hidden)  # [1, 1, hidden]
        return self.heads(normed)[:, 0, 0].float()  # [K, vocab]

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """Draft up to ``min(max_tokens, K)`` tokens (chain) or a candidate tree."""
        depth = min(max_tokens, self.heads.num_heads)
        if depth <= 0:
            return Draft()
        logits = self.head_logits(state)[:depth]
        if self.tree:
            return build_candidate_tree(logits, state.params, state.generator, self.tree_nodes, self.top_k)
        return draft_autoregressively(state, depth, lambda token, j: logits[j])


def load_pickled_heads(value: Any, loading: Mapping[str, Any]) -> Mapping[str, Any]:
    """With ``allow_pickle=True``, a folder's ``medusa_lm_head.pt`` loads now (the drafter reads safetensors only)."""
    if not (loading.get("allow_pickle") and isinstance(value, (str, os.PathLike))):
        return {}
    return {"medusa_heads": load_medusa_heads(value, allow_pickle=True)}


def engine_medusa_heads(engine: Any) -> MedusaHeads:
    """The heads for ``drafter="medusa"``, on the model's device and dtype, checked against it."""
    runner, heads = engine.runner, engine.config.medusa_heads
    if heads is None:
        heads = find_medusa_heads(engine.name_or_path)
        if heads is None:
            raise ConfigurationError(
                "drafter='medusa' needs medusa_heads= a folder of Medusa heads (config.json + "
                "medusa_lm_head.safetensors); none are saved for this model (in the user cache's medusa_heads/ "
                "folder, or beside it in its medusa/ subfolder). Train some with `selfspec train-medusa --model M`."
            )
    hidden = int(runner.config.hidden_size)
    if isinstance(heads, MedusaHeads):
        if heads.hidden_size != hidden or heads.vocab_size != runner.vocab_size:
            raise ConfigurationError(
                f"{heads!r} does not fit this model (hidden size {hidden}, vocab {runner.vocab_size})"
            )
        return heads.to(device=runner.device, dtype=runner.dtype)
    return load_medusa_heads(
        heads, hidden_size=hidden, vocab_size=runner.vocab_size, dtype=runner.dtype, device=runner.device
    )


def make_medusa(engine: Any, **options: Any) -> MedusaDrafter:
    """Medusa heads (``medusa_heads=``, else those saved beside the model); a tree with ``tree_nodes``."""
    heads = engine_medusa_heads(engine)
    tree_nodes = engine.config.tree_nodes
    if tree_nodes is None:
        return MedusaDrafter(heads, **options)
    return MedusaDrafter(heads, tree=True, tree_nodes=tree_nodes, **options)


def _rows(name: str, context: BenchContext) -> list[BenchRow]:
    """With heads saved beside the model: the chain (one draft token per head) and its candidate trees."""
    heads_folder = find_medusa_heads(context.loaded.name_or_path)
    if heads_folder is None:
        return []
    num_heads = read_medusa_config(heads_folder)["medusa_num_heads"]
    chain = BenchRow(
        f"selfspec_{name}",
        context.engine(drafter=name, num_draft_tokens=num_heads),
        f"Medusa heads, {num_heads} drafts, fixed",
        name,
    )

    def tree(nodes: int) -> BenchRow:  # the heads' candidates verified as a tree
        return BenchRow(
            f"selfspec_{name}_tree_{nodes}",
            context.engine(drafter=name, num_draft_tokens=num_heads, tree_nodes=nodes),
            f"Medusa candidate tree, at most {nodes} nodes and {num_heads} levels",
            name,
        )

    return [chain, *sampled(chain, context.temperatures), *tree_rows(context, tree)]


register_drafter(
    "medusa",
    make_medusa,
    description="Medusa heads on the last hidden state (medusa_heads=)",
    trees=True,
    options=OPTIONS,
    bench=DrafterBench(_rows, {"medusa": "selfspec_medusa* (when Medusa heads are saved beside the model)"}),
)
