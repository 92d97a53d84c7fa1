"""Context distillation on an environment (CPU): a FrozenLake teacher given a hint the student lacks.

The builtin_env model plays FrozenLake at chance (its pretraining transcripts are random play) and ignores
any context. As for ``builtin_mood`` (a title the teacher is given), the context must mean something to the
model, so stage 1 teaches it one:

1. Hint model: builtin_env fine-tuned (next-token loss on the agent's answers, ``FT_STEPS`` steps) on
   ``FT_DOCS`` documents, half ``HINT + " " + an expert episode`` (the BFS move from every state, non-slippery 4x4 maps),
   half an unhinted random-policy episode (builtin_env's own corpus recipe). Corpus levels start at
   ``CORPUS_LEVELS``, far from the training (0..) and held-out (100000..) levels.
2. Baseline: the hint model's success on ``N_MAPS`` held-out non-slippery maps (5 turns), sampled at
   temperature 1 (torch seed 0) and greedy, without the hint (the student) and with it (the teacher).
3. Pure distillation through train.py (``--env frozenlake --env_params slippery=false --teacher_model <hint
   model> --teacher_context HINT --teacher_tau 1 --student_tau 1 --adv_tau 0 --skip_verification``): no task
   reward is computed; the student's success (no hint) is measured at every checkpoint.

    uv run python experiments/distill_env_experiment.py [--out experiments/results/distill_env.md]

Uses the environments' public API only (make_env, run_episodes, Trajectory.history_text, answer_text,
shortest_actions). Stages whose outputs exist are reused.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402

from environments.base import SEPARATOR, Trajectory, answer_text, make_env, run_episodes  # noqa: E402
from environments.base import truncate_after_answer  # noqa: E402
from environments.solvers import shortest_actions  # noqa: E402
from trl_ext.env.args import HELDOUT_LEVELS
from trl_ext.env.episodes import decode_agent  # noqa: E402
from trl_ext.models import load_model_and_tokenizer  # noqa: E402

OUT = ROOT / "output" / "distill_env"
HINT = "hint : go to the goal ."
ICE = {"slippery": False}
CORPUS_LEVELS = 3_000_000
FT_DOCS, FT_STEPS, FT_BATCH, FT_LR = 6000, 400, 32, 1e-3
N_MAPS, TURNS, NEW_TOKENS = 200, 5, 16
DISTILL = ["--env", "frozenlake", "--env_params", "slippery=false", "--teacher_context", HINT, "--teacher_tau", "1",
           "--student_tau", "1", "--adv_tau", "0", "--skip_verification", "--beta", "0", "--batch_size", "32",
           "--n_rollout", "8", "--max_completion_length", str(NEW_TOKENS), "--logging_steps", "5", "--no_wandb"]  # fmt: skip


def expert_move(env, rng: random.Random) -> str:
    try:
        return shortest_actions(env)[0]
    except ValueError:  # no path from here (a walled-in goal): any move
        return rng.choice(env.action_words)


def corpus(n: int, seed: int = 0) -> list[tuple[bool, Trajectory]]:
    """(hinted, episode): half hinted expert episodes, half unhinted random ones, interleaved."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        env = make_env("frozenlake", **ICE)
        expert = i % 2 == 0
        policy = (lambda ts, e=env: [answer_text(expert_move(e, rng))]) if expert else (
            lambda ts, e=env: [answer_text(rng.choice(e.action_words))])  # fmt: skip
        (traj,) = run_episodes([env], policy, [CORPUS_LEVELS + i], TURNS)
        docs.append((expert, traj))
    return docs


def doc_tokens(tok, hinted: bool, traj: Trajectory) -> tuple[list[int], list[int]]:
    """(ids, labels) of ``[HINT ]history`` + [EOS]; only the agent's answers are labelled (-100 elsewhere)."""
    ids, labels = [], []
    pieces = [("env", f"{HINT} ")] if hinted else []
    pieces += [(role, text + SEPARATOR + (traj.prefill if role == "env" else "")) for role, text in traj.segments()]
    for role, text in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if role == "agent" else [-100] * len(piece)
    full = tok((f"{HINT} " if hinted else "") + traj.history_text(), add_special_tokens=False)["input_ids"]
    if ids != full:
        raise ValueError("piecewise tokenization differs from the whole document's: the labels would be misplaced")
    return ids + [tok.eos_token_id], labels + [-100]


