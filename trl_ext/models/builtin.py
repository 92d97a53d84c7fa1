"""The embedded offline model behind ``--model builtin``: a SimpleStories-shaped Llama built from our own stories.

Recipe (bump ``VERSION`` whenever anything below changes; the cache directory name carries it):

- corpus: ``environments.stories.generate_stories(CORPUS_STORIES, seed=PRETRAIN_SEED)``, disjoint
  from the held-out stories that prompts come from;
- tokenizer: WordPiece trained with ``tokenizers`` following SimpleStories' tokenizer
  (simple_stories_train/tokenizer.py): lowercase normalizer; whitespace, punctuation and single-digit
  pre-tokenizers; ``[UNK]`` = 0, ``[EOS]`` = 1, no BOS, no PAD; a post-processor that appends
  ``[EOS]`` when ``add_special_tokens=True``; WordPiece decoder; vocab <= 4096;
- model: ``LlamaForCausalLM`` shaped like SimpleStories-1.25M (the "llama-1.25M" preset of
  simple_stories_train/models/model_configs.py): 4 layers, hidden 128, 4 heads with 2 key/value
  heads, SwiGLU intermediate ``128 * 4 * 2 // 3 = 341``, tied input/output embeddings (that preset
  ties them; with its 4019-token vocab this gives ~1.25M parameters), context 512, RMSNorm eps 1e-6,
  RoPE base 10000, ``eos_token_id=1``, no BOS;
- pretraining: plain torch loop on CPU with 2 threads, ``STEPS`` steps; AdamW, linear warmup then cosine decay;
  windows of ``SEQ_LEN`` tokens that start at a story start and run on through the next stories
  (each story followed by ``[EOS]``), so position 0 looks like a prompt at generation time.

The model lives in ``<cache>/builtin-<VERSION>/`` (``<cache>`` = ``$TRL_EXT_CACHE`` or
``~/.cache/trl_ext``), is made on first use under a file lock (several processes started at once
make it once), in a temporary directory that is renamed into place when complete. On first use it is a copy of
the build committed in ``trl_ext/models/pinned/`` (seconds, the same weights on every machine); ``--rebuild`` builds
it from the recipe below (minutes; seeded but not bitwise the same on another machine or torch version).

CLI: ``uv run python -m trl_ext.models.builtin [--rebuild]`` prints the path and the build info.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUILTIN = "builtin"  # the --model value that selects this model
VERSION = "v1"
CACHE_ENV = "TRL_EXT_CACHE"
DEFAULT_CACHE = Path("~/.cache/trl_ext")
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "build_info.json")
# Committed builds, one directory per cache directory name (builtin-v1, builtin-env-v1, ...): `ensure_built` installs
# them instead of building; ``python -m trl_ext.models.<name> --rebuild --pin`` writes one (`cli`).
PINNED_DIR = Path(__file__).resolve().parent / "pinned"

CORPUS_STORIES = 20_000
TRAIN_SEED = 1234
SEQ_LEN = 128
BATCH_SIZE = 32
STEPS = 200
PEAK_LR = 5e-3
MIN_LR_FRACTION = 0.1
WARMUP_STEPS = 10
WEIGHT_DECAY = 0.01
NUM_THREADS = 2
# Build-info measurement: samples of INFO_NEW_TOKENS tokens at temperature 1 from held-out "test" prompts.
INFO_SAMPLES = 200
INFO_PROMPT_LENGTH = 8
INFO_NEW_TOKENS = 64

_HAPPY = re.compile(r"\bhappy\b", re.IGNORECASE)


def cache_dir() -> Path:
    """``$TRL_EXT_CACHE`` if set, else ``~/.cache/trl_ext``."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def builtin_dir() -> Path:
    return cache_dir() / f"builtin-{VERSION}"


