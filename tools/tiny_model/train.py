"""Train the tiny Qwen3 model on the corpus for a fixed wall-clock budget and write a
Hugging Face folder that kvfit and transformers both load.

The model is transformers' own `Qwen3ForCausalLM` (q/k RMSNorm, GQA, tied embeddings), so the
checkpoint's names and config are the ones kvfit's Qwen3 reads; the loop is plain torch:
AdamW, linear warmup then cosine decay, bf16 autocast on CUDA, float32 on the CPU. The run
ends when the wall-clock budget (`--minutes`) or `--max-epochs` passes over the training split
is spent, whichever comes first, and the schedule follows that budget: on a CPU the clock
binds, on a fast GPU the epochs do (the corpus is 2.4M tokens; more passes only overfit).
Every `--eval-every-s` seconds the held-out split is scored and the best weights so far are
written, so the model kept is the one that generalised best, not the last one.

    PYTHONPATH=src python3 tools/tiny_model/train.py --corpus /tmp/sotu/corpus.txt --minutes 4 \\
        --tokenizer src/kvfit/models/configs/kvfit-sotu --out /tmp/kvfit-sotu

writes config.json, generation_config.json, tokenizer files, model.safetensors (bf16) and
training_report.json (steps, tokens, losses, validation perplexity, seconds, device).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from corpus import sha256
from tokenizer import END_OF_TEXT_ID, IM_END_ID, VOCAB_SIZE, documents, save, train_tokenizer
from tokenizers import Tokenizer
from transformers import Qwen3Config, Qwen3ForCausalLM

MAX_CHECKPOINT_BYTES = 16 * 2**20  # the bound on what ships in the repository


@dataclass
class ModelShape:
    """The architecture; head_dim 64 and 2 KV heads keep GQA and q/k norm meaningful."""

    hidden_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0

    def hf_config(self, vocab_size: int) -> Qwen3Config:
        """The transformers config of this shape (tied embeddings, no q/k/v bias)."""
        return Qwen3Config(
            vocab_size=vocab_size, **asdict(self), rms_norm_eps=1e-6,
            tie_word_embeddings=True, attention_bias=False, bos_token_id=END_OF_TEXT_ID,
            eos_token_id=[IM_END_ID, END_OF_TEXT_ID], pad_token_id=END_OF_TEXT_ID,
            architectures=["Qwen3ForCausalLM"],
        )


@dataclass
class TrainConfig:
    """What the loop does; the defaults are the H200 run's (the CPU run passes smaller ones)."""

    minutes: float = 4.0
    max_epochs: float = 10.0
    batch_size: int = 64
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_fraction: float = 0.03
    weight_decay: float = 0.1
    val_fraction: float = 0.05
    val_tokens: int = 131072
    eval_every_s: float = 20.0
    seed: int = 0


@dataclass
class Report:
    """training_report.json: enough to judge the run and to reproduce it."""

    device: str
    parameters: int
    corpus_sha256: str
    train_tokens: int
    val_tokens: int
    steps: int = 0
    tokens_seen: int = 0
    epochs: float = 0.0
    seconds: float = 0.0
    final_train_loss: float = float("nan")
    best_val_loss: float = float("inf")
    best_val_step: int = 0
    val_perplexity: float = float("inf")
    uniform_perplexity: float = 0.0
    checkpoint_bytes: int = 0
    model: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    evals: list[dict] = field(default_factory=list)


def is_held_out(index: int, val_fraction: float = TrainConfig.val_fraction) -> bool:
    """Whether document `index` of the corpus is in the validation split: every k-th one, so
    the validation text spans all eras of the corpus rather than only its last years."""
    every = max(2, round(1 / val_fraction))
    return index % every == every - 1


def split_ids(tokenizer: Tokenizer, docs: list[str], val_fraction: float,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the train and validation splits (`is_held_out`), each document followed
    by <|endoftext|>."""
    splits: tuple[list[int], list[int]] = ([], [])
    for i, encoding in enumerate(tokenizer.encode_batch(docs)):
        splits[is_held_out(i, val_fraction)].extend([*encoding.ids, END_OF_TEXT_ID])
    return torch.tensor(splits[0]), torch.tensor(splits[1])


def random_windows(ids: torch.Tensor, batch: int, seq_len: int,
                   generator: torch.Generator) -> torch.Tensor:
    """`batch` windows of seq_len + 1 tokens at random offsets (inputs and shifted labels)."""
    starts = torch.randint(0, len(ids) - seq_len - 1, (batch,), generator=generator)
    return torch.stack([ids[s:s + seq_len + 1] for s in starts.tolist()])


def lr_at(progress: float, cfg: TrainConfig) -> float:
    """Linear warmup then cosine down to min_lr_ratio x lr, over the fraction of time spent."""
    if progress < cfg.warmup_fraction:
        return cfg.lr * progress / cfg.warmup_fraction
    t = min(1.0, (progress - cfg.warmup_fraction) / (1 - cfg.warmup_fraction))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def loss_of(model: Qwen3ForCausalLM, windows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Mean next-token cross entropy of `windows` (bf16 autocast on CUDA)."""
    windows = windows.to(device, non_blocking=True)
    with torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), windows[:, 1:].flatten())


