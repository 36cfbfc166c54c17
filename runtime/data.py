"""Real data: a model directory's tokenizer, and dataset files turned into the rows of each step.

**Tokenizer** (`Tokenizer`): ``tokenizer.json`` through the `tokenizers` library; the chat
template of ``tokenizer_config.json`` (a Jinja template, rendered in Jinja's sandbox, as
transformers does) applied to prompts when it has one; EOS and pad ids from ``generation_config``,
``config.json`` and the tokenizer config (pad falls back to EOS, as RLHF trainers do). A tokenizer
with more ids than the model's vocabulary is refused.

**Datasets** (`Dataset`): rows of a JSONL file (one JSON object per line) or a Parquet file,
read by the keys of `plans.graph.DataSource`. Step ``k`` of a run draws the global samples
``(k-1)*n .. k*n-1``; sample ``i`` is row ``perm_e[i mod N]`` of epoch ``e = i // N``, where
``perm_e`` is a seeded permutation (or the file order without shuffling). Rows are a pure
function of (seed, step): every rank, the single-process reference and a resumed run draw the
same ones without communicating, and a checkpoint's step is the data position.

What a row becomes, by the input's name:

- ``prompts`` [n, L] left-padded with the pad id, and ``pad`` [n] (the padding of each row): the
  model computes each row exactly as alone (`runtime.model.row_positions`); the prompt text and
  the row's `extra_keys` go to the reward function (`RowInfo`).
- ``tokens`` [n, L] = prompt, response, EOS, then right padding; ``mask`` [n, L-1] marks the
  predictions of the response tokens and EOS.
- ``pairs`` [2n, L]: each row's chosen and rejected sequences, consecutively, masked the same way.

A row that does not fit is an error naming it (or, with ``truncation='left'``, keeps its last
tokens); a missing file, a missing key or a row of the wrong type is an error naming the file
and the row.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from plans.base import loads_json
from plans.datafile import read_rows
from plans.errors import PlannerError
from plans.graph import DataInput


@dataclass
class Tokenizer:
    """The tokenizer of an HF model directory."""

    directory: Path
    backend: Any
    eos_id: int
    pad_id: int
    template: str | None
    specials: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, directory: str | Path, *, vocab_size: int) -> Tokenizer:
        from tokenizers import Tokenizer as Backend

        path = Path(directory)
        where = f"tokenizer of {str(path)!r}"
        if not (path / "tokenizer.json").is_file():
            raise PlannerError(f"model directory {str(path)!r} has no tokenizer.json",
                               hint="save the tokenizer there (tokenizer.save_pretrained(DIR)), or point the data "
                               "at a directory that has one")
        try:
            backend = Backend.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises its own exception type
            raise PlannerError(f"cannot read the {where}: {e}") from None
        size = backend.get_vocab_size(with_added_tokens=True)
        if size > vocab_size:
            raise PlannerError(f"the {where} has {size} ids, more than the model's vocab_size {vocab_size}",
                               hint="use the tokenizer the model was trained with")
        config = _json_file(path / "tokenizer_config.json")
        model_cfg = _json_file(path / "config.json")
        gen_cfg = _json_file(path / "generation_config.json")
        specials: dict[str, str] = {}
        for k in ("bos_token", "eos_token", "pad_token"):
            text = _token_text(config.get(k))
            if text is not None:
                specials[k] = text
        eos = _first_id(gen_cfg.get("eos_token_id"), model_cfg.get("eos_token_id"),
                        backend.token_to_id(specials["eos_token"]) if "eos_token" in specials else None)
        if eos is None:
            raise PlannerError(f"the {where} names no EOS token (eos_token in tokenizer_config.json, or "
                               "eos_token_id in config.json)", hint="generation needs one to know where a response ends")
        pad = _first_id(gen_cfg.get("pad_token_id"), model_cfg.get("pad_token_id"),
                        backend.token_to_id(specials["pad_token"]) if "pad_token" in specials else None)
        template = config.get("chat_template")
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(path, backend, eos, eos if pad is None else pad, template if isinstance(template, str) else None,
                   specials)

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=True).ids)

    def encode_plain(self, text: str) -> list[int]:
        """Ids of `text` without the special tokens the tokenizer adds around a sequence."""
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.backend.decode(ids, skip_special_tokens=True))

    def chat(self, prompt: str) -> str:
        """`prompt` as one user message with the chat template, ready for the assistant's reply."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        assert self.template is not None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        try:
            return env.from_string(self.template).render(
                messages=[{"role": "user", "content": prompt}], add_generation_prompt=True, **self.specials)
        except Exception as e:  # any template error: the user's file is wrong
            raise PlannerError(f"the chat template of {str(self.directory)!r} failed: {e}",
                               hint="fix it, or pass chat_template=False to read prompts as they are") from None


def _json_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = loads_json(path.read_text(encoding="utf-8"), source=str(path))
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):  # an AddedToken written out
        return str(value["content"])
    return None


def _first_id(*values: Any) -> int | None:
    for v in values:
        if isinstance(v, list) and v:
            v = v[0]
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v
    return None


@dataclass(frozen=True)
class RowInfo:
    """What the reward function gets of a prompt besides the response: its text and extra columns."""

    index: int  # the row of the file
    prompt: str
    extras: dict[str, Any]