def _is_complete(path: Path) -> bool:
    if not path.exists():
        return False
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise RuntimeError(
            f"builtin model directory {path} is incomplete (missing {missing}); "
            "rebuild it with `uv run python -m trl_ext.models.builtin --rebuild`"
        )
    return True


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[builtin] waiting for another process to finish building ({path} is locked)", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_builtin(rebuild: bool = False) -> Path:
    """The built model's directory; builds it (once, under a file lock) when absent or when ``rebuild``."""
    return ensure_built(builtin_dir(), "trl_ext.models.builtin", rebuild, "the builtin model")


def pinned_build(target: Path) -> Path | None:
    """The committed build of ``target``'s model and version (``PINNED_DIR / target.name``), if there is one."""
    pinned = PINNED_DIR / target.name
    return pinned if pinned.is_dir() and all((pinned / name).is_file() for name in REQUIRED_FILES) else None


def ensure_built(target: Path, module: str, rebuild: bool, label: str) -> Path:
    """``target``, made once under a file lock, atomically: a copy of the pinned build when the package ships one
    (`pinned_build`: the same weights on every machine, in a second), else (and with ``rebuild``) built with
    ``python -m {module} --build-into DIR``."""
    if not rebuild and _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f"{target.name}.lock"):
        if not rebuild and _is_complete(target):  # built by another process while we waited
            return target
        pinned = None if rebuild else pinned_build(target)
        if pinned is not None:
            print(f"[builtin] installing the pinned build of {label} into {target}", file=sys.stderr)
        else:
            print(f"[builtin] building {label} into {target} (first use takes a few minutes)", file=sys.stderr)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-build-", dir=target.parent))
        try:
            if pinned is not None:
                shutil.copytree(pinned, tmp, dirs_exist_ok=True)
            else:
                _build_in_subprocess(tmp, module)
            tmp.chmod(0o755)  # mkdtemp makes it private
            if target.exists():
                old = target.parent / f".{target.name}-old-{os.getpid()}"
                target.rename(old)
                tmp.rename(target)
                shutil.rmtree(old)
            else:
                tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    return target


def _build_in_subprocess(out_dir: Path, module: str) -> None:
    """Run ``python -m {module} --build-into out_dir`` in a fresh interpreter with OMP_WAIT_POLICY=PASSIVE.

    libgomp reads the wait policy once, when torch is imported. Its default (spinning) makes 2-thread
    torch several times slower when other processes share the cores; a child process gets the
    passive policy whatever the caller imported, and leaves the caller's threads and RNG untouched.
    """
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", module, "--build-into", str(out_dir)]
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:  # progress goes to the caller's stderr (and whatever tees it)
            sys.stderr.write(line)
            sys.stderr.flush()
    if proc.returncode != 0:
        raise RuntimeError(f"building failed (exit code {proc.returncode}): {' '.join(cmd)}")


def train_tokenizer(stories: list[str]):
    """WordPiece tokenizer with SimpleStories' conventions, wrapped for transformers.

    Trained with ``tokenizers``' WordPieceTrainer, then pruned like SimpleStories' ``prune_tokenizer``
    to the tokens the corpus uses (plus the single-character alphabet, so unseen words split into
    pieces rather than becoming [UNK]) and re-indexed in sorted order: the trainer's ids and its
    tie-breaking between equally frequent merges vary from process to process; the pruned vocab does not.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[UNK]", "[EOS]"]

    def pipeline(tok):
        tok.normalizer = normalizers.Sequence([normalizers.Lowercase()])
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation(), pre_tokenizers.Digits(individual_digits=True)]
        )
        tok.decoder = decoders.WordPiece(prefix="##")
        return tok

    trained = pipeline(Tokenizer(models.WordPiece(unk_token="[UNK]")))
    trained.train_from_iterator(
        stories, trainers.WordPieceTrainer(vocab_size=4096, special_tokens=specials, show_progress=False)
    )
    used = {t for enc in trained.encode_batch(stories) for t in enc.tokens}
    alphabet = {t for t in trained.get_vocab() if len(t.removeprefix("##")) == 1}
    vocab = specials + sorted((used | alphabet) - set(specials))
    tok = pipeline(Tokenizer(models.WordPiece(vocab={t: i for i, t in enumerate(vocab)}, unk_token="[UNK]")))
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tok.post_processor = processors.TemplateProcessing(single="$A [EOS]", special_tokens=[("[EOS]", 1)])
    if tok.token_to_id("[UNK]") != 0 or tok.token_to_id("[EOS]") != 1 or tok.get_vocab_size() > 4096:
        raise RuntimeError("tokenizer breaks SimpleStories' conventions ([UNK]=0, [EOS]=1, vocab <= 4096)")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")


def model_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=128 * 4 * 2 // 3, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=1, pad_token_id=None,
    )  # fmt: skip


def _lr(step: int, steps: int) -> float:
    """Linear warmup to PEAK_LR, then cosine decay to MIN_LR_FRACTION * PEAK_LR at ``steps``."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
    return PEAK_LR * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer_step(model, opt, loss, losses: list[float]) -> None:
    """One step of the builds' training loops: backward, gradient norm clipped at 1.0, the optimizer's step, gradients
    cleared; the loss joins ``losses``."""
    import torch

    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())