def fine_tune(out_dir: Path) -> dict:
    """builtin_env + ``FT_STEPS`` AdamW steps on ``corpus(FT_DOCS)``, loss on the agent's answers only."""
    model, tok = load_model_and_tokenizer("builtin_env")
    docs = [doc_tokens(tok, hinted, traj) for hinted, traj in corpus(FT_DOCS)]
    ids = [torch.tensor(x) for x, _ in docs]
    targets = [torch.tensor(y) for _, y in docs]
    assert all(tok.unk_token_id not in x for x in ids), "the corpus has [UNK] tokens"
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=FT_LR, weight_decay=0.0)
    model.train()
    losses, t0 = [], time.time()
    for step in range(FT_STEPS):
        rows = torch.randint(len(ids), (FT_BATCH,)).tolist()
        width = max(len(ids[j]) for j in rows)
        input_ids = torch.full((len(rows), width), tok.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for r, j in enumerate(rows):
            n = len(ids[j])
            input_ids[r, :n], labels[r, :n], attention[r, :n] = ids[j], targets[j], 1
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0:
            print(f"fine-tune step {step} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    info = {"docs": FT_DOCS, "loss_on": "agent answers", "steps": FT_STEPS, "batch": FT_BATCH, "lr": FT_LR, "seconds": round(time.time() - t0),
            "final_loss": sum(losses[-20:]) / 20, "tokens": int(sum(len(x) for x in ids))}  # fmt: skip
    (out_dir / "fine_tune.json").write_text(json.dumps(info, indent=2))
    return info


def policy_fn(model, tok, prefix: str, do_sample: bool):
    def policy(trajs):
        texts = [prefix + t.history_text() for t in trajs]
        enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=do_sample, top_k=0, top_p=1.0,
                                 temperature=1.0, pad_token_id=tok.pad_token_id)  # fmt: skip
        return [truncate_after_answer(decode_agent(tok, g.tolist())) for g in out[:, enc["input_ids"].shape[1] :]]

    return policy


def success(model_dir: str, hint: bool) -> dict:
    """Success rate on N_MAPS held-out maps, sampled (torch seed 0) and greedy."""
    model, tok = load_model_and_tokenizer(model_dir)
    model.eval()
    seeds = list(range(HELDOUT_LEVELS, HELDOUT_LEVELS + N_MAPS))
    out = {}
    for mode, do_sample in (("sampled", True), ("greedy", False)):
        torch.manual_seed(0)
        envs = [make_env("frozenlake", **ICE) for _ in seeds]
        trajs = run_episodes(envs, policy_fn(model, tok, f"{HINT} " if hint else "", do_sample), seeds, TURNS)
        out[mode] = sum(t.success for t in trajs) / N_MAPS
    return out


def oracle() -> float:
    seeds = list(range(HELDOUT_LEVELS, HELDOUT_LEVELS + N_MAPS))
    envs = {s: make_env("frozenlake", **ICE) for s in seeds}
    rng = random.Random(0)
    trajs = run_episodes([envs[s] for s in seeds], lambda ts: [answer_text(expert_move(envs[t.seed], rng)) for t in ts],
                         seeds, TURNS)  # fmt: skip
    return sum(t.success for t in trajs) / N_MAPS


def distill(model_dir: Path, name: str, steps: int, lr: str, save_every: int) -> Path:
    run_dir = OUT / name
    if (run_dir / "run_summary.json").is_file():
        return run_dir
    argv = [*DISTILL, "--model", str(model_dir), "--teacher_model", str(model_dir), "--lr", lr, "--max_steps",
            str(steps), "--save_steps", str(save_every), "--output_dir", str(OUT), "--run_name", name]  # fmt: skip
    print("$ nice train.py", " ".join(argv), flush=True)
    t0 = time.time()
    proc = subprocess.run(["nice", "-n", "10", sys.executable, "train.py", *argv], cwd=ROOT, capture_output=True,
                          text=True)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"train.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    (run_dir / "wall_seconds.txt").write_text(f"{time.time() - t0:.0f}\n")
    return run_dir


