"""Train selfspec's bundled demo model: a deep, narrow Llama with LayerSkip-style early exits.

The model (16 layers x 192 hidden, vocab 4096, about 8.5 M parameters) is trained on Jane Austen's
novels mixed with a seeded synthetic chat, RAG and tool-use set, with the LayerSkip loss
(Elhoushi et al., 2024, "LayerSkip: Enabling Early Exit Inference and Self-Speculative Decoding",
arXiv:2404.16710): final-layer cross entropy plus 0.2 x the cross entropy of early exits at layers
2, 4 and 8 through the shared final norm and LM head. Its early exits then agree often with the
last layer, which makes lossless self-speculative decoding pay off on a CPU.

About 60% of the training tokens are Austen prose, the rest the synthetic mix. ``--copy-phase F``
optionally spends the first fraction ``F`` of the budget on a copy-heavy mix (random sequences and
JSON objects to echo, little prose) meant to grow induction heads early; in a 30-minute CPU run
(F = 0.25) it did not yet make the model copy from its prompt, so it is off by default.

Usage::

    cd scripts && python -m demo_model.demo --data austen.txt --out DIR --minutes 30
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import cast

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from demo_model.corpus import AustenSplit, WindowPacker, split_corpus
from demo_model.synthetic import Chat
from demo_model.threads import ThreadGovernor
from demo_model.tokenizer import ENDOFTEXT, IM_END, template_renderer, train_tokenizer
from demo_model.tool_chats import chat_stream, drill_stream
from demo_model.trainer import TrainConfig, TrainResult, choose_exit, evaluate, train

logger = logging.getLogger("demo_model.demo")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, type=Path, help="UTF-8 text of the Austen novels")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, help="training time budget (default 30)")
    budget.add_argument("--steps", type=int, help="training steps")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=40)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--layers", type=int, default=16, help="decoder layers (default 16)")
    p.add_argument("--hidden", type=int, default=192, help="hidden size, a multiple of 64 (default 192)")
    p.add_argument(
        "--tokenizer",
        type=Path,
        help="reuse the tokenizer of this model folder (e.g. a target's, for a draft model) instead of training one",
    )
    p.add_argument(
        "--exit-layers",
        type=int,
        nargs="*",
        default=[2, 4, 8],
        help="layers trained as early exits (default 2 4 8; give none for a model without early-exit losses)",
    )
    p.add_argument("--exit-weight", type=float, default=0.2)
    p.add_argument("--layer-dropout", type=float, default=0.05, help="skip rate of the last layer")
    p.add_argument("--prose-fraction", type=float, default=0.7, help="share of Austen tokens after the copy phase")
    p.add_argument("--copy-phase", type=float, default=0.0, help="fraction of the budget spent on a copy-heavy phase")
    p.add_argument("--copy-phase-prose", type=float, default=0.15, help="share of Austen tokens in that phase")
    p.add_argument("--heldout-fraction", type=float, default=0.02)
    p.add_argument(
        "--threads", default="auto", help="torch threads, or 'auto': 2, dropping to 1 while other processes are busy"
    )
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.minutes is None and args.steps is None:
        args.minutes = 30.0
    return args


def token_id(tok: PreTrainedTokenizerFast, token: str) -> int:
    """The id of one token of the vocabulary."""
    ids = tok.convert_tokens_to_ids(token)
    if not isinstance(ids, int):
        raise TypeError(f"{token!r} is not a single token")
    return ids


def render(renderer: PreTrainedTokenizerFast, chat: Chat) -> str:
    """A synthetic chat rendered to text through the chat template."""
    tools = cast("list[dict | Callable]", chat.tools)
    text = renderer.apply_chat_template(chat.messages, tools=tools, tokenize=False)
    if not isinstance(text, str):
        raise TypeError("the chat template did not render to text")
    return text


def model_config(tok: PreTrainedTokenizerFast, vocab_size: int, layers: int = 16, hidden: int = 192) -> LlamaConfig:
    """The demo architecture: 16 layers x 192 hidden, 3 heads (of 64), tied embeddings."""
    eot = token_id(tok, ENDOFTEXT)
    if hidden % 64:
        raise ValueError(f"--hidden must be a multiple of 64 (heads of 64), got {hidden}")
    return LlamaConfig(
        vocab_size=max(vocab_size, len(tok)),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=eot,
        eos_token_id=token_id(tok, IM_END),
        pad_token_id=eot,
    )


def synthetic_texts(split: AustenSplit, args: argparse.Namespace) -> list[str]:
    """Render enough seeded synthetic chats for a 60% prose share (plus a margin)."""
    renderer = template_renderer()
    budget = sum(map(len, split.train_docs)) * 0.4 / 0.6 * 1.15
    texts: list[str] = []
    for chat in chat_stream(split.train_paragraphs, args.seed):
        texts.append(render(renderer, chat))
        budget -= len(texts[-1])
        if budget <= 0 and len(texts) >= 300:
            return texts
    return texts


def drill_texts(split: AustenSplit, count: int, seed: int) -> list[str]:
    """Render ``count`` seeded copy drills."""
    renderer = template_renderer()
    return [render(renderer, c) for c in itertools.islice(drill_stream(split.train_paragraphs, seed), count)]


def tokenize_all(tok: PreTrainedTokenizerFast, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added (no length limit)."""
    encodings = tok.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return [e.ids for e in encodings]