def _pretrain(model, stream, starts, log, steps: int, seq_len: int) -> list[float]:
    import torch

    gen = torch.Generator().manual_seed(TRAIN_SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY)
    model.train()
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps)
        idx = starts[torch.randint(len(starts), (BATCH_SIZE,), generator=gen)]
        batch = stream[idx[:, None] + torch.arange(seq_len)[None, :]]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer_step(model, opt, loss, losses)
        if step % 20 == 0 or step == steps - 1:
            log(f"step {step}/{steps} loss {loss.item():.3f} lr {_lr(step, steps):.2e}")
    model.eval()
    return losses


def sample_stats(model, tokenizer, n: int = INFO_SAMPLES, seed: int = 0, context: str = "") -> dict:
    """Sample ``n`` completions at temperature 1 from held-out test prompts: happy rate, unique fraction.

    ``context``: text whose tokens precede every prompt's (as a distillation teacher sees it).
    """
    import torch

    from environments.stories import load_prompts

    prompts = list(load_prompts(BUILTIN, tokenizer, INFO_PROMPT_LENGTH, split="test", n=n, seed=seed)["prompt"])
    enc = tokenizer(prompts, add_special_tokens=False, return_tensors="pt")  # all prompts have equal length
    if context:
        ids = torch.cat([torch.tensor(tokenizer(context, add_special_tokens=False)["input_ids"]).expand(n, -1),
                         enc["input_ids"]], 1)  # fmt: skip
        enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=INFO_NEW_TOKENS,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return {
        "sample_happy_rate": sum(bool(_HAPPY.search(t)) for t in texts) / n,
        "sample_unique_fraction": len(set(texts)) / n,
        "samples": [p + " ||| " + t for p, t in zip(prompts[:5], texts[:5])],
    }


def build_builtin(out_dir: Path) -> dict:
    """Generate the corpus, train tokenizer and model, save both into ``out_dir``; return the build info.

    Runs with ``NUM_THREADS`` torch threads and a forked global RNG; both are restored afterwards.
    """
    import torch

    t0 = time.time()
    threads = torch.get_num_threads()
    torch.set_num_threads(NUM_THREADS)
    try:
        with torch.random.fork_rng(devices=[]):
            return _build(Path(out_dir), t0)
    finally:
        torch.set_num_threads(threads)


def _build(out_dir: Path, t0: float) -> dict:
    from environments.stories import PRETRAIN_SEED, generate_stories

    log = build_logger("builtin", t0)
    stories = generate_stories(CORPUS_STORIES, seed=PRETRAIN_SEED)
    model, tokenizer, info = pretrain_on(stories, train_tokenizer(stories), log)
    return save_build(out_dir, model, tokenizer, {"version": VERSION, **info, **sample_stats(model, tokenizer)}, t0, log)


def build_logger(label: str, t0: float):
    def log(msg):
        print(f"[{label} {time.time() - t0:5.0f}s] {msg}", file=sys.stderr, flush=True)

    return log


