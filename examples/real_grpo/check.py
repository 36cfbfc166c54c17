"""Reload the trained actor with transformers and generate: the example's last step.

    python examples/real_grpo/check.py out/real_grpo

loads ``out/real_grpo/trained/actor`` with ``AutoModelForCausalLM`` and its tokenizer files, answers
a few of the task's prompts greedily, and prints each response with its reward next to the same
prompt answered by the model before training (``out/real_grpo/model``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reward import score  # noqa: E402


def answer(model_dir: Path, prompts: list[str]) -> list[str]:
    import torch
    import transformers
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos = tok.token_to_id("<eos>")
    out = []
    for p in prompts:
        text = env.from_string(template).render(messages=[{"role": "user", "content": p}], add_generation_prompt=True)
        ids = torch.tensor([tok.encode(text, add_special_tokens=False).ids])
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        out.append(tok.decode(got[0, ids.shape[1]:].tolist(), skip_special_tokens=True))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the directory make_assets.py wrote (with trained/ from the run)")
    ap.add_argument("--rows", type=int, default=6, help="prompts to answer (default 6)")
    args = ap.parse_args()
    rows = [json.loads(line) for line in (args.out / "train.jsonl").read_text().splitlines()[:args.rows]]
    prompts = [r["prompt"] for r in rows]
    before, after = answer(args.out / "model", prompts), answer(args.out / "trained" / "actor", prompts)
    for r, b, a in zip(rows, before, after):
        print(f"{r['prompt']!r}: before {b!r} ({score('', b, r['ground_truth']):.2f}) -> "
              f"after {a!r} ({score('', a, r['ground_truth']):.2f})")
    mean = [sum(score("", x, r["ground_truth"]) for x, r in zip(xs, rows)) / len(rows) for xs in (before, after)]
    print(f"mean reward of greedy answers: before {mean[0]:.3f}, after {mean[1]:.3f}")


if __name__ == "__main__":
    main()