class Dataset:
    """One input's dataset: its rows, read once, and the step batches drawn from them."""

    def __init__(self, inp: DataInput, *, vocab_size: int, tokenizers: dict[str, Tokenizer] | None = None) -> None:
        assert inp.data is not None
        self.inp, self.src = inp, inp.data
        cache = tokenizers if tokenizers is not None else {}
        if self.src.tokenizer not in cache:
            cache[self.src.tokenizer] = Tokenizer.load(self.src.tokenizer, vocab_size=vocab_size)
        self.tok = cache[self.src.tokenizer]
        self.rows = read_rows(self.src.path, fmt=self.src.format)
        keys = [self.src.prompt_key, *self.src.extra_keys,
                *(k for k in (self.src.response_key, self.src.chosen_key, self.src.rejected_key) if k)]
        for n, row in enumerate(self.rows):
            missing = [k for k in keys if k not in row]
            if missing:
                raise PlannerError(f"dataset {self.src.path!r} row {n}: no key {missing[0]!r} (it has "
                                   f"{', '.join(map(repr, list(row)[:8])) or 'none'})",
                                   hint="name the columns with the dataset's prompt/response/chosen/rejected keys")
            for k in keys[:1] + keys[1 + len(self.src.extra_keys):]:
                if not isinstance(row[k], str):
                    raise PlannerError(f"dataset {self.src.path!r} row {n}: {k!r} is a {type(row[k]).__name__}, "
                                       "not text")

    def order(self, epoch: int, *, seed: int) -> Tensor:
        n = len(self.rows)
        if not self.src.shuffle:
            return torch.arange(n)
        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{epoch}:{self.inp.name}".encode()))
        return torch.randperm(n, generator=gen)

    def indices(self, *, step: int, count: int, seed: int) -> list[int]:
        """The file rows of step `step` (from 1): `count` consecutive samples of the epoch orders."""
        n, out, orders = len(self.rows), [], {}
        for i in range((step - 1) * count, step * count):
            epoch = i // n
            if epoch not in orders:
                orders[epoch] = self.order(epoch, seed=seed)
            out.append(int(orders[epoch][i % n]))
        return out

    @property
    def per_step(self) -> int:
        """Dataset rows one step draws (a DPO pair is one row)."""
        return self.inp.seqs // 2 if self.inp.name == "pairs" else self.inp.seqs

    def epoch(self, *, samples: int) -> int:
        """The epoch in progress after `samples` rows were drawn."""
        return samples // len(self.rows)

    def _prompt_ids(self, row: dict[str, Any], n: int) -> list[int]:
        text = row[self.src.prompt_key]
        if self.src.chat_template and self.tok.template is not None:
            return self.tok.encode_plain(self.tok.chat(text))
        return self.tok.encode(text)

    def _fit(self, ids: list[int], n: int, what: str) -> list[int]:
        length = self.inp.seq_len
        if len(ids) <= length:
            return ids
        if self.src.truncation == "left":
            return ids[-length:]
        raise PlannerError(f"dataset {self.src.path!r} row {n}: the {what} is {len(ids)} tokens, more than the input's "
                           f"{length}", hint="raise the length (--prompt-len / --seq-len), drop long rows, or set "
                           "truncation='left'")

    def batch(self, *, step: int, seed: int) -> tuple[dict[str, Tensor], list[RowInfo]]:
        """The rows of step `step` and what the reward function gets of each."""
        kind, length = self.inp.name, self.inp.seq_len
        picked = self.indices(step=step, count=self.per_step, seed=seed)
        info = [RowInfo(n, self.rows[n][self.src.prompt_key], {k: self.rows[n][k] for k in self.src.extra_keys})
                for n in picked]
        if kind == "prompts":
            seqs = [self._fit(self._prompt_ids(self.rows[n], n), n, "prompt") for n in picked]
            tokens = torch.full((len(seqs), length), self.tok.pad_id, dtype=torch.int64)
            pad = torch.tensor([length - len(s) for s in seqs], dtype=torch.int64)
            for r, s in enumerate(seqs):
                tokens[r, length - len(s):] = torch.tensor(s, dtype=torch.int64)
            return {"tokens": tokens, "pad": pad}, info
        keys = [self.src.response_key] if kind == "tokens" else [self.src.chosen_key, self.src.rejected_key]
        tokens = torch.full((len(picked) * len(keys), length), self.tok.pad_id, dtype=torch.int64)
        mask = torch.zeros(tokens.shape[0], length - 1, dtype=torch.bool)
        for r, n in enumerate(picked):
            prompt = self._prompt_ids(self.rows[n], n)
            for j, key in enumerate(keys):
                response = self.tok.encode_plain(self.rows[n][str(key)]) + [self.tok.eos_id]
                ids = self._fit(prompt + response, n, f"prompt and {key}")
                reply = min(len(response), len(ids))
                row = r * len(keys) + j
                tokens[row, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
                mask[row, len(ids) - reply - 1:len(ids) - 1] = True  # predicting each response token and EOS
        return {"tokens": tokens, "mask": mask}, info


def open_dataset(inp: DataInput, *, vocab_size: int, tokenizers: dict[str, Tokenizer]) -> Dataset:
    """The dataset of a plan's input, checked against what the plan recorded of its file."""
    dataset = Dataset(inp, vocab_size=vocab_size, tokenizers=tokenizers)
    assert inp.data is not None
    if len(dataset.rows) != inp.data.rows:
        raise PlannerError(f"dataset {inp.data.path!r} has {len(dataset.rows)} rows, but the plan was compiled for "
                           f"{inp.data.rows}: the file changed", hint="recompile the plan for the file as it is now")
    return dataset
