"""LoRA merged into the base weights before compression (adls_lightning.lora), checked against PEFT's own merge."""

from __future__ import annotations

import copy

import pytest
import torch

from adls_lightning.build import build
from adls_lightning.lora import merged_state
from adls_lightning.module import parameter_metrics

# every test here starts training runs or processes (minutes in all): `make test-fast` skips them
pytestmark = pytest.mark.slow


def _lora_module(compose_cfg, *overrides: str):
    torch.manual_seed(0)
    module = build(compose_cfg(list(overrides)).model, "model", _convert_="partial")
    # Trained adapters and head: B is zero at initialisation, which would make any merge look right.
    with torch.no_grad():
        for name, param in module.named_parameters():
            if ".lora_" in name or "modules_to_save" in name:
                param.normal_(0, 0.05)
    return module.eval()


def _batch(seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 1000, (3, 17), generator=gen)
    mask = torch.ones_like(input_ids)
    mask[1, 9:] = 0
    return {"input_ids": input_ids, "attention_mask": mask}


def test_unmerged_state_maps_to_pefts_merge_bit_for_bit(compose_cfg):
    module = _lora_module(compose_cfg)
    unmerged = copy.deepcopy(module.state_dict())
    reference = copy.deepcopy(module)
    reference.model = reference.model.merge_and_unload()  # PEFT's merge, the independent expectation
    expected = reference.state_dict()
    module.merge_lora()
    scalings = {}  # recomputed here from the config: alpha / r for every adapted layer
    cfg = compose_cfg([]).model.lora
    for key in unmerged:
        if ".lora_A." in key:
            layer = key.removeprefix("model.base_model.model.").split(".lora_A.")[0]
            scalings[layer] = cfg.lora_alpha / cfg.r
    converted = merged_state(unmerged, "model.", scalings)
    assert converted.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(converted[key], value), key


def test_merge_leaves_no_adapters_and_keeps_the_function(compose_cfg):
    module = _lora_module(compose_cfg)
    with torch.no_grad():
        before = module(**_batch()).logits
    lora_before = parameter_metrics(module)["model/lora_params"]
    assert module.merge_lora() == lora_before > 0
    assert module.merge_lora() == 0  # idempotent
    names = [n for n, _ in module.named_modules()]
    assert not any("lora_" in n or "base_layer" in n or "modules_to_save" in n for n in names)
    assert parameter_metrics(module)["model/lora_params"] == 0
    assert all(p.requires_grad for p in module.parameters())
    with torch.no_grad():
        after = module(**_batch()).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_an_unmerged_checkpoint_loads_into_the_merged_model(compose_cfg):
    trained = _lora_module(compose_cfg)
    state = copy.deepcopy(trained.state_dict())
    with torch.no_grad():
        expected = trained(**_batch(2)).logits
    fresh = _lora_module(compose_cfg)
    with torch.no_grad():
        for param in fresh.parameters():
            param.add_(1.0)  # nothing of the fresh weights may survive the load
    fresh.merge_lora()
    fresh.load_state_dict(state, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(**_batch(2)).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("merged_lr", [None, 1e-5])
def test_merged_weights_train_at_their_own_lr(compose_cfg, merged_lr):
    module = _lora_module(compose_cfg, f"++model.merged_lr={merged_lr if merged_lr else 'null'}")
    module.merge_lora()
    groups = module._param_groups()
    trainable = sum(p.numel() for p in module.parameters())
    assert sum(p.numel() for g in groups for p in g["params"]) == trainable
    if merged_lr is None:
        assert len(groups) == 1
    else:
        head, base = groups
        head_names = {n for n, p in module.named_parameters() if "classifier" in n or "pooler" in n}
        assert sum(p.numel() for p in head["params"]) == sum(
            p.numel() for n, p in module.named_parameters() if n in head_names
        )
        assert base["lr"] == merged_lr and "lr" not in head


@pytest.mark.parametrize(
    "overrides",
    [["quant=int8"], ["quant=int8", "quant.mode=ptq"], ["prune=l1_0.5"], ["quant=int8", "prune=l1_0.5"]],
    ids=["qat", "ptq", "prune", "qat+prune"],
)
def test_compressed_runs_deploy_no_adapters_when_merging(compose_cfg, tmp_path, overrides):
    from adls_lightning.app.training import run

    cfg = compose_cfg(
        ["trainer.max_epochs=1", "model.merge_lora_before_compress=true", "model.merged_lr=1e-3", *overrides]
    )
    metrics = run(cfg)
    assert metrics["model/lora_params"] == 0
    best = next((tmp_path / "run" / "checkpoints").glob("best-*.ckpt"))
    keys = torch.load(best, map_location="cpu", weights_only=False)["state_dict"].keys()
    if overrides[-1] != "quant.mode=ptq":  # PTQ trains LoRA first; its checkpoints are the unmerged fine-tune
        assert not [k for k in keys if "lora_" in k or "base_layer" in k or "modules_to_save" in k]
    if "quant=int8" in overrides:
        assert metrics["quant/layers"] > 0
    if "prune=l1_0.5" in overrides:
        assert metrics["prune/weight_sparsity"] == pytest.approx(0.5, abs=0.01)


def test_unmerged_adapters_stay_when_asked(compose_cfg):
    from adls_lightning.app.training import run

    metrics = run(
        compose_cfg(["trainer.max_epochs=1", "quant=int8", "model.merge_lora_before_compress=false"])
    )
    assert metrics["model/lora_params"] > 0