def prose_stream(tok: PreTrainedTokenizerFast, docs: Sequence[str]) -> list[int]:
    """All documents as one token stream, each followed by ``<|endoftext|>``."""
    eot = token_id(tok, ENDOFTEXT)
    return [t for ids in tokenize_all(tok, docs) for t in [*ids, eot]]


def eval_windows(tok: PreTrainedTokenizerFast, texts: Sequence[str], length: int) -> list[list[int]]:
    """Pack held-out texts into windows of ``length`` tokens (at least one, padded if short)."""
    stream = prose_stream(tok, texts)
    windows = [stream[i : i + length] for i in range(0, len(stream) - length + 1, length)]
    if not windows:
        eot = token_id(tok, ENDOFTEXT)
        windows = [(stream + [eot] * length)[:length]]
    return windows


def curriculum(
    first: Iterator[torch.Tensor], then: Iterator[torch.Tensor], switch: float
) -> Callable[[float], torch.Tensor]:
    """Batches from ``first`` until ``switch`` of the budget is used, then from ``then``."""
    return lambda progress: next(first if progress < switch else then)


def batch_iter(packer: WindowPacker, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless batches of windows, reshuffled each epoch."""
    for epoch in itertools.count():
        windows = packer.epoch(random.Random(seed * 1000 + epoch))
        while batch := list(itertools.islice(windows, batch_size)):
            if len(batch) == batch_size:
                yield torch.tensor(batch)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """Training settings from the command line."""
    return TrainConfig(
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        exit_layers=tuple(args.exit_layers),
        exit_weight=args.exit_weight,
        layer_dropout=args.layer_dropout,
        max_steps=args.steps,
        max_seconds=None if args.minutes is None else args.minutes * 60,
        log_every=args.log_every,
    )


def save_outputs(out: Path, model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, meta: dict) -> None:
    """Write the float16 model, generation config, tokenizer and JSON reports to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    eot, im_end = token_id(tok, ENDOFTEXT), token_id(tok, IM_END)
    model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot)
    model.half().save_pretrained(out)
    tok.save_pretrained(out, save_jinja_files=False)
    _name_tokenizer_class(out / "tokenizer_config.json")
    for name in ("training_args", "eval", "selfspec"):
        (out / f"{name}.json").write_text(json.dumps(meta[name], indent=2, ensure_ascii=False) + "\n")
    for path in out.iterdir():
        path.chmod(0o644)


