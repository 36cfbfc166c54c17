"""Make everything the real-job example needs, offline, in seconds: a small HF-format Llama, a BPE
tokenizer trained on a generated corpus, and a generated JSONL task with a rule-based reward.

    python examples/real_grpo/make_assets.py out/real_grpo

writes ``out/real_grpo/model/`` (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template) and ``out/real_grpo/train.jsonl``. The task: each
prompt asks for one colour word; `reward.score` gives a response the fraction of its words that
spell that colour (the ``ground_truth`` column). A randomly initialised model scores near 0; a few
dozen GRPO steps on 4 CPU ranks raise the mean reward. The same file has ``response`` (SFT) and
``chosen``/``rejected`` (DPO) columns, so the three algorithms run on it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLOURS = ["red", "green", "blue", "yellow"]
FILLER = ["please", "say", "the", "word", "now", "once", "again", "colour", "a", "an", "it", "is", "of", "and"]
SPECIALS = ["<pad>", "<eos>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|user|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def corpus(rng: random.Random, n: int) -> list[str]:
    words = COLOURS + FILLER
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(n)]


def rows(rng: random.Random, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        colour = rng.choice(COLOURS)
        other = rng.choice([c for c in COLOURS if c != colour])
        lead = " ".join(rng.sample(FILLER, 3))
        out.append({"prompt": f"{lead} say {colour}", "ground_truth": colour,
                    "response": " ".join([colour] * 3), "chosen": " ".join([colour] * 3),
                    "rejected": " ".join([other] * 3)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="directory to write model/ and train.jsonl into")
    ap.add_argument("--rows", type=int, default=256, help="rows of the task (default 256)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(args.seed)
    model_dir = args.out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    # Characters, then merges up to whole words: a small vocabulary, so a random model's words are
    # often real ones and the reward is dense from the first step.
    tok = Tokenizer(models.BPE(unk_token="<pad>", end_of_word_suffix="</w>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    trainer = trainers.BpeTrainer(vocab_size=72, special_tokens=SPECIALS, show_progress=False,
                                  end_of_word_suffix="</w>")
    tok.train_from_iterator(corpus(rng, 2000), trainer=trainer)
    tok.save(str(model_dir / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    pad, eos = tok.token_to_id("<pad>"), tok.token_to_id("<eos>")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    cfg = transformers.LlamaConfig(vocab_size=-(-vocab // 4) * 4, hidden_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                   max_position_embeddings=128, eos_token_id=eos, pad_token_id=pad,
                                   bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)
    with open(args.out / "train.jsonl", "w", encoding="utf-8") as f:
        for row in rows(rng, args.rows):
            f.write(json.dumps(row) + "\n")
    print(f"wrote {model_dir} ({vocab} tokens) and {args.out / 'train.jsonl'} ({args.rows} rows)")


if __name__ == "__main__":
    main()