def logged(run_dir: Path, key: str) -> list[tuple[int, float]]:
    ckpt = max(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    state = json.loads((ckpt / "trainer_state.json").read_text())
    return [(h["step"], h[key]) for h in state["log_history"] if key in h]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "distill_env.md"))
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--lr", default="5e-4")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    model_dir = OUT / "hint_model"
    results_path = OUT / "results.json"
    res = json.loads(results_path.read_text()) if results_path.is_file() else {}
    if not (model_dir / "fine_tune.json").is_file():
        res["fine_tune"] = fine_tune(model_dir)
    res.setdefault("fine_tune", json.loads((model_dir / "fine_tune.json").read_text()))
    res.setdefault("oracle", oracle())
    res.setdefault("builtin_env", {"student": success("builtin_env", False), "teacher": success("builtin_env", True)})
    res.setdefault("start", {"student": success(str(model_dir), False), "teacher": success(str(model_dir), True)})
    print(json.dumps(res, indent=2), flush=True)
    name = f"pure_distill_lr{args.lr}_st{args.steps}"
    run_dir = distill(model_dir, name, args.steps, args.lr, max(1, args.steps // 2))
    for ckpt in sorted(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])):
        res.setdefault(name, {})[ckpt.name] = success(str(ckpt), False)
    res[name]["wall_seconds"] = float((run_dir / "wall_seconds.txt").read_text())
    res[name]["distill_kl"] = logged(run_dir, "distill/kl")
    res[name]["env_success_train"] = logged(run_dir, "env/success")
    results_path.write_text(json.dumps(res, indent=2))
    write_table(Path(args.out), res, name)
    print(Path(args.out).read_text())


def write_table(path: Path, r: dict, name: str) -> None:
    ckpts = sorted((k for k in r[name] if k.startswith("checkpoint-")), key=lambda k: int(k.split("-")[1]))
    rows = [f"| builtin_env (no fine-tune) | {r['builtin_env']['student']['sampled']:.3f} / "
            f"{r['builtin_env']['student']['greedy']:.3f} | {r['builtin_env']['teacher']['sampled']:.3f} / "
            f"{r['builtin_env']['teacher']['greedy']:.3f} |",
            f"| hint model, step 0 | {r['start']['student']['sampled']:.3f} / {r['start']['student']['greedy']:.3f} | "
            f"{r['start']['teacher']['sampled']:.3f} / {r['start']['teacher']['greedy']:.3f} |"]  # fmt: skip
    rows += [f"| pure distillation, step {k.split('-')[1]} | {r[name][k]['sampled']:.3f} / {r[name][k]['greedy']:.3f} "
             f"| (teacher fixed) |" for k in ckpts]  # fmt: skip
    kl = r[name]["distill_kl"]
    ft = r["fine_tune"]
    text = f"""# Context distillation on FrozenLake (experiments/distill_env_experiment.py)

Non-slippery 4x4 FrozenLake, {TURNS} turns, {N_MAPS} held-out maps (seeds {HELDOUT_LEVELS}..). Success rate, sampled
(temperature 1, torch seed 0) / greedy. Student = the model on the bare prompt; teacher = the same weights with the
context `{HINT}` prepended. BFS oracle (the shortest-path move from every state): {r['oracle']:.3f}.

Hint model: builtin_env fine-tuned {ft['steps']} steps (batch {ft['batch']}, lr {ft['lr']}) on {ft['docs']} documents
(half hinted expert episodes, half unhinted random ones; {ft['tokens']} tokens; next-token loss on the agent's
answers only), final loss {ft['final_loss']:.3f},
{ft['seconds']} s.

| model | student (no hint): sampled / greedy | teacher (hint): sampled / greedy |
|---|---|---|
{chr(10).join(rows)}

Pure distillation: `train.py {' '.join(DISTILL)} --lr {name.split('_lr')[1].split('_')[0]}` (no task reward is
computed), {r[name]['wall_seconds']:.0f} s wall (niced, 2 shared cores). Logged per-token KL(student || teacher)
(`distill/kl`, k1 estimate on the agent tokens): {', '.join(f'step {s}: {v:.3f}' for s, v in kl)}.
Training-batch success (`env/success`, sampled): {', '.join(f'{s}: {v:.2f}' for s, v in r[name]['env_success_train'])}.
"""
    path.write_text(text)


if __name__ == "__main__":
    main()