def _name_tokenizer_class(path: Path) -> None:
    """Record the portable class name ``PreTrainedTokenizerFast`` (transformers 5 writes its alias)."""
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # left by loading a reused tokenizer from a folder
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def run(args: argparse.Namespace) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast, dict]:
    """Prepare data, train and evaluate; return the model, tokenizer and JSON reports."""
    governor = ThreadGovernor(2) if args.threads == "auto" else None
    if governor is None:
        torch.set_num_threads(int(args.threads))
    torch.manual_seed(args.seed)
    split = split_corpus(args.data.read_text(encoding="utf-8"), args.heldout_fraction, args.seed)
    chats = synthetic_texts(split, args)
    if args.tokenizer is not None:
        tok = PreTrainedTokenizerFast.from_pretrained(str(args.tokenizer))
    else:
        tok = train_tokenizer(itertools.chain(split.train_docs, chats), args.vocab_size)
    prose, docs = prose_stream(tok, split.train_docs), tokenize_all(tok, chats)
    eot = token_id(tok, ENDOFTEXT)
    drills = tokenize_all(tok, drill_texts(split, 2 * len(chats), args.seed)) if args.copy_phase > 0 else []
    copy_packer = WindowPacker(prose, drills + docs[: len(docs) // 3], args.seq_len + 1, eot, args.copy_phase_prose)
    main_packer = WindowPacker(prose, docs, args.seq_len + 1, eot, args.prose_fraction)
    data: dict[str, float] = {
        "prose_tokens": len(prose),
        "chat_docs": len(docs),
        "chat_tokens": sum(map(len, docs)),
        "drill_docs": len(drills),
        "drill_tokens": sum(map(len, drills)),
        "heldout_paragraphs": len(split.heldout_paragraphs),
        "tokenizer_size": len(tok),
    }
    logger.info("data: %s", data)
    model = LlamaForCausalLM(model_config(tok, args.vocab_size, args.layers, args.hidden))
    logger.info("model: %.2f M parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    batches = curriculum(
        batch_iter(copy_packer, args.batch_size, args.seed),
        batch_iter(main_packer, args.batch_size, args.seed),
        args.copy_phase,
    )
    result = train(model, batches, train_config(args), args.seed, governor)
    used = [copy_packer, main_packer]
    data["prose_share_trained"] = round(
        sum(p.prose_yielded for p in used) / max(1, sum(p.tokens_yielded for p in used)), 3
    )
    data["thread_switches"] = governor.switches if governor else 0
    return model, tok, reports(args, model, tok, split, result, data)


@torch.no_grad()
def copy_accuracy(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, chats: Sequence[Chat]) -> float:
    """Teacher-forced accuracy of the last layer on the answers of two-message chats (copy drills)."""
    correct = total = 0
    for chat in chats:
        prompt = tok.apply_chat_template(chat.messages[:1], add_generation_prompt=True, tokenize=False)
        start = len(tokenize_all(tok, [str(prompt)])[0])
        full = tokenize_all(tok, [render(tok, chat)])[0]
        answer = torch.tensor(full[start:-2])  # the answer without "<|im_end|>\n"
        logits = model(input_ids=torch.tensor([full]), use_cache=False).logits[0]
        correct += int((logits[start - 1 : len(full) - 3].argmax(-1) == answer).sum())
        total += answer.numel()
    return round(correct / max(1, total), 4)


def reports(
    args: argparse.Namespace,
    model: LlamaForCausalLM,
    tok: PreTrainedTokenizerFast,
    split: AustenSplit,
    result: TrainResult,
    data: dict,
) -> dict:
    """Evaluate the trained model and assemble training_args, eval and selfspec reports."""
    length = args.seq_len + 1
    heldout = evaluate(model, eval_windows(tok, split.heldout_paragraphs, length))
    chat_eval = list(itertools.islice(chat_stream(split.train_paragraphs, args.seed + 1), 64))
    renderer = template_renderer()
    chat_texts = [render(renderer, c) for c in chat_eval]
    chat = evaluate(model, eval_windows(tok, chat_texts, length))
    drills = list(itertools.islice(drill_stream(split.train_paragraphs, args.seed + 2), 64))
    layers = model.config.num_hidden_layers
    exit_layer, drafts, speedup = choose_exit(heldout["agreement"], layers, max_exit=min(8, layers - 1))
    train_args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "argv"}
    return {
        "training_args": {
            **train_args,
            "command": " ".join(["python -m demo_model.demo", *args.argv]),
            "data_stats": data,
            "steps_done": result.steps,
            "tokens_seen": result.tokens,
            "train_seconds": round(result.seconds, 1),
            "tokens_per_second": round(result.tokens / max(result.seconds, 1e-9), 1),
            "parameters": sum(p.numel() for p in model.parameters()),
            "loss": "final CE + exit_weight * sum(CE at exit_layers), shared norm + head"
            if args.exit_layers
            else "final CE only (no early-exit losses)",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "eval": {
            "heldout_austen": heldout,
            "heldout_chat": chat,
            "copy_accuracy": copy_accuracy(model, tok, drills),
            "train_loss_first": round(result.first_loss, 4),
            "train_loss_last": round(result.last_loss, 4),
            "history": result.history,
        },
        "selfspec": {
            "exit_layer": exit_layer,
            "num_draft_tokens": drafts,
            "source": "train-demo",
            "expected_speedup": round(speedup, 3),
            "agreement": heldout["agreement"],
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    args = parse_args(argv)
    start = time.monotonic()
    model, tok, meta = run(args)
    save_outputs(args.out, model, tok, meta)
    agreement = meta["eval"]["heldout_austen"]["agreement"]
    print("agreement with the last layer (held-out Austen):")
    print("  " + "  ".join(f"{e}:{a:.3f}" for e, a in agreement.items()))
    print(f"selfspec.json: {json.dumps(meta['selfspec'])}")
    print(f"done in {time.monotonic() - start:.0f}s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