def pretrain_on(docs: list[str], tokenizer, log, steps: int = STEPS, seq_len: int = SEQ_LEN):
    """The recipe's model pretrained on ``docs`` (each followed by [EOS]) for ``steps`` on windows of ``seq_len``
    tokens: ``(model, tokenizer, info)``."""
    import torch
    from transformers import LlamaForCausalLM

    ids = tokenizer(docs, add_special_tokens=True)["input_ids"]  # each document ends with [EOS]
    lengths = torch.tensor([len(x) for x in ids])
    stream = torch.tensor([t for x in ids for t in x] + [tokenizer.eos_token_id] * seq_len)
    starts = torch.cumsum(lengths, 0) - lengths
    log(f"corpus {len(docs)} documents, {int(lengths.sum())} tokens, vocab {len(tokenizer)}")
    torch.manual_seed(TRAIN_SEED)
    model = LlamaForCausalLM(model_config(len(tokenizer)))
    model.generation_config.bos_token_id = None
    model.generation_config.eos_token_id = 1
    losses = _pretrain(model, stream, starts, log, steps, seq_len)
    info = {
        "corpus_stories": len(docs),
        "corpus_tokens": int(lengths.sum()),
        "vocab_size": len(tokenizer),
        "n_params": sum(p.numel() for p in model.parameters()),
        "steps": steps,
        "tokens_seen": steps * BATCH_SIZE * seq_len,
        "final_loss": sum(losses[-20:]) / len(losses[-20:]),
    }
    return model, tokenizer, info


def save_build(out_dir: Path, model, tokenizer, info: dict, t0: float, log) -> dict:
    """Save model and tokenizer into ``out_dir`` with ``build_info.json``: ``info``, the build seconds, the torch
    version and the weights' SHA-256. Builds are seeded but not bitwise reproducible across machines (CPU kernels
    and torch versions round differently, and pretraining amplifies it), so the hash tells two builds apart: an
    experiment that must continue on another machine pins its starting weights (see experiments/models/)."""
    import torch

    from trl_ext.runs.provenance import file_sha256

    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    info["seconds"] = round(time.time() - t0, 1)
    info["torch"] = torch.__version__
    info["weights_sha256"] = file_sha256(Path(out_dir) / "model.safetensors")  # = the run's start weights id
    (Path(out_dir) / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"done: final loss {info['final_loss']:.3f}, happy rate {info.get('sample_happy_rate', float('nan')):.2f}")
    return info


def cli(argv: list[str] | None, description: str, ensure, build) -> None:
    """Command line of a cached model: ``--rebuild``, and the internal ``--build-into`` of the build subprocess."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rebuild", action="store_true", help="rebuild even if a built model is cached")
    parser.add_argument("--pin", action="store_true", help=f"copy the cached build into {PINNED_DIR} (committed: "
                        "every machine then starts from these weights), replacing a pinned build of the same version")
    parser.add_argument("--build-into", type=Path, help=argparse.SUPPRESS)  # internal: the build subprocess
    args = parser.parse_args(argv)
    if args.build_into is not None:
        build(args.build_into)
        return
    path = ensure(rebuild=args.rebuild)
    print(path)
    print((path / "build_info.json").read_text())
    if args.pin:
        pin(path)


def pin(path: Path) -> Path:
    """Copy the build at ``path`` to ``PINNED_DIR / path.name``, saying which weights it replaces."""
    target = PINNED_DIR / path.name
    old = json.loads((target / "build_info.json").read_text())["weights_sha256"] if pinned_build(target) else None
    new = json.loads((path / "build_info.json").read_text())["weights_sha256"]
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(path, target)
    print(f"pinned {target}: weights {new[:8]}" + (f" (replacing {old[:8]})" if old and old != new else ""))
    return target


def main(argv: list[str] | None = None) -> None:
    cli(argv, "Build (once) and show the builtin offline model.", ensure_builtin, build_builtin)


if __name__ == "__main__":
    main()
