"""verl 0.9.1 accepts every export: Hydra composes it with verl's own trainer config (no `+key`
appends: a key verl does not have fails), `validate_config` passes as `main_ppo` calls it, and
the roles verl will run are the plan's (reference, critic and reward model on exactly when the
plan has them).

Nothing is stubbed: composing and validating needs no GPU and no Ray cluster; the model
directories are the config-and-tokenizer ones `tests.engines.matrix` writes."""

from __future__ import annotations

import os

import pytest
from conftest import exports, ids, load, plan_of, words

EXPORTS = exports("verl")


def compose(text: str):  # noqa: ANN201
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    argv = words(text)
    assert argv[:3] == ["python3", "-m", "verl.trainer.main_ppo"], argv[:3]
    name = "ppo_trainer"
    rest = argv[3:]
    if rest[:1] == ["--config-name"]:
        name, rest = rest[1], rest[2:]
    assert all("=" in w and not w.startswith("+") for w in rest), rest
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        return hydra_compose(name, overrides=rest)


@pytest.mark.parametrize("path", EXPORTS, ids=ids(EXPORTS))
def test_verl_composes_and_validates_each_export(path) -> None:  # noqa: ANN001
    doc = load(path)
    plan = plan_of(path)
    kinds = {c["kind"] for c in plan["calls"]}
    if "refused" in doc:
        assert "generate" not in kinds, f"an RLHF plan was refused: {doc['refused']}"
        return
    from verl.trainer.ppo.utils import need_critic, need_reference_policy, need_reward_model
    from verl.utils.config import validate_config

    cfg = compose(doc["text"])
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    models = plan["models"]
    has_ref = any(c["kind"] == "inference" and c["returns"] == "logprobs" and not models[c["model"]]["trainable"]
                  for c in plan["calls"])
    has_critic = any(c["kind"] == "train" and models[c["model"]]["head"] == "value" for c in plan["calls"])
    has_rm = any(c["kind"] == "inference" and c["returns"] == "scores" for c in plan["calls"])
    assert need_reference_policy(cfg) == has_ref
    assert need_critic(cfg) == has_critic
    assert need_reward_model(cfg) == has_rm
    gpus = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if cfg.reward.reward_model.enable and cfg.reward.reward_model.enable_resource_pool:
        gpus += cfg.reward.reward_model.nnodes * cfg.reward.reward_model.n_gpus_per_node
    world = plan["cluster"]["nodes"] * plan["cluster"]["gpus_per_node"]
    assert gpus <= world, f"asks for {gpus} GPUs on a cluster of {world}"