@torch.no_grad()
def validation_loss(model: Qwen3ForCausalLM, val_ids: torch.Tensor, cfg: TrainConfig,
                    device: torch.device) -> float:
    """Mean loss over the first `val_tokens` of the validation split in contiguous windows
    (the same windows at every evaluation, so the numbers compare)."""
    n = min(cfg.val_tokens, len(val_ids) - 1) // cfg.seq_len
    windows = val_ids[: n * cfg.seq_len + 1].unfold(0, cfg.seq_len + 1, cfg.seq_len)
    model.eval()
    losses = [loss_of(model, chunk, device).item() * len(chunk)
              for chunk in windows.split(cfg.batch_size)]
    model.train()
    return sum(losses) / len(windows)


def optimizer_for(model: Qwen3ForCausalLM, cfg: TrainConfig,
                  device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (not norms, as usual); fused on CUDA."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def train(model: Qwen3ForCausalLM, train_ids: torch.Tensor, val_ids: torch.Tensor,
          cfg: TrainConfig, device: torch.device, report: Report,
          on_best: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Run the loop until cfg.minutes or cfg.max_epochs is spent, whichever comes first (the
    schedule follows that one); `on_best(state_dict)` with a CPU copy of the weights at each
    new best validation loss (so a run cut short still leaves its best checkpoint)."""
    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer = optimizer_for(model, cfg, device)
    budget = cfg.minutes * 60
    start = time.perf_counter()
    last_eval = -math.inf  # the first evaluation is of the untrained model: the baseline
    model.train()
    while True:
        elapsed = time.perf_counter() - start
        progress = max(elapsed / budget,
                       report.tokens_seen / (cfg.max_epochs * len(train_ids)))
        done = progress >= 1.0
        if done or time.perf_counter() - last_eval >= cfg.eval_every_s:
            val = validation_loss(model, val_ids, cfg, device)
            report.evals.append({"step": report.steps, "seconds": round(elapsed, 1),
                                 "train_loss": round(report.final_train_loss, 4),
                                 "val_loss": round(val, 4)})
            print(json.dumps(report.evals[-1]), flush=True)
            report.seconds = round(elapsed, 1)
            if val < report.best_val_loss:
                report.best_val_loss, report.best_val_step = val, report.steps
                on_best({k: v.detach().to("cpu", copy=True)
                         for k, v in model.state_dict().items()})
            last_eval = time.perf_counter()
        if done:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(progress, cfg)
        loss = loss_of(model, random_windows(train_ids, cfg.batch_size, cfg.seq_len, generator),
                       device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        report.steps += 1
        report.tokens_seen += cfg.batch_size * cfg.seq_len
        if report.steps % 10 == 0:
            report.final_train_loss = loss.item()


def write_checkpoint(model: Qwen3ForCausalLM, state: dict[str, torch.Tensor],
                     tokenizer_dir: Path, out: Path) -> int:
    """Save `state` in bf16 with `model`'s config and the tokenizer files; the checkpoint's
    bytes. The tied LM head is not written twice (kvfit and transformers re-tie it)."""
    if model.config.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    model.save_pretrained(out, state_dict={k: v.to(torch.bfloat16) for k, v in state.items()})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if tokenizer_dir != out:
            shutil.copy(tokenizer_dir / name, out / name)
    finish_config(out / "config.json")
    size = (out / "model.safetensors").stat().st_size
    if size > MAX_CHECKPOINT_BYTES:
        raise RuntimeError(f"model.safetensors is {size} bytes, over {MAX_CHECKPOINT_BYTES}: "
                           f"lower --hidden-size or --layers")
    return size


def finish_config(config_json: Path) -> None:
    """Name the checkpoint's dtype (bf16; the model trained in float32), also spelled the
    transformers 4.x way, as is rope theta: 5.x writes only `rope_parameters`, and 4.x would
    silently read rope_theta 1e6 (Qwen3's default) from such a file, a different model."""
    config = json.loads(config_json.read_text())
    if "rope_parameters" in config:
        config.setdefault("rope_theta", config["rope_parameters"]["rope_theta"])
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    config_json.write_text(json.dumps(config, indent=2) + "\n")


def write_report(report: Report, out: Path) -> None:
    """training_report.json in `out` (rewritten at each new best and at the end)."""
    (out / "training_report.json").write_text(json.dumps(asdict(report), indent=2) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    s, t = ModelShape(), TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, required=True, help="corpus.txt from corpus.py")
    p.add_argument("--out", type=Path, required=True, help="folder for the model")
    p.add_argument("--tokenizer", type=Path,
                   help="folder with tokenizer.json to reuse (default: train one on the corpus)")
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE,
                   help="of the tokenizer trained when --tokenizer is not given")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=t.minutes, help="wall-clock budget")
    p.add_argument("--max-epochs", type=float, default=t.max_epochs,
                   help="passes over the training split at most: on a fast GPU this ends the "
                   "run first (more passes over a small corpus only overfit)")
    p.add_argument("--batch-size", type=int, default=t.batch_size)
    p.add_argument("--seq-len", type=int, default=t.seq_len)
    p.add_argument("--lr", type=float, default=t.lr)
    p.add_argument("--eval-every-s", type=float, default=t.eval_every_s)
    p.add_argument("--val-tokens", type=int, default=t.val_tokens)
    p.add_argument("--hidden-size", type=int, default=s.hidden_size)
    p.add_argument("--intermediate-size", type=int, default=s.intermediate_size)
    p.add_argument("--layers", type=int, default=s.num_hidden_layers)
    p.add_argument("--seed", type=int, default=t.seed)
    p.add_argument("--cpu-threads", type=int, default=1,
                   help="torch threads on the CPU (default 1: on a shared machine, threads "
                   "that spin while others wait make each step several times slower)")
    p.add_argument("--init", type=Path,
                   help="continue from this model folder's weights and shape (the shape flags "
                   "are then ignored); the schedule starts over")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.device == "cpu":
        torch.set_num_threads(args.cpu_threads)
    device = torch.device(args.device)
    shape = ModelShape(hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                       intermediate_size=args.intermediate_size)
    cfg = TrainConfig(minutes=args.minutes, max_epochs=args.max_epochs,
                      batch_size=args.batch_size, seq_len=args.seq_len,
                      lr=args.lr, eval_every_s=args.eval_every_s, val_tokens=args.val_tokens,
                      seed=args.seed)
    docs = documents(args.corpus)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = args.tokenizer or args.out
    if args.tokenizer is None:
        save(train_tokenizer(docs, args.vocab_size), args.out)
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    train_ids, val_ids = split_ids(tokenizer, docs, cfg.val_fraction)
    if args.init:
        model = Qwen3ForCausalLM.from_pretrained(args.init, dtype=torch.float32).to(device)
        c = model.config
        shape = ModelShape(hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
                           intermediate_size=c.intermediate_size)
    else:
        model = Qwen3ForCausalLM(shape.hf_config(tokenizer.get_vocab_size())).to(device)
    report = Report(device=str(torch.cuda.get_device_name(device) if device.type == "cuda"
                               else "cpu"),
                    parameters=sum(p.numel() for p in model.parameters()),
                    corpus_sha256=sha256(args.corpus), train_tokens=len(train_ids),
                    val_tokens=len(val_ids), uniform_perplexity=tokenizer.get_vocab_size(),
                    model=asdict(shape), train=asdict(cfg))
    print(f"{report.parameters} parameters, {len(train_ids)} train / {len(val_ids)} validation "
          f"tokens, {cfg.minutes} min on {report.device}", flush=True)

    def on_best(state: dict[str, torch.Tensor]) -> None:
        report.epochs = round(report.tokens_seen / len(train_ids), 2)
        report.val_perplexity = round(math.exp(report.best_val_loss), 2)
        report.checkpoint_bytes = write_checkpoint(model, state, tokenizer_dir, args.out)
        write_report(report, args.out)

    train(model, train_ids, val_ids, cfg, device, report, on_best)
    report.epochs = round(report.tokens_seen / len(train_ids), 2)
    write_report(report, args.out)
    print(f"validation perplexity {report.val_perplexity} (uniform: {tokenizer.get_vocab_size()})"
          f" after {report.steps} steps, {report.tokens_seen} tokens, {report.seconds} s; "
          f"wrote {args.out}", flush=True)
    return report


if __name__ == "__main__":
    main()
